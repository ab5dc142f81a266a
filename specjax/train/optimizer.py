"""AdamW with linear warmup + cosine decay and global-norm clipping, built from config.train."""

from __future__ import annotations

import jax
import optax

from specjax.models.layout import stacked_axes


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    """Linear warmup 0 -> lr over warmup_steps, cosine decay to lr * min_lr_ratio at `steps`."""
    steps, warmup = int(train_cfg.steps), int(train_cfg.warmup_steps)
    warmup = min(warmup, steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train_cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=train_cfg.lr * train_cfg.min_lr_ratio,
    )


def decay_mask(params):
    """True for matrices (weights, embeddings); False for vectors (norm scales, biases).

    A scan_layers model's stacked blocks are judged without their leading layer axis.
    """
    return jax.tree_util.tree_map_with_path(lambda path, p: p.ndim - stacked_axes(path) > 1, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) then AdamW(schedule, b1, b2, eps, masked weight decay)."""
    clip = (
        optax.clip_by_global_norm(train_cfg.grad_clip)
        if train_cfg.grad_clip > 0
        else (optax.identity())
    )
    return optax.chain(
        clip,
        optax.adamw(
            learning_rate=learning_rate_schedule(train_cfg),
            b1=train_cfg.b1,
            b2=train_cfg.b2,
            eps=train_cfg.eps,
            weight_decay=train_cfg.weight_decay,
            mask=decay_mask,
        ),
    )
