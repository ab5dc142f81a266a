"""Chain vs token trees on a trained target/draft pair (not a test): tau, alpha per depth, speed.

  python -m benchmarks.trees --workdir=workdirs/quickstart [--draft=draft_distilled]
      [--temperatures=0,1] [--repeats=5] [--prompts_per_domain=4] [--out=PATH]

`--workdir` is a finished quickstart workdir (docs/quickstart.md): its `target/` and the draft's
sub-workdir are loaded from their checkpoints, prompts are prefixes (16-32 tokens) of validation
documents of the quickstart's corpus. Random-init pairs mislead here: they mostly echo their
input, so a chain already accepts ~90% and siblings have nothing to rescue.

Batch 1: every call decodes the prompts one at a time (one compile per tree; the prompt width
is fixed by right padding). The chain is `speculative_sample` (k = 4); trees run through
`tree_speculative_sample`, including the chain-shaped tree as a cross-check. Each timing is the
minimum over `repeats` interleaved (round-robin) runs of each (sampler, prompt), summed over
prompts, in CPU seconds of this process (time.process_time): on a machine shared with other jobs
wall time swings several-fold while CPU time barely moves; the wall-clock speedup over the chain
is reported beside it. Only ratios within one run are reported. alpha at depth d =
rounds that accepted a node at depth d / rounds that tested depth d.
"""

from __future__ import annotations

import functools
import itertools
import os
import time

from benchmarks import cli
from specjax import jsonio

TREES = {
    'chain4 (tree)': ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)),
    'w2 4-node': ((0,), (1,), (0, 0), (0, 0, 0)),
    'w3 8-node': ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)),
    'binary d3': tuple(p for d in (1, 2, 3) for p in itertools.product((0, 1), repeat=d)),
    'w4 20-node': (
        (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0),
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
        (0, 1, 0, 0), (0, 0, 0, 0, 0),
    ),
}  # fmt: skip


def quickstart_prompts(size: str, per_domain: int, min_len: int, max_len: int):
    """Validation prefixes of the quickstart corpus (configs/quickstart.py:size=SIZE's data)."""
    from specjax.config_files import load_config
    from specjax.data import build_tokenizer
    from specjax.evaluation.prompts import make_prompts

    path = os.path.join(os.path.dirname(__file__), '..', 'configs', 'quickstart.py')
    data = load_config(f'{path}:size={size}').data
    tok = build_tokenizer(data)
    return make_prompts(data, tok, per_domain=per_domain, min_len=min_len, max_len=max_len, seed=0)


def run(args) -> dict:
    import jax
    import numpy as np

    from specjax.models import split
    from specjax.sampling import (
        SamplingConfig,
        make_autoregressive_fn,
        make_speculative_fn,
        make_tree_speculative_fn,
    )
    from specjax.sampling.calibrate import interleaved_times

    started = time.perf_counter()
    target, draft = cli.load_pair(args.workdir, args.draft)
    (tgd, tp), (dgd, dp) = split(target), split(draft)
    prompts = quickstart_prompts(args.size, args.prompts_per_domain, 16, args.prompt_len)
    rows = [(prompts.tokens[i : i + 1], prompts.lengths[i : i + 1]) for i in range(len(prompts))]
    key = jax.random.key(args.seed)
    max_new = args.max_new

    samplers = {}
    for t in args.temperatures:
        s = SamplingConfig(t)
        samplers[('ar', t)] = (make_autoregressive_fn(tgd, max_new_tokens=max_new, sampling=s),
                               (tp,))  # fmt: skip
        chain = make_speculative_fn(tgd, dgd, num_draft_tokens=4, max_new_tokens=max_new,
                                    sampling=s)  # fmt: skip
        samplers[('chain4', t)] = (chain, (tp, dp))
        for name, tree in TREES.items():
            fn = make_tree_speculative_fn(tgd, dgd, tree=tree, max_new_tokens=max_new, sampling=s)
            samplers[(name, t)] = (fn, (tp, dp))
    # One call per (sampler, prompt): short calls, so the minimum over repeats finds quiet slots.
    calls = {
        (*name, i): functools.partial(fn, *params, toks, lens, jax.random.fold_in(key, i))
        for name, (fn, params) in samplers.items()
        for i, (toks, lens) in enumerate(rows)
    }
    outputs, first_s = {}, {}
    for name, fn in calls.items():
        t0 = time.perf_counter()
        outputs[name] = jax.device_get(jax.block_until_ready(fn()))
        first_s[str(name)] = time.perf_counter() - t0
    clocks = {'cpu': time.process_time, 'wall': time.perf_counter}
    best = {}
    for clock_name, clock in clocks.items():
        times = interleaved_times(calls, args.repeats, warmup=0, clock=clock)
        for name in samplers:  # sum over prompts of each prompt's minimum
            best[(clock_name, *name)] = sum(
                float(np.min(times[(*name, i)])) for i in range(len(rows))
            )
    cpu = lambda name, t: best[('cpu', name, t)]

    def summary(name, t):
        outs = [outputs[(name, t, i)] for i in range(len(rows))]
        stats = [{k: np.asarray(v) for k, v in o.stats.items()} for o in outs]
        total = lambda field: sum(s[field] for s in stats)
        emitted, rounds = int(total('emitted')), int(total('rounds'))
        tested, accepted = total('examined_per_position'), total('accepted_per_position')
        return dict(
            tree=name,
            nodes=len(TREES.get(name, TREES['chain4 (tree)'])),
            temperature=t,
            tau=emitted / rounds,
            alpha_per_depth=[float(a / max(e, 1)) for a, e in zip(accepted, tested, strict=True)],
            tokens_per_cpu_s=emitted / cpu(name, t),
            speedup_vs_ar=cpu('ar', t) / cpu(name, t),
            wall_speedup_vs_ar=best[('wall', 'ar', t)] / best[('wall', name, t)],
            round_cpu_ms=1e3 * cpu(name, t) / rounds,
            cpu_s=cpu(name, t),
            wall_s=best[('wall', name, t)],
        )

    result = dict(
        workdir=args.workdir, draft=args.draft, repeats=args.repeats, max_new=max_new,
        prompts=len(rows), batch_size=1, points=[],
    )  # fmt: skip
    for t in args.temperatures:
        ar_emitted = sum(
            int(np.asarray(outputs[('ar', t, i)].lengths).sum()) for i in range(len(rows))
        )
        result.setdefault('ar_tokens_per_cpu_s', {})[str(t)] = ar_emitted / cpu('ar', t)
        chain = summary('chain4', t)
        for name in ('chain4', *TREES):
            row = chain if name == 'chain4' else summary(name, t)
            row['tau_vs_chain'] = row['tau'] / chain['tau']
            row['speedup_vs_chain'] = chain['cpu_s'] / row['cpu_s']
            row['wall_speedup_vs_chain'] = chain['wall_s'] / row['wall_s']
            result['points'].append(row)
    result['first_call_s'] = first_s
    result['wall_s'] = time.perf_counter() - started
    jsonio.write_json(args.out, result)
    print(table(result))
    print(f'\nwrote {args.out} ({result["wall_s"]:.0f} s)')
    return result


def table(result: dict) -> str:
    from specjax.evaluation.tables import markdown_table

    fmt = lambda xs: ' '.join(f'{x:.2f}' for x in xs)
    rows = [
        [r['tree'], r['nodes'], r['temperature'], r['tau'], r['tau_vs_chain'],
         fmt(r['alpha_per_depth']), r['round_cpu_ms'], r['tokens_per_cpu_s'], r['speedup_vs_ar'],
         r['speedup_vs_chain'], r['wall_speedup_vs_chain']]
        for r in result['points']
    ]  # fmt: skip
    head = (
        f'batch 1, {result["prompts"]} prompts x {result["max_new"]} new tokens, minimum of '
        f'{result["repeats"]} interleaved repeats per prompt, CPU seconds of this process '
        '(wall-clock speedup over the chain in the last column); autoregressive tokens per CPU '
        's: ' + ', '.join(f'T={t}: {v:.0f}' for t, v in result['ar_tokens_per_cpu_s'].items())
    )
    cols = ['tree', 'nodes', 'T', 'τ', 'τ / chain', 'α per depth', 'round ms', 'tokens/s',
            'vs AR', 'vs chain', 'vs chain (wall)']  # fmt: skip
    return head + '\n\n' + markdown_table(cols, rows)


def parser():
    p = cli.parser(
        __doc__,
        out='/tmp/specjax/bench_trees.json',
        seed=0,
        repeats=7,
        compilation_cache=True,
    )
    cli.add_workdir_pair(p)
    p.add_argument('--size', default='full', help='the quickstart preset the workdir ran')
    p.add_argument('--temperatures', default='0,1', type=cli.floats)
    p.add_argument('--prompts_per_domain', default=4, type=int)
    p.add_argument('--prompt_len', default=32, type=int)
    p.add_argument('--max_new', default=48, type=int)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    cli.setup_cache(args)
    return run(args)


if __name__ == '__main__':
    main()
