r"""Training-free drafting on SmolLM2-135M: specjax's n-gram draft, transformers' prompt lookup.

Both systems load the bundled GGUF (the same dequantised float32 weights) and decode at batch 1
the same prompts: stdlib code to continue (`code`) and chat prompts (SmolLM2's template) that ask
to rewrite a stdlib function (`chat`). transformers: plain `generate` and prompt lookup
(`prompt_lookup_num_tokens`, `max_matching_ngram_size`); specjax: `autoregressive_sample` and
`speculative_sample` with an `NGramDraft` for each k:min_n[:proposals by match length] of
--variants (chains), and a tree of --branches chains at the first variant. eos is ignored on both
sides, so every run makes --max_new_tokens tokens.
Each system's speedup is its lookup's tokens/s over its own plain decoding, measured in the same
process, per domain, from each prompt's median over --repeats runs taken in turn with the other
methods (a drift in the host's speed moves every method alike). Prints one table; writes JSON
(--out). Run on a quiet machine: ratios taken while other work runs are not comparable.

  python -m benchmarks.prompt_lookup                       # both systems, ~20 minutes
  python -m benchmarks.prompt_lookup --sampling=greedy --branches=0 --repeats=2  # ~8 minutes

With --short_new=N each specjax method also decodes N tokens, timed in turn with the rest: the
difference from the full run is the decoding cost without the prefill, per token, per round (a
target call) and a round in plain decoding steps (a second table and the rows' decode_* fields;
a variant proposing nothing, e.g. 4:1:0/0/0, measures the chain loop's own cost at width 1).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import os
import textwrap
import time

import jax
import numpy as np

from benchmarks import cli
from specjax import jsonio


def parser():
    p = cli.parser(__doc__, out='/tmp/specjax/prompt_lookup.json', compilation_cache=True)
    p.add_argument('--systems', default='specjax,transformers', help='comma-separated')
    p.add_argument(
        '--variants',
        default='4:1,8:1,8:2,8:1:0/4/8',
        help="specjax's chains as k:min_n[:proposals after a 1/2/.../n-gram match], "
        'comma-separated (NGramDraft.proposals_by_n, whose length is the longest n matched, '
        'else --max_n; 8:1:0/4/8 proposes none after a 1-gram match, 4 after a 2-gram one, 8 '
        'after a 3-gram one)',
    )
    p.add_argument('--branches', default=2, type=int, help='chains of the tree (0: no tree)')
    p.add_argument(
        '--max_n',
        default=3,
        type=int,
        help="longest n-gram matched (transformers; specjax's variants without a table)",
    )
    p.add_argument('--hf_tokens', default=4, type=int, help='prompt_lookup_num_tokens')
    p.add_argument('--max_new_tokens', default=96, type=int, help='tokens per prompt')
    p.add_argument(
        '--short_new',
        default=0,
        type=int,
        help="also run specjax's methods for this many tokens, in turn with the others: the "
        'difference gives the decoding cost per token and per round without the prefill (0: off)',
    )
    p.add_argument('--sampling', default='greedy,t1', help='greedy and/or t1')
    p.add_argument('--prompts', default=4, type=int, help='prompts per domain')
    p.add_argument(
        '--repeats', default=3, type=int, help='timed runs per prompt and method, interleaved'
    )
    return p


SOURCES = ('textwrap.dedent', 'json.dumps', 'copy.deepcopy', 'shlex.split', 'fnmatch.translate')


def _function(name: str):
    module, attr = name.split('.')
    return getattr(__import__(module), attr)


def prompts(n: int) -> list[tuple[str, str | list]]:
    """(domain, text or chat messages): `n` code prefixes and `n` rewrite requests."""
    sources = [inspect.getsource(_function(s)) for s in SOURCES[:n]]
    code = [('code', src[:600]) for src in sources]
    asks = (
        'Rewrite this function with clearer variable names',
        'Add type hints to this function',
        'Rewrite this function without changing its behaviour',
        'Add comments to this function',
    )
    chat = [
        (
            'chat',
            [
                {
                    'role': 'user',
                    'content': f'{asks[i % len(asks)]}:\n\n```python\n'
                    f'{textwrap.dedent(src)[:700]}\n```',
                }
            ],
        )  # fmt: skip
        for i, src in enumerate(sources)
    ]
    return code + chat


def encode(tok, items) -> list[list[int]]:
    out = []
    for _, item in items:
        if isinstance(item, list):
            text = tok.apply_chat_template(item, add_generation_prompt=True)
        else:
            text = item
        out.append([tok.bos_id, *tok.encode(text)])
    return out


def run_transformers(path, ids_list, new, args, settings) -> dict:
    import torch
    import transformers

    folder, name = os.path.dirname(path), os.path.basename(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    calls = {'n': 0}
    model.register_forward_pre_hook(lambda *_: calls.__setitem__('n', calls['n'] + 1))
    kw = {'greedy': dict(do_sample=False), 't1': dict(do_sample=True, temperature=1.0, top_k=0)}
    lookup = dict(prompt_lookup_num_tokens=args.hf_tokens, max_matching_ngram_size=args.max_n)
    results = {}
    for label in settings:
        for repeat in range(args.repeats):  # interleaved: both methods per prompt per repeat
            for i, ids in enumerate(ids_list):
                for method, extra in (('plain', {}), ('lookup', lookup)):
                    torch.manual_seed(i)
                    calls['n'] = 0
                    start = time.perf_counter()
                    with torch.no_grad():
                        out = model.generate(torch.tensor([ids]), max_new_tokens=new,
                                             min_new_tokens=new, **kw[label], **extra)  # fmt: skip
                    _record(results, ('transformers', method, label, i),
                            time.perf_counter() - start, out[0, len(ids) :].numpy(),
                            calls['n'])  # fmt: skip
            print(f'transformers {label} repeat {repeat} done', flush=True)
    return results


def _variant(text: str) -> tuple[int, int, tuple[int, ...]]:
    """'k:min_n[:a/b/c]' -> (k, min_n, proposals_by_n)."""
    parts = text.split(':')
    if len(parts) not in (2, 3):
        raise ValueError(f'--variants: each entry is k:min_n[:a/b/c], got {text!r}')
    by_n = tuple(int(x) for x in parts[2].split('/')) if len(parts) == 3 else ()
    return int(parts[0]), int(parts[1]), by_n


def run_specjax(target, ids_list, new, args, settings) -> dict:
    from specjax.evaluation.measure import compile_samplers
    from specjax.models import split
    from specjax.sampling import (
        NGramDraft,
        SamplingConfig,
        make_autoregressive_fn,
        make_speculative_fn,
        make_tree_speculative_fn,
        ngram_tree_paths,
    )

    tgd, tparams = split(target)
    variants = [_variant(v) for v in args.variants.split(',') if v]
    width = max(map(len, ids_list))
    sampling = {'greedy': SamplingConfig(0.0), 't1': SamplingConfig(1.0)}
    methods = [('plain', None)]
    methods += [
        (f'ngram k={k} min_n={n}' + (f" by_n={'/'.join(map(str, by_n))}" if by_n else ''),
         (k, n, by_n))
        for k, n, by_n in variants
    ]  # fmt: skip
    if args.branches:
        k, n, _ = variants[0]
        methods.append((f'ngram tree {args.branches}x{k} min_n={n}', ('tree', k, n)))
    batches = []
    for ids in ids_list:
        toks = np.zeros((1, width), np.int32)
        toks[0, : len(ids)] = ids
        batches.append((toks, np.asarray([len(ids)], np.int32)))
    jobs, keys = [], []
    for n, label, (method, k) in itertools.product(
        (new, args.short_new) if args.short_new else (new,), settings, methods
    ):
        s = sampling[label]
        if k is None:
            fn, params = make_autoregressive_fn(tgd, max_new_tokens=n, sampling=s), [tparams]
        elif k[0] == 'tree':
            tree = ngram_tree_paths(args.branches, k[1])
            draft = NGramDraft(args.max_n, k[2])
            fn = make_tree_speculative_fn(tgd, draft, tree=tree, max_new_tokens=n, sampling=s)
            params = [tparams, ()]
        else:
            draft = NGramDraft(len(k[2]) or args.max_n, k[1], k[2])
            fn = make_speculative_fn(tgd, draft, num_draft_tokens=k[0], max_new_tokens=n,
                                     sampling=s)  # fmt: skip
            params = [tparams, ()]
        jobs.append((fn, params, *batches[0], jax.random.key(0)))
        keys.append((method, label, params, n))
    started = time.perf_counter()
    compiled = compile_samplers(jobs)
    print(f'specjax: compiled {len(jobs)} programs in {time.perf_counter() - started:.0f} s')
    results = {}
    for c, (_, _, params, _) in zip(compiled, keys, strict=True):
        jax.block_until_ready(c(*params, *batches[0], jax.random.key(1)))  # warm-up
    for repeat in range(args.repeats):  # interleaved: every method per prompt per repeat
        for i, (toks, lens) in enumerate(batches):
            for c, (method, label, params, n) in zip(compiled, keys, strict=True):
                start = time.perf_counter()
                out = jax.block_until_ready(c(*params, toks, lens, jax.random.key(i)))
                calls = int(out.stats['target_calls']) - 1 if method != 'plain' else n
                short = () if n == new else ('short',)  # the --short_new run's key
                _record(results, ('specjax', method, label, i, *short),
                        time.perf_counter() - start, np.asarray(out.tokens[0]), calls)  # fmt: skip
        print(f'specjax repeat {repeat} done', flush=True)
    return results


def _record(results, key, seconds, tokens, target_calls) -> None:
    """Adds one timed run: 'seconds' is the median over the repeats so far ('repeat_s' keeps
    them); tokens and calls are the first repeat's (the same key gives the same run)."""
    row = results.setdefault(key, dict(tokens=tokens, target_calls=target_calls, repeat_s=[]))
    row['repeat_s'].append(seconds)
    row['seconds'] = float(np.median(row['repeat_s']))


def summarise(results, items, new) -> list[dict]:
    """Rows per (system, method, sampling, domain): tokens/s, tau, speedup over plain."""
    domains = sorted({d for d, _ in items})
    groups = sorted({key[:3] for key in results})
    rows = []
    for system, method, label in groups:
        for domain in domains:
            idx = [i for i, (d, _) in enumerate(items) if d == domain]
            got = [results[(system, method, label, i)] for i in idx]
            plain = [results[(system, 'plain', label, i)] for i in idx]
            seconds = sum(r['seconds'] for r in got)
            tokens = new * len(idx)
            rate = tokens / seconds
            row = dict(
                system=system, method=method, sampling=label, domain=domain,
                tokens_per_s=rate, tau=tokens / sum(r['target_calls'] for r in got),
                speedup=rate / (tokens / sum(r['seconds'] for r in plain)),
            )  # fmt: skip
            if label == 'greedy':
                same = [np.array_equal(r['tokens'], p['tokens']) for r, p in zip(got, plain)]
                row['greedy_equal_to_plain'] = float(np.mean(same))
            rows.append(row)
    return rows


def add_decode_costs(rows, results, items, new: int, short: int) -> None:
    """Adds to each specjax row the decoding cost without the prefill, from the runs of `new`
    and `short` tokens: ms per token, ms per target call (a round), and a round in plain decoding
    steps (ms per round over the plain method's ms per token, same sampling and domain)."""
    for row in rows:
        if row['system'] != 'specjax':
            continue
        idx = [i for i, (d, _) in enumerate(items) if d == row['domain']]
        keys = [('specjax', row['method'], row['sampling'], i) for i in idx]
        dt = sum(results[k]['seconds'] - results[(*k, 'short')]['seconds'] for k in keys)
        calls = sum(results[k]['target_calls'] - results[(*k, 'short')]['target_calls']
                    for k in keys)  # fmt: skip
        row['decode_ms_per_token'] = 1e3 * dt / ((new - short) * len(idx))
        row['decode_ms_per_round'] = 1e3 * dt / max(calls, 1)
    plain = {(r['sampling'], r['domain']): r['decode_ms_per_token'] for r in rows
             if r['system'] == 'specjax' and r['method'] == 'plain'}  # fmt: skip
    for row in rows:
        if 'decode_ms_per_round' in row:
            step = plain[(row['sampling'], row['domain'])]
            row['round_in_plain_steps'] = row['decode_ms_per_round'] / step


def decode_table(rows) -> str:
    lines = ['| method | sampling | domain | decode ms/token | ms/round | round in plain steps |',
             '|---|---|---|---|---|---|']  # fmt: skip
    for r in rows:
        if 'decode_ms_per_round' in r:
            lines.append(
                f'| {r["method"]} | {r["sampling"]} | {r["domain"]} | '
                f'{r["decode_ms_per_token"]:.1f} | {r["decode_ms_per_round"]:.1f} | '
                f'{r["round_in_plain_steps"]:.2f} |'
            )
    return '\n'.join(lines)


def table(rows) -> str:
    lines = ['| system | method | sampling | domain | tokens/s | tau | speedup over its plain |',
             '|---|---|---|---|---|---|---|']  # fmt: skip
    for r in rows:
        lines.append(
            f'| {r["system"]} | {r["method"]} | {r["sampling"]} | {r["domain"]} | '
            f'{r["tokens_per_s"]:.1f} | {r["tau"]:.2f} | {r["speedup"]:.2f}x |'
        )
    return '\n'.join(lines)


def main(argv=None):
    args = parser().parse_args(argv)
    if args.short_new and not 0 < args.short_new < args.max_new_tokens:
        raise SystemExit(f'--short_new={args.short_new} must be 0 (off) or in [1, --max_new_tokens='
                         f'{args.max_new_tokens})')  # fmt: skip
    cli.setup_cache(args)
    from specjax.interop.gguf import import_gguf
    from specjax.interop.workdir import bundled_path

    started = time.perf_counter()
    path = bundled_path('smollm2-135m')
    target, tok = import_gguf(path)
    items = prompts(args.prompts)
    ids_list = encode(tok, items)
    settings = [s for s in args.sampling.split(',') if s]
    systems = [s for s in args.systems.split(',') if s]
    results = {}
    if 'specjax' in systems:
        results.update(run_specjax(target, ids_list, args.max_new_tokens, args, settings))
    if 'transformers' in systems:
        results.update(run_transformers(path, ids_list, args.max_new_tokens, args, settings))
    rows = summarise(results, items, args.max_new_tokens)
    print(table(rows))
    if args.short_new and 'specjax' in systems:
        add_decode_costs(rows, results, items, args.max_new_tokens, args.short_new)
        print(decode_table(rows))
    result = dict(
        model='SmolLM2-135M-Instruct.Q4_1.gguf (float32)', batch=1,
        max_new_tokens=args.max_new_tokens, variants=args.variants, max_n=args.max_n,
        hf_prompt_lookup_num_tokens=args.hf_tokens, branches=args.branches,
        short_new=args.short_new,
        prompts=[[d, copy.deepcopy(x)] for d, x in items], prompt_tokens=list(map(len, ids_list)),
        repeats=args.repeats, rows=rows, wall_s=time.perf_counter() - started,
        cpu_count=os.cpu_count(),
        note='one process, batch 1: compare speedups within a system and run',
    )  # fmt: skip
    jsonio.write_json(args.out, result)
    print(json.dumps({'wall_s': round(result['wall_s'])}), f'wrote {args.out}')
    return result


if __name__ == '__main__':
    main()
