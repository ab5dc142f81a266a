"""Pure distillation and co-training step functions, and their one-time jit with shardings.

distill_step: the frozen teacher's logits (stop-gradient) and the draft's update in one jitted
call; the teacher's params are an argument, never donated, never differentiated, with no
optimizer state. cotrain_step: the target's cross-entropy step and the draft's distillation step
from the target's logits of that same forward (before the target's update) in one jitted call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from specjax.distill.divergences import distill_loss, get_divergence
from specjax.distill.sources import data_masks
from specjax.models import apply
from specjax.parallel import replicated
from specjax.parallel.sharding import on_mesh
from specjax.train.losses import mean_loss, next_token_loss

STEP_KEYS = ('tokens', 'positions', 'segment_ids', 'loss_mask', 'ce_mask')


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Static (hashable) description of the draft's loss, from config.distill."""

    divergence: str = 'fkl'
    beta: float = 0.5
    block_size: int = 4
    temperature: float = 1.0
    scale_by_t2: bool = False
    kd_weight: float = 1.0
    ce_weight: float = 0.0

    @classmethod
    def from_config(cls, d) -> LossSettings:
        return cls(
            divergence=d.divergence,
            beta=float(d.beta),
            block_size=int(d.block_size),
            temperature=float(d.loss_temperature),
            scale_by_t2=bool(d.scale_by_t2),
            kd_weight=float(d.kd_weight),
            ce_weight=float(d.ce_weight),
        )


@flax.struct.dataclass
class CotrainState:
    """Target (params, opt_state) and draft (draft_params, draft_opt_state); step, raw rng."""

    step: jax.Array
    params: Any
    opt_state: Any
    draft_params: Any
    draft_opt_state: Any
    rng: jax.Array


def forward(graphdef, params, batch):
    """The model's logits for a step's batch: [B, T, V], or [B, E, V] at batch['logits_at']."""
    return apply(
        graphdef, params, batch['tokens'], batch['positions'], batch['segment_ids'],
        logits_at=batch.get('logits_at'),
    )  # fmt: skip


def draft_loss(graphdef, params, teacher_logits, batch, loss: LossSettings):
    """Distillation loss of the draft against fixed teacher logits -> (loss, metrics).

    Every position but the last: teacher [B, T, V], masks [B, T - 1] (position t predicts token
    t + 1). With batch['logits_at'] int32 [B, E] only those positions: teacher [B, E, V] and
    masks [B, E], the draft's output head run on E rows (the online buffer's entries).
    """
    logits = forward(graphdef, params, batch)
    tokens, at = batch['tokens'], batch.get('logits_at')
    if at is None:
        logits, targets = logits[:, :-1], tokens[:, 1:]
        teacher_logits = None if teacher_logits is None else teacher_logits[:, :-1]
    else:
        targets = jnp.take_along_axis(tokens, jnp.minimum(at + 1, tokens.shape[1] - 1), axis=1)
    div_fn = get_divergence(loss.divergence, beta=loss.beta, block_size=loss.block_size)
    return distill_loss(
        div_fn,
        teacher_logits,
        logits,
        batch['loss_mask'],
        temperature=loss.temperature,
        scale_by_t2=loss.scale_by_t2,
        kd_weight=loss.kd_weight,
        ce_weight=loss.ce_weight,
        ce_targets_BT=targets,
        ce_mask_BT=batch['ce_mask'],
    )


def _update(params, opt_state, grads, tx):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def draft_update(graphdef, params, opt_state, teacher_logits, batch, *, tx, loss):
    """One optimizer step of the draft toward teacher logits (draft_loss's layouts) ->
    (params, opt_state, metrics)."""
    grad_fn = jax.value_and_grad(functools.partial(draft_loss, graphdef), has_aux=True)
    (_, metrics), grads = grad_fn(params, jax.lax.stop_gradient(teacher_logits), batch, loss)
    params, opt_state = _update(params, opt_state, grads, tx)
    metrics['grad_norm'] = optax.tree.norm(grads)
    return params, opt_state, metrics


def distill_step(draft_gd, teacher_gd, state, teacher_params, batch, *, tx, schedule, loss):
    """TrainState of the draft + frozen teacher params + batch -> (state, metrics).

    With kd_weight 0 (cross-entropy only) the teacher's forward is skipped: same loss and update.
    """
    teacher_logits = None
    if loss.kd_weight:
        teacher_logits = jax.lax.stop_gradient(forward(teacher_gd, teacher_params, batch))
    params, opt_state, metrics = draft_update(
        draft_gd, state.params, state.opt_state, teacher_logits, batch, tx=tx, loss=loss
    )
    metrics['lr'] = schedule(state.step)
    rng, _ = jax.random.split(state.rng)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng), metrics


def cotrain_step(target_gd, draft_gd, state: CotrainState, batch, *, tx, schedule, loss):
    """Target CE step + draft distillation from the same (pre-update) target forward.

    batch: packed data rows (tokens, positions, segment_ids); the draft's masks are the
    next-token targets. One target forward only: its logits feed both the target's loss and,
    stop-gradient, the draft's.
    """

    def target_loss(params):
        logits = forward(target_gd, params, batch)
        loss_BT, mask_BT = next_token_loss(logits, batch['tokens'], batch['segment_ids'])
        value, _ = mean_loss(loss_BT, mask_BT)
        return value, logits

    (target_ce, logits), grads = jax.value_and_grad(target_loss, has_aux=True)(state.params)
    params, opt_state = _update(state.params, state.opt_state, grads, tx)
    mask = data_masks(batch['segment_ids'])
    draft_batch = dict(batch, loss_mask=mask, ce_mask=mask)
    draft_params, draft_opt_state, dm = draft_update(
        draft_gd, state.draft_params, state.draft_opt_state, logits, draft_batch, tx=tx, loss=loss
    )
    metrics = {f'draft_{k}': v for k, v in dm.items()}
    metrics.update(
        loss=target_ce + dm['loss'],
        target_loss=target_ce,
        target_grad_norm=optax.tree.norm(grads),
        lr=schedule(state.step),
    )
    rng, _ = jax.random.split(state.rng)
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        draft_params=draft_params,
        draft_opt_state=draft_opt_state,
        rng=rng,
    )
    return new_state, metrics


def jit_distill_step(
    draft_gd,
    teacher_gd,
    tx,
    schedule,
    loss,
    state_shardings,
    teacher_shardings,
    batch_sharding,
    mesh,
):
    """distill_step jitted once; the draft state is donated, the teacher's params are not."""
    return jax.jit(
        on_mesh(
            functools.partial(
                distill_step, draft_gd, teacher_gd, tx=tx, schedule=schedule, loss=loss
            ),
            mesh,
        ),
        in_shardings=(state_shardings, teacher_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=0,
    )


def jit_cotrain_step(
    target_gd, draft_gd, tx, schedule, loss, state_shardings, batch_sharding, mesh
):
    """cotrain_step jitted once with explicit shardings, state donated."""
    return jax.jit(
        on_mesh(
            functools.partial(
                cotrain_step, target_gd, draft_gd, tx=tx, schedule=schedule, loss=loss
            ),
            mesh,
        ),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=0,
    )


def step_batch(batch: dict) -> dict:
    """The arrays a distill step reads (drops host-only fields like per-row domain ids)."""
    return {k: batch[k] for k in STEP_KEYS}
