r"""specjax against transformers on the same real model: SmolLM2-135M from the bundled GGUF.

Both systems load the same file; the draft is the target's first `--draft_layers` layers (its
embedding and final norm), built from the same weights on both sides. At batch 1 over the same
prompts (stdlib prose and code, chat prompts with SmolLM2's template), in one process on one
CPU, it times: transformers `generate` greedy and T=1 (top_k=0, top_p=1), transformers assisted
generation with a constant k (set on the ASSISTANT's generation_config, where transformers 5
reads it; draft calls per round are counted to check), specjax autoregressive and speculative
greedy and T=1; then specjax speculative at batch 8 (transformers' assisted generation is
batch-1 only). eos is ignored on both sides so every run makes --max_new_tokens tokens.
Reports tokens/s, tau = generated tokens per target call (prefill included, on both sides),
the greedy agreement of specjax with transformers, and the speed ratios; prints one table and
writes JSON (--out). The CPU may be shared with other jobs: read ratios, not absolute rates.

  python -m benchmarks.peer_hf --quick      # ~5 minutes: 3 prompts, 24 new tokens
  python -m benchmarks.peer_hf              # 8 prompts, 64 new tokens
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cli, roofline
from specjax import jsonio
from specjax.models import split


def parser():
    p = cli.parser(__doc__, out='/tmp/specjax/peer_hf.json')
    cli.add_bool(p, 'quick', False, '3 prompts and 24 new tokens (~5 minutes)')
    p.add_argument('--k', default=4, type=int, help='draft tokens per round (both systems)')
    p.add_argument('--draft_layers', default=4, type=int, help='layers of the early-exit draft')
    p.add_argument(
        '--max_new_tokens', default=None, type=int, help='tokens per prompt (default 64; quick 24)'
    )
    p.add_argument('--batch', default=8, type=int, help='batch size of the batched specjax run')
    return p


def real_prompts(quick: bool) -> list[tuple[str, str | list]]:
    """(domain, text or chat messages): stdlib prose and code, and chat prompts."""
    import argparse
    import collections
    import json as json_mod

    prose = [textwrap.dedent(m.__doc__).strip()[:400] for m in (json_mod, argparse, collections)]
    code = [inspect.getsource(f)[:400] for f in (textwrap.dedent, json_mod.dumps, copy.deepcopy)]
    chat = [
        [{'role': 'user', 'content': 'Explain what a hash table is in two sentences.'}],
        [{'role': 'user', 'content': 'Write a Python function that reverses a string.'}],
    ]
    items = [('prose', p) for p in prose] + [('code', c) for c in code]
    items += [('chat', c) for c in chat]
    return [items[0], items[3], items[6]] if quick else items


def encode_prompts(tok, items) -> list[list[int]]:
    out = []
    for _, item in items:
        text = tok.apply_chat_template(item) if isinstance(item, list) else item
        out.append([tok.bos_id, *tok.encode(text)])
    return out


class CallCounter:
    """Counts forward calls of a torch module (to check draft calls per assisted round)."""

    def __init__(self, module):
        self.calls = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def transformers_models(path: str, n_layers: int, k: int):
    import torch
    import transformers

    folder, name = os.path.dirname(path), os.path.basename(path)
    target = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:n_layers]
    draft.config.num_hidden_layers = n_layers
    for m in (target, draft):
        m.generation_config.eos_token_id = None  # fixed-length runs on both sides
        m.generation_config.pad_token_id = 2
    g = draft.generation_config  # transformers 5 reads these from the assistant's config
    g.num_assistant_tokens = k
    g.num_assistant_tokens_schedule = 'constant'
    g.assistant_confidence_threshold = 0.0
    return target, draft


def run_transformers(target, draft, prompts, new: int, k: int) -> dict:
    import torch

    t_count, d_count = CallCounter(target), CallCounter(draft)
    settings = {
        'greedy': dict(do_sample=False),
        't1': dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0),
    }
    results = {}
    for label, kwargs in settings.items():
        for method in ('autoregressive', 'assisted'):
            extra = {'assistant_model': draft} if method == 'assisted' else {}
            torch.manual_seed(0)
            tokens, calls_t, calls_d, seconds = [], 0, 0, 0.0
            for ids in prompts:
                t_count.calls = d_count.calls = 0
                start = time.perf_counter()
                with torch.no_grad():
                    out = target.generate(
                        torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, **kwargs,
                        **extra,
                    )  # fmt: skip
                seconds += time.perf_counter() - start
                tokens.append(out[0, len(ids) :].numpy())
                calls_t += t_count.calls
                calls_d += d_count.calls
            n = sum(len(t) for t in tokens)
            print(f'transformers {method} {label}: {n / seconds:.1f} tokens/s', flush=True)
            results[(method, label)] = dict(
                tokens=tokens,
                seconds=seconds,
                tokens_per_s=n / seconds,
                target_calls=calls_t,
                tau=n / calls_t,
                draft_calls_per_round=calls_d / calls_t if method == 'assisted' else None,
            )
    return results


def run_specjax(target, draft, prompts, new: int, k: int, batch: int) -> dict:
    from specjax.evaluation.measure import compile_sampler
    from specjax.models import split
    from specjax.sampling import SamplingConfig, make_autoregressive_fn, make_speculative_fn

    t_gd, t_params = split(target)
    d_gd, d_params = split(draft)
    width = max(map(len, prompts))
    settings = {'greedy': SamplingConfig(temperature=0.0), 't1': SamplingConfig(1.0, 0, 1.0)}
    results = {}
    points = [(m, s, 1) for s in settings for m in ('autoregressive', 'speculative')]
    points += [('speculative', s, batch) for s in settings]
    for method, label, b in points:
        common = dict(max_new_tokens=new, sampling=settings[label])
        if method == 'autoregressive':
            fn, params = make_autoregressive_fn(t_gd, **common), [t_params]
        else:
            fn = make_speculative_fn(t_gd, d_gd, num_draft_tokens=k, **common)
            params = [t_params, d_params]
        rows = [prompts[i % len(prompts)] for i in range(max(b, len(prompts)))]
        groups = [rows[i : i + b] for i in range(0, len(rows), b)]
        batches = []
        for g in groups:
            toks = np.zeros((b, width), np.int32)
            for j, r in enumerate(g):
                toks[j, : len(r)] = r
            lens = np.asarray([len(r) for r in g], np.int32)
            batches.append((jnp.asarray(toks), jnp.asarray(lens)))
        rng = jax.random.key(0)
        compiled = compile_sampler(fn, params, *batches[0], rng)
        jax.block_until_ready(compiled(*params, *batches[0], rng))  # warm-up
        start = time.perf_counter()
        outs = [
            compiled(*params, t, n, jax.random.fold_in(rng, i)) for i, (t, n) in enumerate(batches)
        ]
        outs = jax.block_until_ready(outs)
        seconds = time.perf_counter() - start
        tokens = [np.asarray(o.tokens)[j] for o, g in zip(outs, groups) for j in range(len(g))]
        n = sum(len(t) for t in tokens)
        calls = sum(int(o.stats['target_calls']) for o in outs) if method != 'autoregressive' else n
        print(f'specjax {method} {label} batch {b}: {n / seconds:.1f} tokens/s', flush=True)
        results[(method, label, b)] = dict(
            tokens=tokens[: len(prompts)],
            seconds=seconds,
            tokens_per_s=n / seconds,
            compile_s=compiled.compile_s,
            target_calls=calls,
            tau=n / calls,
        )
    return results


def agreement(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    """Fraction of identical tokens, and of tokens before each row's first divergence."""
    same = [np.asarray(x) == np.asarray(y) for x, y in zip(a, b)]
    prefix = [int(np.argmin(s)) if not s.all() else len(s) for s in same]
    total = sum(len(s) for s in same)
    return {'identical': float(sum(s.sum() for s in same) / total), 'prefix': sum(prefix) / total}


def table(rows) -> str:
    head = (
        '| system | method | sampling | batch | tokens/s | tau | draft calls/round | '
        '% of roofline (AR) |'
    )
    lines = [head, '|' + '---|' * 8]
    for r in rows:
        dc, roof = r.get('draft_calls_per_round'), r.get('roofline')
        lines.append(
            f'| {r["system"]} | {r["method"]} | {r["sampling"]} | {r["batch"]} | '
            f'{r["tokens_per_s"]:.1f} | {r["tau"]:.2f} | {"-" if dc is None else f"{dc:.2f}"} | '
            f'{"-" if roof is None else f"{100 * roof:.0f}"} |'
        )
    return '\n'.join(lines)


def add_roofline(rows: list[dict], weight_bytes: int, bytes_per_s: float) -> None:
    """Autoregressive rows get 'roofline': the share of the weight-read limit their tokens/s
    reach (benchmarks.roofline; the same float32 weights on both sides)."""
    for r in rows:
        if r['method'] == 'autoregressive':
            r['roofline'] = roofline.fraction(
                r['tokens_per_s'], r['batch'], weight_bytes, bytes_per_s
            )


def main(argv=None):
    args = parser().parse_args(argv)
    from specjax.interop.gguf import import_gguf
    from specjax.interop.workdir import bundled_path
    from specjax.models.early_exit import early_exit_draft

    new = args.max_new_tokens or (24 if args.quick else 64)
    k, n_layers, batch = args.k, args.draft_layers, args.batch
    path = bundled_path('smollm2-135m')
    started = time.perf_counter()
    target, tok = import_gguf(path)
    draft = early_exit_draft(target, n_layers)
    items = real_prompts(args.quick)
    prompts = encode_prompts(tok, items)
    hf_target, hf_draft = transformers_models(path, n_layers, k)
    hf = run_transformers(hf_target, hf_draft, prompts, new, k)
    sj = run_specjax(target, draft, prompts, new, k, batch)

    rows = []
    for (method, label), r in hf.items():
        rows.append(dict(system='transformers', method=method, sampling=label, batch=1, **r))
    for (method, label, b), r in sj.items():
        rows.append(dict(system='specjax', method=method, sampling=label, batch=b, **r))
    bandwidth = roofline.bandwidth()
    add_roofline(rows, roofline.weight_bytes(split(target)[1]), bandwidth)
    rate = {(r['system'], r['method'], r['sampling'], r['batch']): r['tokens_per_s'] for r in rows}
    ratios = {}
    for s in ('greedy', 't1'):
        ratios[f'spec_vs_assisted_{s}'] = (
            rate['specjax', 'speculative', s, 1] / rate['transformers', 'assisted', s, 1]
        )
        ratios[f'ar_vs_generate_{s}'] = (
            rate['specjax', 'autoregressive', s, 1] / rate['transformers', 'autoregressive', s, 1]
        )
        ratios[f'spec_batch{batch}_vs_assisted_{s}'] = (
            rate['specjax', 'speculative', s, batch] / rate['transformers', 'assisted', s, 1]
        )
    greedy = {
        'specjax_ar_vs_transformers_generate': agreement(
            sj['autoregressive', 'greedy', 1]['tokens'], hf['autoregressive', 'greedy']['tokens']
        ),
        'specjax_spec_vs_transformers_generate': agreement(
            sj['speculative', 'greedy', 1]['tokens'], hf['autoregressive', 'greedy']['tokens']
        ),
        'transformers_assisted_vs_generate': agreement(
            hf['assisted', 'greedy']['tokens'], hf['autoregressive', 'greedy']['tokens']
        ),
    }
    print(table(rows))
    print('ratios:', json.dumps({k_: round(v, 3) for k_, v in ratios.items()}))
    print('greedy agreement:', json.dumps(greedy))
    result = {
        'model': 'SmolLM2-135M-Instruct.Q4_1.gguf',
        'draft_layers': n_layers,
        'k': k,
        'max_new_tokens': new,
        'prompts': [d for d, _ in items],
        'rows': [{key: v for key, v in r.items() if key != 'tokens'} for r in rows],
        'ratios': ratios,
        'greedy_agreement': greedy,
        'wall_s': time.perf_counter() - started,
        'bandwidth_bytes_per_s': bandwidth,
        'cpu_count': os.cpu_count(),
        'note': 'one process, one shared CPU: compare ratios, not absolute rates',
    }
    jsonio.write_json(args.out, result)
    print(f'wrote {args.out} ({result["wall_s"]:.0f} s)')
    return result


if __name__ == '__main__':
    main()
