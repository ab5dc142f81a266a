"""The `feature_draft` mode: an EAGLE-3-shaped draft (specjax.models.feature_draft) trained with
the training-time-test loss (specjax.distill.feature_ttt) against a frozen target checkpoint
(config.distill.teacher_workdir), through the shared loop (checkpoints, bit-identical resume,
the workdir lock, SIGTERM -> preempted, metrics.jsonl).

Data: config.distill.source 'teacher' (default): each step the target continues the batch's
data prompts (prompt_len + max_new_tokens, config.sampling; the distill mode's generator and its
per-(seed, step) key), or 'dataset': the packed data rows. The target's features of
config.feature.feature_layers and its logits are recomputed in the step by the frozen target, or,
with config.feature.cache, read from the training batches (`features`, `target_logp`: a
specjax.distill.feature_cache the caller built for a finite row set and passes as
`feature_cache`; results.json then records its size and build time). Evaluation always runs the
frozen target (float32), cached or not.
The draft starts from the target's embedding (from_target; kept fixed with freeze_embedding),
with config.feature.init_head its final norm and head too, and is trained with config.train's
optimizer on the target's mesh (config.mesh.draft_rules).

The workdir: checkpoints whose metadata holds 'feature_draft_config' (FeatureDraftConfig.to_dict)
and 'draft_vocab' ({'ids': N target ids or None, 'target_vocab_size'}), draft_vocab.json beside
them (a reduced map only), results.json with the last evaluation (val_loss, alpha_step{j}: the
held-out TTT loss and the mean sum min(p, q) at each unrolled step, on config.train.eval_batches
held-out batches of the training source: the target's continuations of their prompts, generated
once with a fixed key, or the rows; printed and swept as specjax.distill.results'
FEATURE_DRAFT_HEADLINE_METRICS). The mode decodes nothing speculatively: measured acceptance and
tau come from spec_eval on the workdir. `load_feature_draft(workdir)` reads the draft back;
`python -m specjax.interop export_eagle3` writes it for vLLM / SGLang.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from specjax import workdir as workdir_lib
from specjax.checkpoint import Checkpoints, CorruptCheckpoint, abstract_with_shardings
from specjax.distill import feature_cache as fc
from specjax.distill import feature_ttt as ttt
from specjax.distill import sources
from specjax.distill.config import (
    feature_row_lengths,
    sampling_config,
    validate_feature_draft_config,
)
from specjax.distill.results import finish_results
from specjax.distill.sources import DistillData, load_data
from specjax.distill.teacher import check_compatible, load_teacher, precheck, teacher_step
from specjax.models import FeatureDraft, FeatureDraftConfig, TransformerConfig
from specjax.models.feature_draft import default_feature_layers, from_target
from specjax.parallel import batch_sharding, make_mesh, param_shardings
from specjax.parallel.mesh import mesh_rules
from specjax.train.loop import Task, run_loop
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.runs import batch_placer
from specjax.train.state import TrainState, state_shardings
from specjax.workdir import ConfigMismatch

MODE = 'feature_draft'
CONFIG_KEY = 'feature_draft_config'  # checkpoint metadata: FeatureDraftConfig.to_dict()
VOCAB_KEY = 'draft_vocab'  # checkpoint metadata: {'ids': [N] or None, 'target_vocab_size': V}
DRAFT_VOCAB_FILE = 'draft_vocab.json'  # as a reduced-vocabulary draft's workdir
_EVAL_TAG = 0x65766C  # separates the evaluation continuations' keys from the training ones


def read_vocab(f, target_vocab: int) -> np.ndarray | None:
    """int32 [N] target ids of config.feature.vocab_file (its first vocab_size; 0 = all), or
    None for the full vocabulary; ValueError naming the field for ids that do not fit."""
    if not f.vocab_file:
        return None
    with open(os.path.expanduser(f.vocab_file)) as fh:
        ids = np.asarray(json.load(fh)['ids'], np.int64)
    if f.vocab_size > len(ids):
        raise ValueError(
            f'config.feature.vocab_size={f.vocab_size} is above the {len(ids)} ids of '
            f'config.feature.vocab_file={f.vocab_file!r}'
        )
    ids = ids[: f.vocab_size or len(ids)]
    if ids.ndim != 1 or len(set(ids.tolist())) != len(ids) or ids.min() < 0:
        raise ValueError(f'config.feature.vocab_file={f.vocab_file!r}: ids must be distinct >= 0')
    if ids.max() >= target_vocab:
        raise ValueError(
            f'config.feature.vocab_file={f.vocab_file!r} holds id {int(ids.max())}, beyond the '
            f"target's vocab_size={target_vocab}"
        )
    return ids.astype(np.int32)


def _target_config(config) -> TransformerConfig:
    d = config.distill
    workdir = workdir_lib.resolve(d.teacher_workdir)
    step = teacher_step(workdir, int(d.teacher_step))
    with Checkpoints(workdir, read_only=True) as ckpts:
        meta = ckpts.metadata(step)
    if 'model_config' not in meta:
        raise ValueError(
            f'config.distill.teacher_workdir={workdir!r} step {step} has no model_config: '
            'not a target model'
        )
    return TransformerConfig.from_dict(meta['model_config'])


def prepare(config, *, data_config: bool = True) -> tuple[FeatureDraftConfig, np.ndarray | None]:
    """Every check that needs no data and compiles nothing -> (the draft's config, its ids):
    the config (validate_feature_draft_config), then against the target's metadata (the
    feature layers in range, its max_len, the tokenizer, the vocabulary map)."""
    validate_feature_draft_config(config)
    target = _target_config(config)
    precheck(config, target, data_config=data_config)
    f = config.feature
    layers = tuple(f.feature_layers) or default_feature_layers(target.n_layers)
    if any(not 0 <= i < target.n_layers for i in layers):
        raise ValueError(
            f'config.feature.feature_layers={layers}: every layer must be in [0, '
            f"{target.n_layers}) (the target's n_layers)"
        )
    need = max(feature_row_lengths(config))
    if target.max_len < need:
        raise ValueError(
            f"the target's max_len={target.max_len} is below {need} (config.data.seq_len / "
            'distill.prompt_len + max_new_tokens)'
        )
    ids = read_vocab(f, target.vocab_size)
    draft_cfg = FeatureDraftConfig.for_target(
        target,
        feature_layers=layers,
        n_layers=int(f.n_layers),
        draft_vocab_size=None if ids is None else len(ids),
        freeze_embedding=bool(f.freeze_embedding),
    )
    return draft_cfg, ids


def settings(config, draft_cfg: FeatureDraftConfig) -> ttt.TTTSettings:
    f, d = config.feature, config.distill
    return ttt.TTTSettings(
        feature_layers=draft_cfg.feature_layers,
        ttt_steps=int(f.ttt_steps),
        step_decay=float(f.step_decay),
        divergence=d.divergence,
        beta=float(d.beta),
        freeze_embedding=draft_cfg.freeze_embedding,
    )


def loss_identity(config) -> dict:
    """The loss and data fields a resumed run must match (the draft's own are in its config)."""
    d, f = config.distill, config.feature
    out = {k: d[k] for k in ('divergence', 'beta', 'source', 'prompt_len', 'max_new_tokens')}
    data = 'cached-bf16' if f.cache else 'online'  # where the target's side comes from
    out = dict(out, ttt_steps=f.ttt_steps, step_decay=f.step_decay, feature_data=data)
    if f.init_head:  # absent otherwise: workdirs from before the option resume unchanged
        out['init_head'] = True
    return out


def load_target(config):
    """(the frozen target, its mesh, its rules): config.distill's checkpoint on config.mesh."""
    d, mesh, (rules, _) = config.distill, make_mesh(config.mesh), mesh_rules(config.mesh)
    return load_teacher(d.teacher_workdir, int(d.teacher_step), mesh=mesh, rules=rules), mesh, rules


def _abstract_draft(draft_cfg):
    return nnx.split(nnx.eval_shape(lambda: FeatureDraft(draft_cfg, rngs=nnx.Rngs(0))))


def plan_state(draft_cfg, teacher, tx, seed: int, mesh, rules, head_ids=None):
    """(graphdef, state shardings, abstract state, init): the draft's TrainState, initialised
    from the target (from_target: its embedding copied, with head_ids its final norm and head
    too, the rest from PRNGKey(seed))."""
    graphdef, abstract_params = _abstract_draft(draft_cfg)
    shardings = state_shardings(tx, abstract_params, mesh, rules)

    def init_fn(teacher_params):
        init_key, state_key = jax.random.split(jax.random.PRNGKey(seed))
        target = nnx.merge(teacher.graphdef, teacher_params)
        draft = from_target(target, draft_cfg, rngs=nnx.Rngs(params=init_key), head_ids=head_ids)
        _, params = nnx.split(draft)
        step = jnp.zeros((), jnp.int32)
        return TrainState(step=step, params=params, opt_state=tx.init(params), rng=state_key)

    abstract = abstract_with_shardings(jax.eval_shape(init_fn, teacher.params), shardings)
    init = lambda: jax.jit(init_fn, out_shardings=shardings)(teacher.params)
    return graphdef, shardings, abstract, init


class FeatureStepper:
    """Task.step: the step's batch (the target's continuations or the data rows, with their
    cached features and target_logp when `cached`), then the jitted step. The step index is read
    from the state once and then counted here, so the generation key depends only on
    (seed, step), as in the distill mode."""

    def __init__(self, step_fn, teacher, generator, put, seed: int, cached: bool = False):
        self.step_fn, self.teacher, self.generator, self.put = step_fn, teacher, generator, put
        self.seed, self._step, self.cached = seed, None, cached

    def __call__(self, state, host_batch):
        if self._step is None:
            self._step = int(jax.device_get(state.step))
        if self.generator is None:
            batch = sources.dataset_batch(host_batch)
            if self.cached:
                batch.update({k: host_batch[k] for k in ttt.CACHED_KEYS})
            batch = self.put(batch)
        else:
            key = sources.generation_key(self.seed, self._step)
            out = self.generator(self.teacher.params, host_batch, key)
            batch = {k: out[k] for k in ttt.STEP_KEYS}
        self._step += 1
        return self.step_fn(state, self.teacher.params, batch)


def eval_batches(eval_rows, generator, teacher_params, put, seed: int) -> list[dict]:
    """The fixed evaluation batches: the target's continuations of the eval rows' prompts with
    a key of (seed, batch index) only (source 'teacher', generator given), else the rows."""
    if generator is None:
        return [put(sources.dataset_batch(b)) for b in eval_rows]
    key = jax.random.key(int(seed) ^ _EVAL_TAG)
    out = [
        generator(teacher_params, b, jax.random.fold_in(key, i)) for i, b in enumerate(eval_rows)
    ]
    return [{k: b[k] for k in ttt.STEP_KEYS} for b in out]


def make_evaluate(eval_fn, batches, s: ttt.TTTSettings):
    """(state, target params) -> {'val_loss', 'val_kd_step{j}', 'alpha_step{j}'}: the TTT loss,
    each step's divergence and mean sum min(p, q) on `batches`, token-weighted over batches."""

    def evaluate(state, teacher_params):
        sums = {}
        for b in batches:
            m = jax.device_get(eval_fn(state.params, teacher_params, b))
            for j in range(s.ttt_steps):
                n = float(m[f'tokens_step{j}'])
                for key in (f'kd_step{j}', f'alpha_step{j}'):
                    sums[key] = sums.get(key, 0.0) + float(m[key]) * n
                sums[f'n{j}'] = sums.get(f'n{j}', 0.0) + n
        out = {}
        for j in range(s.ttt_steps):
            n = max(sums[f'n{j}'], 1.0)
            out[f'val_kd_step{j}'] = sums[f'kd_step{j}'] / n
            out[f'alpha_step{j}'] = sums[f'alpha_step{j}'] / n
        out['val_loss'] = sum(w * out[f'val_kd_step{j}'] for j, w in enumerate(s.weights()))
        return out

    return evaluate


def build_feature_draft(
    config, data: DistillData, draft_cfg, ids, *, teacher=None, feature_cache=None
):
    """Loads the target (unless `teacher`, load_target's), plans the draft's state, jits the
    step (cached with `feature_cache`, whose rows data.train's batches carry) -> (Task, parts)."""
    d = config.distill
    mesh, (rules, draft_rules) = make_mesh(config.mesh), mesh_rules(config.mesh)
    teacher = load_target(config)[0] if teacher is None else teacher
    check_compatible(teacher, teacher.config, data.tokenizer)
    target_identity, cached = teacher.identity(), feature_cache is not None
    if cached:
        fc.check_matches(feature_cache, target_identity, draft_cfg.feature_layers, ids)
    tx = make_optimizer(config.train)
    if draft_cfg.freeze_embedding:
        tx = ttt.frozen_embedding(tx)
    vocab_ids = np.arange(draft_cfg.vocab_size) if ids is None else ids  # as target ids
    head_ids = vocab_ids if config.feature.init_head else None
    graphdef, shardings, abstract, init = plan_state(
        draft_cfg, teacher, tx, int(config.seed), mesh, draft_rules, head_ids
    )
    b_sharding = batch_sharding(mesh, rules)
    t_shardings = param_shardings(mesh, teacher.params, rules)
    s = settings(config, draft_cfg)
    step_fn = ttt.jit_feature_step(
        graphdef,
        teacher.graphdef,
        tx,
        learning_rate_schedule(config.train),
        s,
        ids,
        (shardings, t_shardings, b_sharding),
        mesh,
        cached=cached,
    )
    eval_fn = ttt.jit_eval(
        graphdef, teacher.graphdef, s, ids, (shardings.params, t_shardings, b_sharding), mesh
    )
    generator = None
    if d.source == 'teacher':
        generator = sources.Generator(
            teacher.graphdef, d.prompt_len, d.max_new_tokens, sampling_config(config), data.eos_id,
            mesh, rules, b_sharding,
        )  # fmt: skip
    put = batch_placer(b_sharding, ttt.STEP_KEYS)
    batches = eval_batches(data.eval_batches, generator, teacher.params, put, int(config.seed))
    put = batch_placer(b_sharding, ttt.STEP_KEYS + (ttt.CACHED_KEYS if cached else ()))
    evaluate = make_evaluate(eval_fn, batches, s)
    rows = feature_row_lengths(config)[-1]
    vocab = {
        'ids': None if ids is None else ids.tolist(),
        'target_vocab_size': teacher.config.vocab_size,
    }
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
    task = Task(
        mode=MODE,
        init_state=init,
        abstract_state=abstract,
        step=FeatureStepper(step_fn, teacher, generator, put, int(config.seed), cached),
        batches=data.train,
        put_batch=lambda batch: batch,
        evaluate=lambda state: evaluate(state, teacher.params),
        identity={
            CONFIG_KEY: draft_cfg.to_dict(),
            VOCAB_KEY: vocab,
            'tokenizer': data.tokenizer,
            'corpus': data.corpus,
            'teacher': target_identity,
            'feature_loss': loss_identity(config),
        },
        metadata={'config': config, 'num_params': num_params},
        tokens_per_step=config.train.batch_size * rows,
    )
    return task, dict(teacher=teacher, graphdef=graphdef, vocab=vocab, num_params=num_params)


def run_feature_draft(
    config,
    workdir: str,
    *,
    data: DistillData | None = None,
    on_step=None,
    teacher=None,
    feature_cache=None,
):
    """Trains the feature draft of config into `workdir` (resuming from its checkpoints) ->
    results (also <workdir>/results.json unless preempted). Holds the workdir lock. teacher:
    the target already loaded by load_target; feature_cache: the FeatureCache whose rows
    data.train's batches carry (config.feature.cache)."""
    draft_cfg, ids = prepare(config, data_config=data is None)  # before any tokenizer is built
    fc.check_config(config, feature_cache)
    with workdir_lib.opened(workdir, MODE) as workdir:
        data = load_data(config) if data is None else data
        task, parts = build_feature_draft(
            config, data, draft_cfg, ids, teacher=teacher, feature_cache=feature_cache
        )
        result = run_loop(task, workdir, config.train, on_step=on_step)
        results = {
            'mode': MODE,
            'step': result.step,
            'preempted': result.preempted,
            'checkpoint_dir': result.checkpoint_dir,
            'checkpoint_step': result.checkpoint_step,
            'teacher_workdir': parts['teacher'].workdir,
            'teacher_step': parts['teacher'].step,
            'num_params_draft': parts['num_params'],
            'draft_vocab_size': draft_cfg.vocab_size,
            **result.eval,
        }
        if feature_cache is not None:
            results['feature_cache'] = feature_cache.summary()
        if not result.preempted and ids is not None and jax.process_index() == 0:
            with open(os.path.join(workdir, DRAFT_VOCAB_FILE), 'w') as fh:
                json.dump(parts['vocab'], fh)
        return finish_results(workdir, results, config)


def load_feature_draft(workdir: str, step: int | None = None):
    """(FeatureDraft, draft_vocab_ids int32 [N] or None) of a feature_draft workdir's newest
    intact checkpoint (or `step`), params only, on the default device. ConfigMismatch for a
    checkpoint of another mode; CorruptCheckpoint (refused, never skipped) for a corrupt one."""

    def read(s):
        meta = ckpts.metadata(s)
        if CONFIG_KEY not in meta:
            raise ConfigMismatch(
                f'checkpoint step {s} in {ckpts.directory} has no {CONFIG_KEY!r} (mode='
                f'{meta.get("mode")!r}): not a feature draft'
            )
        cfg = FeatureDraftConfig.from_dict(meta[CONFIG_KEY])
        ckpts.verify_step(s)
        graphdef, abstract = _abstract_draft(cfg)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = {
            'params': abstract_with_shardings(abstract, jax.tree.map(lambda _: device, abstract))
        }
        args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
        item = ocp.args.PyTreeRestore(item=target, restore_args=args, partial_restore=True)
        out = ckpts.manager.restore(s, args=ocp.args.Composite(state=item))
        ckpts.check_restored(out['state']['params'], s)
        ids = meta[VOCAB_KEY]['ids']
        return nnx.merge(graphdef, out['state']['params']), (
            None if ids is None else np.asarray(ids, np.int32)
        )

    with Checkpoints(workdir_lib.resolve(workdir), read_only=True) as ckpts:
        if step is not None:
            return read(step)
        return ckpts.newest_readable(read, refuse=(CorruptCheckpoint,))[1]
