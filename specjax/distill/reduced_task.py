"""The reduced-vocabulary draft (specjax.distill.reduced_train) as a Task for the shared loop.

`build_task` describes one draft run to specjax.train.loop.run_loop, which checkpoints, resumes
bit-identically, stops on SIGTERM and writes metrics.jsonl as for every other training mode:
- state: a TrainState on one device (rng unused), params from the caller's init (random or the
  target's restricted early exit) and optimizer state from `make_optimizer`: global-norm clip 1.0
  then AdamW (weight decay 0.01, optax's b1 0.9, b2 0.999, eps 1e-8) with a warmup + cosine
  schedule from 0 to train.lr and down to 0.1 train.lr at train.steps;
- batches: `RowOrder`, the cached rows in fresh permutations of default_rng(seed), batch_size a
  step (the same order for every draft of one seed), JSON state {'step': batches drawn};
- eval: held-out alpha at T = 1 and T = 0, the draft's in-set loss and the in-set fraction on the
  cache's eval rows (`evaluate`), every train.eval_every steps and at the end;
- identity: the draft's config, the tokenizer, the reduced vocabulary and a fingerprint of the
  cached arrays it reads, how it was initialised; a checkpoint of another mode lacks them.
The loop settings a draft config may leave out of config.train are `LOOP_DEFAULTS`.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from specjax.checkpoint import abstract_with_shardings
from specjax.distill import reduced_vocab as rv
from specjax.models import abstract_model, apply
from specjax.train.loop import Task
from specjax.train.losses import next_token_targets
from specjax.train.state import TrainState

MODE = 'distill_reduced'  # checkpoint metadata, the workdir lock and results.json

# config.train fields the draft reads (the optimizer's are fixed: module docstring) ...
TRAIN_FIELDS = ('steps', 'batch_size', 'lr', 'warmup_steps', 'eval_every')
# ... and run_loop's, with their defaults (None: train.eval_every, as configs/distill.py sets)
LOOP_DEFAULTS = {
    'log_every': None,  # steps between metrics.jsonl train rows (window means of loss/kd/ce)
    'checkpoint_every': None,  # steps between checkpoints (the last step is always saved)
    'keep_checkpoints': 2,  # the newest two: one to fall back on if the latest is unreadable
    'async_checkpointing': False,  # as the quickstart's drafts: a save is committed at once
    'allow_config_change': False,  # resume although result-changing fields differ
}


def loop_config(train, field: str = 'config') -> ml_collections.ConfigDict:
    """config.train with LOOP_DEFAULTS filled in; ValueError naming an unknown or bad field
    (`field`: the draft config's own name)."""
    unknown = sorted(set(train.keys()) - set(TRAIN_FIELDS) - set(LOOP_DEFAULTS))
    if unknown:
        raise ValueError(
            f'unknown field(s) {[f"{field}.train.{k}" for k in unknown]}; known: '
            f'{sorted(TRAIN_FIELDS + tuple(LOOP_DEFAULTS))} (the optimizer is fixed: '
            'specjax.distill.reduced_task)'
        )
    out = ml_collections.ConfigDict(dict(train.items()))
    out.eval_every = max(int(train['eval_every']), 1)
    for key, default in LOOP_DEFAULTS.items():
        value = train.get(key, default)
        out[key] = out.eval_every if value is None else value
    for key in ('steps', 'batch_size', 'log_every', 'checkpoint_every', 'keep_checkpoints'):
        value = out[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f'{field}.train.{key} must be a positive int, got {value!r}')
    return out


def draft_inputs(tokens, table):
    """Target ids -> draft input indices (off the set: index 0, as DraftVocab.to_draft does)."""
    idx = table[tokens]
    return np.where(idx >= 0, idx, 0).astype(np.int32)


def make_batch(arrays, prefix, rows, table):
    """Host batch of cached rows `rows` of `prefix` ('train', 'corpus', 'eval'), draft indices."""
    tokens = arrays[f'{prefix}_tokens'][rows]
    seg = arrays[f'{prefix}_segment_ids'][rows]
    targets, mask = next_token_targets(tokens, seg)
    out = {
        'inputs': draft_inputs(tokens, table),
        'positions': arrays[f'{prefix}_positions'][rows].astype(np.int32),
        'segment_ids': seg.astype(np.int32),
        'target_idx': table[targets].astype(np.int32),  # -1 off the set
        'mask': np.asarray(mask),
    }
    if prefix == 'train':
        out['topk_idx'] = arrays['train_topk_idx'][rows, :-1].astype(np.int32)
        out['topk_logp'] = arrays['train_topk_logp'][rows, :-1].astype(np.float32)
    elif prefix == 'eval':
        out['logp'] = arrays['eval_logp'][rows, :-1].astype(np.float32)
        out['argmax'] = arrays['eval_argmax'][rows, :-1].astype(np.int32)
    return out


def _logits(graphdef, params, b):
    return apply(graphdef, params, b['inputs'], b['positions'], b['segment_ids'])[:, :-1]


def make_optimizer(train):
    """(tx, schedule) of the draft: clip 1.0 + AdamW(wd 0.01), warmup + cosine to 0.1 lr."""
    steps, lr = int(train.steps), float(train.lr)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(int(train.warmup_steps), 1), max(steps, 2), lr * 0.1
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    return tx, schedule


def make_step(graphdef, tx, schedule, kd_weight: float, ce_weight: float, divergence='fkl'):
    """Jitted (TrainState, host batch) -> (TrainState, {'loss', 'kd', 'ce', 'lr'})."""

    def loss_fn(params, b):
        logits = _logits(graphdef, params, b)
        kd = 0.0
        if kd_weight:
            kd = rv.kd_loss(logits, b['topk_idx'], b['topk_logp'], b['mask'], divergence)
        ce, _ = rv.ce_loss(logits, b['target_idx'], b['mask'])
        return kd_weight * kd + ce_weight * ce, (kd, ce)

    @jax.jit
    def step(state, b):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (kd, ce)), grads = grad_fn(state.params, b)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {'loss': loss, 'kd': kd, 'ce': ce, 'lr': schedule(state.step)}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def make_eval(graphdef, ids_N):
    @jax.jit
    def sums(params, b):
        logits = _logits(graphdef, params, b)
        a1, a0, n = rv.alpha_terms(logits, b['logp'], b['argmax'], ids_N, b['mask'])
        ce, n_in = rv.ce_loss(logits, b['target_idx'], b['mask'])
        return {'alpha_T1': a1, 'alpha_T0': a0, 'positions': n, 'ce_sum': ce * n_in, 'in_set': n_in}

    return sums


def evaluate(eval_fn, params, arrays, table, batch: int) -> dict:
    """Held-out {'alpha_T1', 'alpha_T0', 'draft_val_loss', 'in_set_fraction'} on eval_* rows."""
    rows = len(arrays['eval_tokens'])
    tot = {}
    for a in range(0, rows, batch):
        b = make_batch(arrays, 'eval', np.arange(a, min(a + batch, rows)), table)
        for k, v in jax.device_get(eval_fn(params, b)).items():
            tot[k] = tot.get(k, 0.0) + float(v)
    n = max(tot['positions'], 1.0)
    return {
        'alpha_T1': tot['alpha_T1'] / n,
        'alpha_T0': tot['alpha_T0'] / n,
        'draft_val_loss': tot['ce_sum'] / max(tot['in_set'], 1.0),  # in-set positions only
        'in_set_fraction': tot['in_set'] / n,
    }


class RowOrder:
    """Host batches of `batch` cached rows (of `m`) a step: fresh permutations of
    default_rng(seed), one after another, drawn as needed. get_state() -> {'step': batches
    drawn}; set_state replays the permutations to continue from there."""

    def __init__(self, make, m: int, batch: int, seed: int):
        self._make, self._m, self._batch, self._seed = make, m, batch, seed
        self.set_state({'step': 0})

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start, end = self._step * self._batch, (self._step + 1) * self._batch
        while len(self._order) < end:
            self._order = np.concatenate([self._order, self._rng.permutation(self._m)])
        self._step += 1
        return self._make(self._order[start:end])

    def get_state(self) -> dict:
        return {'step': self._step}

    def set_state(self, state: dict) -> None:
        self._rng = np.random.default_rng(self._seed)
        self._order = np.zeros((0,), np.int64)
        self._step = int(state['step'])


def fingerprint(arrays: dict, prefixes) -> str:
    """sha256 of the cached arrays of `prefixes` (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name in sorted(k for k in arrays if k.split('_', 1)[0] in prefixes):
        a = np.ascontiguousarray(arrays[name])
        h.update(f'{name}:{a.dtype.str}:{a.shape}'.encode())
        h.update(a.tobytes())
    return h.hexdigest()


def build_task(cfg, *, arrays, prefix, table, ids, draft_cfg, make_params, identity, metadata):
    """The draft run as a loop Task; make_params() -> the initial nnx.State (only when the
    workdir has no checkpoint). identity / metadata: the caller's, added to the draft's own."""
    t = cfg.train
    batch = int(t.batch_size)
    tx, schedule = make_optimizer(t)
    graphdef, abstract_params = abstract_model(draft_cfg)
    seed = int(cfg.seed)

    def fresh(params):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.PRNGKey(seed),
        )

    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.eval_shape(fresh, abstract_params)
    abstract = abstract_with_shardings(abstract, jax.tree.map(lambda _: device, abstract))
    step = make_step(
        graphdef,
        tx,
        schedule,
        float(cfg.loss.kd_weight),
        float(cfg.loss.ce_weight),
        cfg.loss.get('divergence', 'fkl'),
    )
    eval_fn = make_eval(graphdef, ids)
    make = functools.partial(make_batch, arrays, prefix, table=table)  # rows -> host batch
    return Task(
        mode=MODE,
        init_state=lambda: fresh(make_params()),
        abstract_state=abstract,
        step=step,
        batches=RowOrder(make, len(arrays[f'{prefix}_tokens']), batch, seed),
        put_batch=lambda b: b,
        evaluate=lambda state: evaluate(eval_fn, state.params, arrays, table, batch),
        identity=dict(
            identity,
            model_config=draft_cfg.to_dict(),
            cache_sha256=fingerprint(arrays, (prefix, 'eval')),
        ),
        metadata=dict(metadata, config=cfg, num_params=draft_cfg.num_params),
        tokens_per_step=batch * arrays[f'{prefix}_tokens'].shape[1],
    )
