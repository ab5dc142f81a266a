"""Pure pretraining step functions and their one-time jit with explicit shardings."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from specjax.models import apply
from specjax.parallel import replicated
from specjax.parallel.sharding import on_mesh
from specjax.train.losses import domain_sums, mean_loss, next_token_loss
from specjax.train.state import TrainState

BATCH_KEYS = ('tokens', 'segment_ids', 'positions', 'domain_ids')


def lm_loss(graphdef, params, batch):
    """Mean next-token cross-entropy over real targets; returns (loss, num_targets)."""
    logits_BTV = apply(graphdef, params, batch['tokens'], batch['positions'], batch['segment_ids'])
    loss_BT, mask_BT = next_token_loss(logits_BTV, batch['tokens'], batch['segment_ids'])
    return mean_loss(loss_BT, mask_BT)


def train_step(graphdef, state: TrainState, batch, *, tx, schedule):
    """One AdamW step on a packed batch of int32 [B, T] arrays -> (state, metrics).

    metrics: loss (mean over real targets), grad_norm (before clipping), lr (used for this
    step), targets (number of real targets).
    """
    grad_fn = jax.value_and_grad(functools.partial(lm_loss, graphdef), has_aux=True)
    (loss, count), grads = grad_fn(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    rng, _ = jax.random.split(state.rng)
    metrics = {
        'loss': loss,
        'grad_norm': optax.tree.norm(grads),
        'lr': schedule(state.step),
        'targets': count,
    }
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    return new_state, metrics


def eval_step(graphdef, params, batch, *, num_domains: int):
    """Loss sums for validation: overall and per domain id in [0, num_domains) (float32)."""
    logits_BTV = apply(graphdef, params, batch['tokens'], batch['positions'], batch['segment_ids'])
    loss_BT, mask_BT = next_token_loss(logits_BTV, batch['tokens'], batch['segment_ids'])
    sums, counts = domain_sums(loss_BT, mask_BT, batch['domain_ids'][:, 1:], num_domains)
    return {
        'loss_sum': jnp.sum(loss_BT),
        'count': jnp.sum(mask_BT, dtype=jnp.float32),
        'domain_loss_sum': sums,
        'domain_count': counts,
    }


def jit_train_step(graphdef, tx, schedule, state_shardings, batch_shardings, mesh):
    """train_step jitted once: explicit in/out shardings, state donated."""
    return jax.jit(
        on_mesh(functools.partial(train_step, graphdef, tx=tx, schedule=schedule), mesh),
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=0,
    )


def jit_eval_step(graphdef, params_shardings, batch_shardings, mesh, num_domains: int):
    """eval_step jitted once with explicit shardings (params are not donated)."""
    return jax.jit(
        functools.partial(eval_step, graphdef, num_domains=num_domains),
        in_shardings=(params_shardings, batch_shardings),
        out_shardings=replicated(mesh),
    )
