"""The quickstart's serving stage: latency, throughput and memory of what would be deployed.

For batch sizes config.batch_sizes and one sampling (greedy by default), times four ways of
serving on the same prompts: the target alone, the distilled draft alone (distillation as
replacement), and the target with each draft speculatively (CE draft, distilled draft) at one k.
Every sampler is compiled ahead of time for max_new_tokens N and for 1; all are timed
round-robin (load drift on a shared machine hits them alike). Per (method, batch):
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
from specjax.evaluation import measure
from specjax.evaluation.pairs import draft_vocab_ids
from specjax.evaluation.prompts import make_prompts
from specjax.models import split
from specjax.parallel import make_mesh
from specjax.sampling import SamplingConfig, make_autoregressive_fn, make_speculative_fn
from specjax.sampling.calibrate import interleaved_times
from specjax.sampling.draft_vocab import DraftVocab

METHODS = ('target', 'draft_distilled', 'spec_ce', 'spec_distilled')
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
    split_models = {name: split(m) for name, m in models.items()}
    # Reduced-vocabulary drafts (draft_vocab.json): ids maps draft index -> target id.
    vocab = {name: draft_vocab_ids(os.path.join(root, name)) for name in models}
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
    common = dict(sampling=sampling, eos_id=None, mesh=mesh, rules=rules)
    sampler = _sampler_factory(split_models, vocab, k, common)
    inputs_for = lambda method, tokens: alone_inputs(vocab.get(method), target_vocab, tokens)
    calls, compiled, outputs = _compile_all(
        sampler, inputs_for, prompts, batch_sizes, n, jax.random.key(config.seed)
    )
    times = {
        key: float(np.median(t)) for key, t in interleaved_times(calls, int(config.repeats)).items()
    }
    result = {
        'k': k,
        'max_new_tokens': n,
        'sampling': sampling.to_dict(),
        'param_bytes': {name: _param_bytes(p) for name, (_, p) in split_models.items()},
        'num_params': {name: m.config.num_params for name, m in models.items()},
        'rows': _rows(batch_sizes, n, k, times, compiled, outputs, vocab),
        'samples': _samples(config, tok, prompts, outputs, vocab, max(batch_sizes)),
        'environment': measure.environment(),
        'process_memory': measure.process_memory(),
    }
    os.makedirs(workdir, exist_ok=True)
    jsonio.write_json(os.path.join(workdir, 'serve.json'), result)
    return result


def _sampler_factory(split_models: dict, vocab: dict, k: int, common: dict):
    """sampler(method, max_new) -> (sampler fn, its params): a model alone or a spec_ pair."""

    def sampler(method, max_new):
        if method.startswith('spec_'):
            draft = 'draft_' + method[len('spec_') :]
            fn = make_speculative_fn(
                split_models['target'][0],
                split_models[draft][0],
                num_draft_tokens=k,
                max_new_tokens=max_new,
                draft_vocab_ids=None if vocab[draft] is None else tuple(vocab[draft]),
                **common,
            )
            return fn, [split_models['target'][1], split_models[draft][1]]
        fn = make_autoregressive_fn(split_models[method][0], max_new_tokens=max_new, **common)
        return fn, [split_models[method][1]]

    return sampler


def _compile_all(sampler, inputs_for, prompts, batch_sizes, n: int, rng):
    """Every (method, batch, max_new) compiled ahead of time and decoded once.

    Returns (calls, compiled, outputs): calls[(method, batch, max_new)] runs it again (only the
    METHODS: draft_ce alone is decoded for its samples, not timed); outputs[(method, batch)]
    holds the N-token decode on host.
    """
    calls, compiled, outputs = {}, {}, {}
    for b in batch_sizes:
        idx = np.arange(b) % len(prompts)
        tokens, lengths = prompts.tokens[idx], prompts.lengths[idx]
        for method in METHODS + (('draft_ce',) if b == max(batch_sizes) else ()):
            for max_new in (n, 1) if method in METHODS else (n,):
                fn, params = sampler(method, max_new)
                toks = inputs_for(method, tokens)
                c = measure.compile_sampler(fn, params, toks, lengths, rng)
                key = (method, b, max_new)
                compiled[key] = c
                calls[key] = lambda c=c, params=params, t=toks, ln=lengths: c(*params, t, ln, rng)
                if max_new == n:
                    outputs[method, b] = jax.device_get(jax.block_until_ready(calls[key]()))
                if method not in METHODS:
                    del calls[key]  # samples only: not timed
    return calls, compiled, outputs


def _rows(batch_sizes, n: int, k: int, times: dict, compiled: dict, outputs: dict, vocab) -> list:
    """One row per (batch, method): TTFT, TPOT, tokens/s, memory, agreement with the target."""
    rows = []
    for b in batch_sizes:
        for method in METHODS:
            t_n, t_1 = times[method, b, n], times[method, b, 1]
            out = outputs[method, b]
            target_ids = np.asarray(outputs['target', b].tokens)
            same = alone_tokens(vocab.get(method), out.tokens) == target_ids
            rows.append(
                dict(
                    method=method,
                    batch_size=b,
                    k=k if method.startswith('spec_') else None,
                    ttft_s=t_1,
                    tpot_s=(t_n - t_1) / max(n - 1, 1),
                    time_per_token_s=t_n / n,
                    tokens_per_s=b * n / t_n,
                    wall_s=t_n,
                    compile_s=compiled[method, b, n].compile_s,
                    memory=compiled[method, b, n].memory(),
                    same_tokens_as_target=float(same.mean()),
                )
            )
    return rows


def _samples(config, tok, prompts, outputs: dict, vocab, b: int) -> list:
    """The first config.samples prompts and each SAMPLED method's continuation at batch b
    (the largest), decoded."""
    shown = min(int(config.samples), len(prompts), b)  # rows of the largest batch
    samples = []
    for i in range(shown):
        entry = {
            'domain': str(prompts.domains[i % len(prompts)]),
            'prompt': tok.decode(prompts.tokens[i, : prompts.lengths[i]].tolist()),
        }
        for method in SAMPLED:
            out = outputs[method, b]
            row = alone_tokens(vocab.get(method), out.tokens)[i, : out.lengths[i]]
            entry[method] = tok.decode(row.tolist())
        samples.append(entry)
    return samples
