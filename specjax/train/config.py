"""Defaults and validation for the config.train section shared by every training mode."""

from __future__ import annotations

import ml_collections


def default_train_config() -> ml_collections.ConfigDict:
    """config.train with every field a training mode reads; configs override values, never add."""
    c = ml_collections.ConfigDict()
    c.steps = 1000  # total optimizer steps (resume continues up to this many)
    c.batch_size = 16  # global batch size in sequences
    c.lr = 3e-3  # peak learning rate
    c.min_lr_ratio = 0.1  # cosine decay ends at lr * min_lr_ratio at `steps`
    c.warmup_steps = 100  # linear warmup from 0 to lr
    c.weight_decay = 0.1  # AdamW decoupled decay on matrices (not norm scales / biases)
    c.grad_clip = 1.0  # global-norm gradient clipping (<= 0: off)
    c.b1 = 0.9  # Adam first-moment decay
    c.b2 = 0.95  # Adam second-moment decay
    c.eps = 1e-8  # Adam epsilon
    c.log_every = 20  # steps between progress lines / metrics.jsonl train rows
    c.eval_every = 200  # steps between validation passes (<= 0: only at the end)
    c.eval_batches = 8  # validation batches per pass (deterministic, same every pass)
    c.checkpoint_every = 500  # steps between checkpoints (the final step is always saved)
    c.keep_checkpoints = 3  # most recent checkpoints kept in <workdir>/checkpoints
    c.async_checkpointing = True  # write checkpoints in a background thread
    c.allow_config_change = False  # resume although result-changing fields differ (more steps)
    return c


_POSITIVE_INTS = (
    'steps',
    'batch_size',
    'log_every',
    'eval_batches',
    'checkpoint_every',
    'keep_checkpoints',
)


def check_keys(section, allowed, name: str) -> None:
    """ValueError naming `name.key` for any key of `section` not in `allowed`."""
    unknown = sorted(set(section.keys()) - set(allowed))
    if unknown:
        raise ValueError(
            f'Unknown config field(s) {[f"{name}.{k}" for k in unknown]}; known: {sorted(allowed)}'
        )


def validate_train_config(train) -> None:
    """Checks config.train against default_train_config(): known keys, sane values."""
    defaults = default_train_config()
    check_keys(train, defaults.keys(), 'config.train')
    missing = sorted(set(defaults.keys()) - set(train.keys()))
    if missing:
        raise ValueError(f'Missing config field(s) {[f"config.train.{k}" for k in missing]}')
    for key in _POSITIVE_INTS:
        value = train[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f'config.train.{key} must be a positive int, got {value!r}')
    if not isinstance(train.warmup_steps, int) or train.warmup_steps < 0:
        raise ValueError(
            f'config.train.warmup_steps must be an int >= 0, got {train.warmup_steps!r}'
        )
    if not isinstance(train.allow_config_change, bool):
        raise ValueError(
            f'config.train.allow_config_change must be True or False, got '
            f'{train.allow_config_change!r}'
        )
    if not train.lr > 0:
        raise ValueError(f'config.train.lr must be > 0, got {train.lr!r}')
    if not 0 <= train.min_lr_ratio <= 1:
        raise ValueError(f'config.train.min_lr_ratio must be in [0, 1], got {train.min_lr_ratio!r}')
    if train.weight_decay < 0:
        raise ValueError(f'config.train.weight_decay must be >= 0, got {train.weight_decay!r}')
    for key in ('b1', 'b2'):
        if not 0 <= train[key] < 1:
            raise ValueError(f'config.train.{key} must be in [0, 1), got {train[key]!r}')
