"""Training a reduced-vocabulary draft from a cached teacher (specjax.distill.reduced_vocab).

The cache (written once by the quickstart's teacher_cache stage, `save_cache` / `load_cache`):
<dir>/vocab.json    {'ids': [N] target ids, most frequent first, 'counts', 'coverage', ...}
<dir>/teacher.npz   train_tokens/train_segment_ids/train_positions int32 [M, T]: the rows the
                    teacher scored, with train_topk_idx int16|int32 [M, T, K] draft indices and
                    train_topk_logp float16 [M, T, K] (teacher log-probs, full-V softmax) per
                    position. They are the teacher's own continuations of corpus prompts
                    (`teacher_continuations`: DistillSpec's teacher-generated data) or, with
                    source 'dataset', the packed corpus rows themselves;
                    corpus_tokens/corpus_segment_ids/corpus_positions [M, T]: packed corpus
                    rows (no teacher output: what a cross-entropy draft trains on);
                    eval_* held-out corpus rows with eval_logp float16 [E, T, N] (all N ids)
                    and eval_argmax int32 [E, T] (the teacher's argmax over all of V) for alpha.
Generating costs one sequential target step per token, scoring one parallel forward per row.

`train_draft(cfg, cache, tok, workdir)` trains cfg.draft (vocab_size N) for cfg.train.steps with
loss = kd_weight * KD (divergence cfg.loss.divergence, default fkl) + ce_weight * CE over cycled
rows (cfg.rows: 'teacher', the scored rows, or 'corpus'; the same row order for every draft)
through the training loop every mode shares (specjax.distill.reduced_task: checkpoints in
<workdir>/checkpoints, automatic bit-identical resume, the workdir lock, SIGTERM -> checkpoint ->
preempted), logs held-out alpha every cfg.train.eval_every steps to <workdir>/metrics.jsonl, and
leaves a workdir load_model reads (its last checkpoint's params), with draft_vocab.json beside it.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import workdir as workdir_lib
from specjax.distill import reduced_vocab as rv
from specjax.distill.divergences import DIVERGENCES
from specjax.distill.reduced_task import MODE, build_task, loop_config
from specjax.models import Transformer, TransformerConfig, apply, split
from specjax.train.loop import run_loop
from specjax.train.losses import next_token_targets

VOCAB_FILE = 'vocab.json'
CACHE_FILE = 'teacher.npz'
DRAFT_VOCAB_FILE = 'draft_vocab.json'  # in a draft workdir: {'ids': [N]} (spec_eval reads it)


def save_cache(directory: str, vocab: dict, arrays: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, 'teacher.tmp.npz')
    np.savez(tmp, **arrays)
    os.replace(tmp, os.path.join(directory, CACHE_FILE))
    with open(os.path.join(directory, VOCAB_FILE), 'w') as f:
        json.dump(vocab, f)


def load_cache(directory: str) -> tuple[dict, dict]:
    with open(os.path.join(directory, VOCAB_FILE)) as f:
        vocab = json.load(f)
    with np.load(os.path.join(directory, CACHE_FILE)) as z:
        arrays = {k: z[k] for k in z.files}
    return vocab, arrays


ROWS = {'teacher': 'train', 'corpus': 'corpus'}  # cfg.rows -> the cache's array prefix


def check_draft_config(cfg, field: str = 'config') -> None:
    """ValueError naming the field (`field` is the draft config's own name) for what train_draft
    refuses whatever the cache holds: an unknown cfg.rows, KD on the corpus rows, an unknown
    cfg.loss.divergence, a config.train field the draft does not read (reduced_task.loop_config).
    Callers run it before any stage, train_draft again."""
    loop_config(cfg.train, field)
    rows = cfg.get('rows', 'teacher')
    if rows not in ROWS:
        raise ValueError(f'{field}.rows must be one of {sorted(ROWS)}, got {rows!r}')
    if rows == 'corpus' and float(cfg.loss.kd_weight):
        raise ValueError(
            f"{field}.loss.kd_weight={cfg.loss.kd_weight} needs the teacher's outputs, which "
            f"{field}.rows='corpus' has none of: use rows='teacher' or kd_weight=0"
        )
    divergence = cfg.loss.get('divergence', 'fkl')
    if divergence not in DIVERGENCES:
        raise ValueError(
            f'{field}.loss.divergence={divergence!r} must be one of {sorted(DIVERGENCES)} '
            '(specjax.distill.divergences; jsd with beta 0.5)'
        )


def _train_prefix(rows: str, arrays: dict, cache_dir: str) -> str:
    """The cache prefix of rows (checked by check_draft_config); ValueError when this cache
    lacks them."""
    prefix = ROWS[rows]
    if f'{prefix}_tokens' not in arrays:
        raise ValueError(
            f'config.rows={rows!r}: the teacher cache {cache_dir}/{CACHE_FILE} has no '
            f'{prefix}_* rows (written by an older specjax: rerun its teacher_cache stage)'
        )
    return prefix


def restricted_early_exit(target, ids_N, draft_cfg: TransformerConfig):
    """Draft parameters from `target`: its embedding rows ids_N (tied head over the N ids), its
    first draft_cfg.n_layers blocks and its final norm. ValueError naming the field whose shape
    differs (the draft's d_model, heads and d_ff must be the target's)."""
    from specjax.models.early_exit import early_exit_draft
    from specjax.models.layout import to_layout

    t = target.config
    for field in ('d_model', 'n_heads', 'n_kv_heads', 'd_ff', 'head_dim', 'rope_theta', 'norm_eps'):
        a, b = getattr(draft_cfg, field), getattr(t, field)
        if a != b and not (isinstance(a, float) and np.isclose(a, b, rtol=1e-6)):
            raise ValueError(
                f"config.draft.{field}={a!r} must equal the target's {b!r} to initialise the "
                'draft from it (config.init=target)'
            )
    if not draft_cfg.tie_embeddings:
        raise ValueError('config.init=target needs config.draft.tie_embeddings=True')
    exit_ = to_layout(early_exit_draft(target, draft_cfg.n_layers), draft_cfg.scan_layers)
    draft = Transformer(draft_cfg, rngs=nnx.Rngs(0))
    draft.embed[...] = exit_.embed[...][np.asarray(ids_N)]
    nnx.update(draft.blocks, nnx.state(exit_.blocks))
    nnx.update(draft.final_norm, nnx.state(exit_.final_norm))
    return split(draft)


def _prepare(cfg, cache_dir: str, target) -> dict:
    """Everything train_draft checks and reads before it takes the workdir: ValueError naming
    the field for a bad setting or a cache that does not fit."""
    check_draft_config(cfg)
    init = cfg.get('init', 'random')
    if init not in ('random', 'target'):
        raise ValueError(f"config.init must be 'random' or 'target', got {init!r}")
    vocab, arrays = load_cache(cache_dir)
    ids = np.asarray(vocab['ids'], np.int32)
    if int(cfg.draft.vocab_size) != len(ids):
        raise ValueError(
            f'config.draft.vocab_size={cfg.draft.vocab_size} must equal the cached reduced '
            f'vocabulary size {len(ids)} ({cache_dir}/{VOCAB_FILE})'
        )
    rows = cfg.get('rows', 'teacher')
    prefix = _train_prefix(rows, arrays, cache_dir)
    draft_cfg = TransformerConfig.from_dict(cfg.draft)
    if init == 'target':
        if target is None:
            raise ValueError('config.init=target needs the target model (train_draft target=)')
        _, params = restricted_early_exit(target, ids, draft_cfg)  # checks the shapes now
        init_identity = {'init': init, 'target_config': target.config.to_dict()}
    else:
        params, init_identity = None, {'init': init}

    def make_params():  # (only for a workdir without checkpoints)
        if params is not None:
            return params
        return split(Transformer(draft_cfg, rngs=nnx.Rngs(int(cfg.seed))))[1]

    reduced = {'ids': ids.tolist(), 'target_vocab_size': int(vocab['target_vocab_size'])}
    return dict(
        vocab=vocab,
        arrays=arrays,
        ids=ids,
        table=rv.index_table(ids, vocab['target_vocab_size']),
        rows=rows,
        prefix=prefix,
        draft_cfg=draft_cfg,
        init=init,
        make_params=make_params,
        identity={
            'reduced_vocab': dict(reduced, rows=rows),
            'draft_init': init_identity,
        },
    )


def train_draft(cfg, cache_dir: str, tokenizer, workdir: str, target=None, *, on_step=None):
    """Trains the draft through specjax.train.loop (resuming from <workdir>/checkpoints, holding
    the workdir lock) and saves it; returns results (the caller writes <workdir>/results.json).

    cfg.init (default 'random'): 'target' starts the draft from `target`'s embedding rows of the
    N ids, first layers and final norm (`restricted_early_exit`), both drafts alike. Stopped by
    SIGTERM: the checkpoint is committed and the results are {'mode', 'step', 'preempted': True,
    'checkpoint_dir', 'checkpoint_step'} (rerun to resume). on_step(step, state): run_loop's."""
    p = _prepare(cfg, cache_dir, target)
    train_cfg = loop_config(cfg.train)
    identity = dict(p['identity'], tokenizer=tokenizer.identity())
    source = {'reduced_vocab_of': cache_dir, 'n': len(p['ids']), 'loss': dict(cfg.loss)}
    with workdir_lib.opened(workdir, MODE) as workdir:
        task = build_task(
            cfg,
            arrays=p['arrays'],
            prefix=p['prefix'],
            table=p['table'],
            ids=p['ids'],
            draft_cfg=p['draft_cfg'],
            make_params=p['make_params'],
            identity=identity,
            metadata={'source': source},
        )
        started = time.perf_counter()
        result = run_loop(task, workdir, train_cfg, on_step=on_step)
        seconds = time.perf_counter() - started
        if result.preempted:
            return dict(mode=MODE, step=result.step, preempted=True,
                        checkpoint_dir=result.checkpoint_dir,
                        checkpoint_step=result.checkpoint_step)  # fmt: skip
        tokenizer.save(workdir)
        with open(os.path.join(workdir, DRAFT_VOCAB_FILE), 'w') as f:
            json.dump(
                {'ids': p['ids'].tolist(), 'target_vocab_size': p['vocab']['target_vocab_size']}, f
            )
    draft_cfg = p['draft_cfg']
    return dict(
        result.eval,
        mode=MODE,
        step=result.step,
        train_seconds=seconds,
        tokens_seen=result.step * task.tokens_per_step,
        rows=p['rows'],
        num_params_draft=draft_cfg.num_params,
        init=p['init'],
        draft_layers=draft_cfg.n_layers,
        reduced_vocab_size=len(p['ids']),
        loss=dict(cfg.loss),
    )


def teacher_continuations(
    graphdef,
    params,
    batches,
    *,
    prompt_len: int,
    max_new_tokens: int,
    temperatures,
    eos_id: int | None,
    seed: int,
) -> list[dict]:
    """The teacher continues each packed row's prompt (the start of its first document, at most
    prompt_len tokens; specjax.distill.sources) for max_new_tokens, stopping at eos -> rows
    {tokens, positions, segment_ids} int32 [B, prompt_len + max_new_tokens]: prompt and
    continuation one segment (1), padding after eos segment 0. Batch i samples at temperature
    temperatures[i % len(temperatures)] (0 = greedy) with fold_in(key(seed), i), so the cache is a
    pure function of (params, rows, settings, seed)."""
    from specjax.distill import sources
    from specjax.sampling import SamplingConfig, make_autoregressive_fn

    samplers = [
        make_autoregressive_fn(
            graphdef,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature=float(t)),
            eos_id=eos_id,
        )
        for t in temperatures
    ]
    key = jax.random.key(int(seed))
    out = []
    for i, b in enumerate(batches):
        prompts, lengths, _ = sources.prompts_from_batch(b, prompt_len)
        gen = samplers[i % len(samplers)](params, prompts, lengths, jax.random.fold_in(key, i))
        rows = jax.device_get(sources.assemble(prompts, lengths, gen.tokens, gen.lengths))
        out.append({x: np.asarray(rows[x], np.int32) for x in BATCH3})
    return out


@functools.lru_cache(maxsize=8)
def _teacher_program(graphdef, ids: tuple[int, ...], k: int):
    """One jitted teacher pass for both halves of the cache (train rows keep its top K, eval rows
    its on-set log-probs, argmax and in-set loss), so train and eval rows of one shape share a
    single compiled target program: (params, tokens, positions, segment_ids) ->
    ((idx_BTK, logp_BTK), (logp_BTN, argmax_BT, nll sum, in-set count, nll sum and count over
    every target))."""
    ids_N = jnp.asarray(ids, jnp.int32)

    @jax.jit
    def run(p, tokens, positions, seg):
        logits = apply(graphdef, p, tokens, positions, seg)
        idx, logp_K = rv.teacher_topk(logits, ids_N, k)
        logp_N, argmax = rv.teacher_on_set(logits, ids_N)
        targets, mask = next_token_targets(tokens, seg)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), targets[..., None], -1)
        in_set = mask & jnp.isin(targets, ids_N)
        on_set = (logp_N, argmax, jnp.sum(nll[..., 0] * in_set), jnp.sum(in_set),
                  jnp.sum(nll[..., 0] * mask), jnp.sum(mask))  # fmt: skip
        return (idx, logp_K), on_set

    return run


def teacher_arrays(graphdef, params, batches, ids_N, k: int, prefix: str) -> dict:
    """Runs the teacher once over `batches` (packed rows) -> the cache arrays for `prefix`."""
    program = _teacher_program(graphdef, tuple(int(i) for i in np.asarray(ids_N)), int(k))
    out = {f'{prefix}_{k_}': [] for k_ in ('tokens', 'segment_ids', 'positions')}
    nll = count = nll_all = count_all = 0.0
    for b in batches:
        tokens, positions, seg = (np.asarray(b[x], np.int32) for x in BATCH3)
        for name, x in zip(('tokens', 'positions', 'segment_ids'), (tokens, positions, seg)):
            out[f'{prefix}_{name}'].append(x)
        if prefix == 'train':
            idx, logp = jax.device_get(program(params, tokens, positions, seg)[0])
            idx_dtype = np.int16 if len(ids_N) <= np.iinfo(np.int16).max else np.int32
            out.setdefault('train_topk_idx', []).append(idx.astype(idx_dtype))
            out.setdefault('train_topk_logp', []).append(logp.astype(np.float16))
        else:
            logp_N, argmax, s, n, s_all, n_all = jax.device_get(
                program(params, tokens, positions, seg)[1]
            )
            out.setdefault('eval_logp', []).append(logp_N.astype(np.float16))
            out.setdefault('eval_argmax', []).append(argmax.astype(np.int32))
            nll, count = nll + float(s), count + float(n)
            nll_all, count_all = nll_all + float(s_all), count_all + float(n_all)
    arrays = {key: np.concatenate(v) for key, v in out.items()}
    if prefix == 'eval':  # the target's loss on the positions draft_val_loss covers (in-set)
        arrays['eval_target_loss'] = np.asarray(nll / max(count, 1.0), np.float32)
        # ... and on every next-token target of the eval rows (against the count baselines)
        arrays['eval_target_loss_all'] = np.asarray(nll_all / max(count_all, 1.0), np.float32)
    return arrays


BATCH3 = ('tokens', 'positions', 'segment_ids')
