"""The quickstart's serving stage: latency, throughput and memory of what would be deployed.

For batch sizes config.batch_sizes and one sampling (greedy by default), times four ways of
serving on the same prompts: the target alone, the distilled draft alone (distillation as
replacement), and the target with each draft speculatively (CE draft, distilled draft) at one k,
and a fifth where <root>/draft_feature holds a finished feature draft (EAGLE-3 shape): the target
with it speculatively ('spec_feature'); with config.ngram_k > 0 the target with the training-free
n-gram draft at k = ngram_k ('spec_ngram', pairs.stage_ngram_draft(config)).
Every batch size serves the same config.prompts prompts (round-robin over domains) in calls of
b rows (at batch 1: one call per prompt). Every sampler is compiled once, ahead of time, for
max_new_tokens N; the 1-token call runs the same program with a run-time limit of 1
(`with_max_new`: the token limit and eos are jit arguments), as a server allocating for the
whole request would. All are timed round-robin (load drift on a shared machine hits them alike),
and times are per call. Per (method, batch):
  ttft_s   time to first token = median time of the 1-token call (prefill + one token)
  tpot_s   time per output token after the first = (t_N - t_1) / (N - 1), medians
  tokens_per_s = batch * N / t_N; memory = XLA's estimate for the N-token executable
           (parameters of both models + KV caches + temporaries) and the parameters' bytes.
Also the continuations of the first config.samples prompts, decoded, for the report.

Entry point: `run(config, workdir, root)`; writes <workdir>/serve.json.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from specjax import jsonio
from specjax.checkpoint import load_model
from specjax.data import build_tokenizer
from specjax.evaluation import intervals, measure
from specjax.evaluation.pairs import draft_vocab_ids, num_params, stage_ngram_draft
from specjax.evaluation.prompts import make_prompts
from specjax.evaluation.spec_eval_sampling import dynamic_sampling
from specjax.models import split
from specjax.parallel import make_mesh
from specjax.sampling import (
    SamplingConfig,
    make_autoregressive_fn,
    make_speculative_fn,
)
from specjax.sampling.calibrate import interleaved_times
from specjax.sampling.draft_vocab import DraftVocab

METHODS = ('target', 'draft_distilled', 'spec_ce', 'spec_distilled')
FEATURE = 'draft_feature'  # a feature-draft workdir beside the others (SmolLM2 preset) ...
FEATURE_METHOD = 'spec_feature'  # ... is also served with the target, timed like METHODS
NGRAM_METHOD = 'spec_ngram'  # the target with the n-gram draft (config.ngram_k > 0)
SAMPLED = ('target', 'draft_distilled', 'draft_ce', 'spec_distilled')  # shown side by side


def chosen_k(config, root: str) -> int:
    """config.k, or the distilled pair's best measured k at T=0 in spec_distilled/spec_eval.json."""
    if int(config.k) > 0:
        return int(config.k)
    with open(os.path.join(root, 'spec_distilled', 'spec_eval.json')) as f:
        optimal = json.load(f)['optimal_k']
    label = 'T=0' if 'T=0' in optimal else next(iter(optimal))
    return int(optimal[label]['best_measured_k'])


def _alone_vocab(ids, target_vocab: int) -> DraftVocab:
    """A model served alone: ids None = it reads and writes target ids; else a reduced draft."""
    if ids is None:
        return DraftVocab(target_vocab)
    return DraftVocab(target_vocab, tuple(int(i) for i in ids), remap_inputs=True)


def alone_inputs(ids, target_vocab: int, tokens) -> np.ndarray:
    """Prompt target ids [B, P] -> the served model's input ids (a reduced draft's indices; off
    the set: index 0, as in speculative decoding and in its training)."""
    return np.asarray(_alone_vocab(ids, target_vocab).to_draft(np.asarray(tokens, np.int32)))


def alone_tokens(ids, tokens) -> np.ndarray:
    """The served model's output [B, N] -> target ids (a reduced draft's index i is ids[i])."""
    if ids is None:
        return np.asarray(tokens)
    return np.asarray(ids)[np.asarray(tokens)]


def _param_bytes(params) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)))


def run(config, workdir: str, root: str) -> dict:
    mesh = make_mesh(config.mesh)
    rules = config.mesh.rules
    tok = build_tokenizer(config.data)
    models = {
        name: load_model(os.path.join(root, name), mesh=mesh, rules=rules)[0]
        for name in ('target', 'draft_ce', 'draft_distilled')
    }
    methods = METHODS
    if os.path.exists(os.path.join(root, FEATURE, 'results.json')):
        from specjax.distill.feature_mode import load_feature_draft

        # params on the default device; the sampler places them on the mesh (as spec_eval)
        models[FEATURE] = load_feature_draft(os.path.join(root, FEATURE))[0]
        methods += (FEATURE_METHOD,)
    split_models = {name: split(m) for name, m in models.items()}
    # Reduced-vocabulary drafts (draft_vocab.json): ids maps draft index -> target id.
    vocab = {name: draft_vocab_ids(os.path.join(root, name)) for name in models}
    ks = {}  # proposals per round of a spec_ method other than the pairs' k
    if int(config.get('ngram_k', 0)) > 0:
        ngram = stage_ngram_draft(config)
        split_models['draft_ngram'], vocab['draft_ngram'] = (ngram, ()), None
        methods += (NGRAM_METHOD,)
        ks[NGRAM_METHOD] = int(config.ngram_k)
    target_vocab = models['target'].config.vocab_size

    ev = config.eval
    batch_sizes = tuple(int(b) for b in config.batch_sizes)
    prompts = make_prompts(
        config.data,
        tok,
        per_domain=max(int(ev.prompts_per_domain), max(batch_sizes)),
        min_len=int(ev.prompt_len_min),
        max_len=int(ev.prompt_len_max),
        seed=config.seed,
    )
    k = chosen_k(config, root)
    n = int(config.max_new_tokens)
    sampling = SamplingConfig(temperature=float(config.temperature))
    # the programs spec_eval compiled for this sampling (same batch, prompt width, tokens and
    # k: shared, the eos and token limit being run-time values)
    dynamic = dynamic_sampling(sampling, ev)
    common = dict(sampling=sampling, eos_id=None, mesh=mesh, rules=rules, dynamic_sampling=dynamic)
    sampler = _sampler_factory(split_models, vocab, k, common, ks)
    inputs_for = lambda method, tokens: alone_inputs(vocab.get(method), target_vocab, tokens)
    calls, compiled, outputs, per_pass, rows = _compile_all(
        methods,
        sampler,
        inputs_for,
        prompts,
        batch_sizes,
        n,
        jax.random.key(config.seed),
        int(config.get('prompts', 8)),
    )
    repeats = interleaved_times(calls, int(config.repeats))
    times = {key: float(np.median(t)) / per_pass[key[1]] for key, t in repeats.items()}
    timing = {key: intervals.timing_summary(t) for key, t in repeats.items()}
    result = {
        'k': k,
        'max_new_tokens': n,
        'repeats': int(config.repeats),
        'sampling': sampling.to_dict(),
        'param_bytes': {name: _param_bytes(split_models[name][1]) for name in models},
        'num_params': {name: num_params(m) for name, m in models.items()},
        'prompts': {
            'count': len(rows),
            'per_domain': {
                str(d): int((prompts.domains[rows] == d).sum()) for d in set(prompts.domains[rows])
            },
            'calls_per_pass': {str(b): per_pass[b] for b in batch_sizes},
        },
        'rows': _rows(methods, batch_sizes, n, k, times, timing, compiled, outputs, vocab, ks),
        'samples': _samples(config, tok, prompts, rows, outputs, vocab, max(batch_sizes)),
        'environment': measure.environment(),
        'process_memory': measure.process_memory(),
    }
    os.makedirs(workdir, exist_ok=True)
    jsonio.write_json(os.path.join(workdir, 'serve.json'), result)
    return result


def _sampler_factory(split_models: dict, vocab: dict, k: int, common: dict, ks: dict):
    """sampler(method, max_new) -> (sampler fn, its params): a model alone or a spec_ pair (at
    k, or at ks[method])."""

    def sampler(method, max_new):
        if method.startswith('spec_'):
            draft = 'draft_' + method[len('spec_') :]
            fn = make_speculative_fn(
                split_models['target'][0],
                split_models[draft][0],
                num_draft_tokens=ks.get(method, k),
                max_new_tokens=max_new,
                draft_vocab_ids=None if vocab[draft] is None else tuple(vocab[draft]),
                **common,
            )
            return fn, [split_models['target'][1], split_models[draft][1]]
        fn = make_autoregressive_fn(split_models[method][0], max_new_tokens=max_new, **common)
        return fn, [split_models[method][1]]

    return sampler


def serve_rows(domains, count: int) -> np.ndarray:
    """The first `count` prompt rows taken round-robin over domains (prompts come sorted by
    domain), so every batch size serves a mix of domains."""
    by_domain = [np.flatnonzero(domains == d) for d in dict.fromkeys(domains)]
    order = [int(r[i]) for i in range(max(map(len, by_domain))) for r in by_domain if i < len(r)]
    return np.asarray(order[:count], np.int64)


def _chunks(rows: np.ndarray, b: int) -> list[np.ndarray]:
    """rows in consecutive batches of b, the last padded by repeating its first row."""
    out = []
    for a in range(0, len(rows), b):
        part = rows[a : a + b]
        out.append(np.concatenate([part, np.full(b - len(part), part[0])]))
    return out


def _compile_all(methods, sampler, inputs_for, prompts, batch_sizes, n: int, rng, count: int):
    """Every (method, batch) of `methods` compiled ahead of time for n tokens (side by side:
    measure.compile_samplers) and decoded once;
    its 1-token call (key (method, batch, 1)) runs that program with a run-time limit of 1.

    Each batch size serves the same `count` prompts (serve_rows) in batches of b: at batch 1,
    `count` calls of one row. Returns (calls, compiled, outputs, calls_per_pass):
    calls[(method, batch, max_new)] decodes all of them again (only `methods`: draft_ce alone
    is decoded for its samples, not timed); outputs[(method, batch)] holds the N-token decode on
    host, (tokens [count, N], lengths [count]) in serve_rows order.
    """
    calls, compiled, outputs, per_pass, jobs = {}, {}, {}, {}, {}
    rows = serve_rows(prompts.domains, max(count, max(batch_sizes)))
    for b in batch_sizes:
        chunks = _chunks(rows, b)
        per_pass[b] = len(chunks)
        inputs = [(prompts.tokens[idx], prompts.lengths[idx]) for idx in chunks]
        for method in methods + (('draft_ce',) if b == max(batch_sizes) else ()):
            fn, params = sampler(method, n)
            jobs[method, b] = (fn, params, [(inputs_for(method, t), ln) for t, ln in inputs])
    group = [(fn, params, *toks[0], rng) for fn, params, toks in jobs.values()]
    for (method, b), c in zip(jobs, measure.compile_samplers(group)):
        fn, params, toks = jobs[method, b]
        compiled[method, b, n] = c
        first = measure.CompiledSampler(c.compiled, fn.with_max_new(1), c.compile_s)
        for max_new, run in ((n, c), (1, first)):
            calls[method, b, max_new] = lambda run=run, params=params, toks=toks: [
                run(*params, t, ln, rng) for t, ln in toks
            ]
        outs = jax.device_get(jax.block_until_ready(calls[method, b, n]()))
        outputs[method, b] = (
            np.concatenate([np.asarray(o.tokens) for o in outs])[: len(rows)],
            np.concatenate([np.asarray(o.lengths) for o in outs])[: len(rows)],
        )
        if method not in methods:  # samples only: not timed
            del calls[method, b, n], calls[method, b, 1]
    return calls, compiled, outputs, per_pass, rows


def _rows(
    methods, batch_sizes, n: int, k: int, times, timing, compiled, outputs, vocab, ks
) -> list:
    """One row per (batch, method of `methods`): TTFT, TPOT, tokens/s, memory, agreement with
    the target (times: seconds per call, the median over repeats; timing: the N-token pass's
    repeats)."""
    rows = []
    for b in batch_sizes:
        for method in methods:
            t_n, t_1 = times[method, b, n], times[method, b, 1]
            tokens, _ = outputs[method, b]
            same = alone_tokens(vocab.get(method), tokens) == outputs['target', b][0]
            rows.append(
                dict(
                    method=method,
                    batch_size=b,
                    k=ks.get(method, k) if method.startswith('spec_') else None,
                    ttft_s=t_1,
                    tpot_s=(t_n - t_1) / max(n - 1, 1),
                    time_per_token_s=t_n / n,
                    tokens_per_s=b * n / t_n,
                    wall_s=t_n,
                    compile_s=compiled[method, b, n].compile_s,
                    memory=compiled[method, b, n].memory(),
                    same_tokens_as_target=float(same.mean()),
                    timing=timing[method, b, n],
                )
            )
    return rows


def _samples(config, tok, prompts, rows, outputs: dict, vocab, b: int) -> list:
    """The first config.samples served prompts and each SAMPLED method's continuation at batch
    b (the largest), decoded."""
    samples = []
    for i in range(min(int(config.samples), len(rows))):
        row = rows[i]
        entry = {
            'domain': str(prompts.domains[row]),
            'prompt': tok.decode(prompts.tokens[row, : prompts.lengths[row]].tolist()),
        }
        for method in SAMPLED:
            tokens, lengths = outputs[method, b]
            ids = alone_tokens(vocab.get(method), tokens)[i, : lengths[i]]
            entry[method] = tok.decode(ids.tolist())
        samples.append(entry)
    return samples
