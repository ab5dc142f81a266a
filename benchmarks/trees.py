"""Chains, stopped chains, static and dynamic trees side by side on a trained pair (not a test).

  python -m benchmarks.trees --workdir=workdirs/quickstart [--draft=draft_distilled]
      [--batch_sizes=1,8] [--temperatures=0,1] [--repeats=3] [--prompts_per_domain=2]
      [--out=PATH]

`--workdir` is a finished quickstart workdir (docs/quickstart.md): its `target/` and the draft's
sub-workdir are loaded from their checkpoints, prompts are prefixes (16-32 tokens) of validation
documents of the quickstart's corpus (prompts_per_domain per domain, raised until there are at
least max(batch_sizes)). Random-init pairs mislead here: they mostly echo their input, so a chain
already accepts ~90% and siblings have nothing to rescue.

Measured at every batch size b and temperature T (benchmarks.tree_points): autoregressive decoding
(the speedup baseline), chains k = 1..6 (`make_speculative_fn`), confidence-stopped chains (k = 6,
`stop_below` h), the static trees of TREES under both sibling rules at T > 0 (one at T = 0, where
they coincide; `--static` picks some) and EAGLE-2 dynamic trees (`DynamicTree(depth, expand,
nodes)`). `--preset=smollm2` reads a SmolLM2 quickstart workdir: prompts in SmolLM2's tokenizer,
the reduced draft's `draft_vocab_ids`. b = 1 decodes the prompts one per call, b > 1 b prompts per
call. Each timing is the minimum over `repeats` interleaved (round-robin) runs of each call, summed
over calls, in CPU seconds of this process (time.process_time: on a machine shared with other jobs
wall time swings several-fold while CPU time barely moves); wall time of the same runs is reported
beside it. The first calls (compiling) are timed apart. Only ratios within one run are reported.
The best shape per (b, T) is picked twice (tree_points.best_shape): by measured tokens per CPU
second, and by the optimal-k cost model extended to trees (tau / ((draft calls per round) c + v(N))
with c, v(N) calibrated here).
Writes JSON (--out) and the markdown tables beside it (same path, .md).
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


def quickstart_prompts(workdir: str, preset: str, size: str, per_domain: int, min_len: int,
                       max_len: int):  # fmt: skip
    """Validation prefixes of the corpus of configs/quickstart.py:preset=PRESET,size=SIZE, in
    the pair's tokenizer (SmolLM2's, read from <workdir>/target, for preset smollm2)."""
    from specjax.config_files import load_config
    from specjax.data import build_tokenizer
    from specjax.evaluation.prompts import make_prompts

    path = os.path.join(os.path.dirname(__file__), '..', 'configs', 'quickstart.py')
    data = load_config(f'{path}:preset={preset},size={size}').data
    if preset == 'smollm2':
        data.tokenizer_path = os.path.join(workdir, 'target')
    tok = build_tokenizer(data)
    return make_prompts(data, tok, per_domain=per_domain, min_len=min_len, max_len=max_len, seed=0)


def run(args) -> dict:
    from benchmarks import tree_points

    started = time.perf_counter()
    from specjax.evaluation.pairs import draft_vocab_ids

    target, draft = cli.load_pair(args.workdir, args.draft)
    vocab_ids = draft_vocab_ids(os.path.join(args.workdir, args.draft))  # reduced drafts
    per_domain = args.prompts_per_domain
    prompts_of = functools.partial(quickstart_prompts, args.workdir, args.preset, args.size)
    prompts = prompts_of(per_domain, 16, args.prompt_len)
    if len(prompts) < max(args.batch_sizes):
        per_domain = -(-per_domain * max(args.batch_sizes) // len(prompts))
        prompts = prompts_of(per_domain, 16, args.prompt_len)
    unknown = sorted(set(args.static) - set(TREES))
    if unknown:
        raise SystemExit(f'--static: unknown tree(s) {unknown}; known: {sorted(TREES)}')
    static = {name: TREES[name] for name in args.static} if args.trees else {}
    grid = tree_points.Grid(
        chains=args.chains, stops=args.stops, trees=static,
        dynamic=args.dynamic if args.trees else (),
    )  # fmt: skip
    result = tree_points.measure(
        target, draft, prompts.tokens, prompts.lengths, grid=grid,
        batch_sizes=args.batch_sizes, temperatures=args.temperatures, max_new=args.max_new,
        repeats=args.repeats, seed=args.seed, sibling_keys=args.sibling_keys,
        draft_vocab_ids=vocab_ids, log=functools.partial(print, flush=True),
    )  # fmt: skip
    result = dict(
        workdir=args.workdir, draft=args.draft, preset=args.preset,
        draft_vocab_size=None if vocab_ids is None else len(vocab_ids),
        repeats=args.repeats, max_new=args.max_new,
        prompts=len(prompts), prompts_per_domain=per_domain, batch_sizes=list(args.batch_sizes),
        temperatures=list(args.temperatures), **result,
        wall_s=time.perf_counter() - started,
    )  # fmt: skip
    jsonio.write_json(args.out, result)
    text = table(result)
    md = os.path.splitext(args.out)[0] + '.md'
    with open(md, 'w') as f:
        f.write(text + '\n')
    print(text)
    print(f'\ncompile + first calls: {result["compile_and_first_call_s"]:.0f} s; '
          f'wrote {args.out} and {md} ({result["wall_s"]:.0f} s in all)')  # fmt: skip
    return result


def _fmt(x, digits=2) -> str:
    return '–' if x is None else f'{x:.{digits}f}'


def table(result: dict) -> str:
    """The markdown report: one table per (batch, T), the best shapes, the sibling rules."""
    from specjax.evaluation.tables import markdown_table

    cols = ['sampler', 'nodes', 'τ', 'α per depth', 'draft calls / round', 'round ms',
            'tokens/s', 'vs AR', 'vs best chain', 'vs AR (wall)', 'predicted vs AR']  # fmt: skip
    parts = [
        f'{result["prompts"]} prompts x {result["max_new"]} new tokens; minimum of '
        f'{result["repeats"]} interleaved repeats per call, CPU seconds of this process (wall '
        'clock beside); tokens/s = emitted tokens per CPU second; predicted = τ per loop round / '
        '(draft calls per round × c + v(N)) from the calibration.'
    ]
    groups = {}
    for p in result['points']:
        groups.setdefault((p['batch'], p['temperature']), []).append(p)
    for (b, t), group in sorted(groups.items()):
        cal = result['calibration'].get(str(b))
        note = f', c = {cal["c"]:.2f}' if cal else ''
        rows = [
            [p['name'], p['nodes'], _fmt(p['tau']),
             ' '.join(_fmt(a) for a in p['alpha_per_depth']),
             _fmt(p['draft_calls_per_round'], 1), _fmt(p['round_cpu_ms']),
             _fmt(p['tokens_per_cpu_s'], 0), _fmt(p['speedup_vs_ar']),
             _fmt(p['speedup_vs_best_chain']), _fmt(p['wall_speedup_vs_ar']),
             _fmt(p['predicted_speedup'])]
            for p in group
        ]  # fmt: skip
        parts.append(f'**batch {b}, T = {t:g}**{note}\n\n' + markdown_table(cols, rows))
    best = [
        [k, v['measured'], _fmt(v['measured_speedup_vs_ar']), v['predicted'] or '–',
         _fmt(v['predicted_pick_vs_measured_best']), v['chain_k_measured'],
         v['chain_k_predicted'] or '–']
        for k, v in result['best'].items()
    ]  # fmt: skip
    parts.append('**Best shape** (measured: highest tokens per CPU s; predicted: highest '
                 'predicted speedup, and its measured tokens/s over the measured best)\n\n'
                 + markdown_table(['setting', 'measured best', 'vs AR', 'predicted best',
                                   'its tokens/s ÷ best', 'chain k (measured)',
                                   'chain k (predicted)'], best))  # fmt: skip
    if result['siblings']:
        sib = [
            [s['tree'], s['batch'], f'{s["temperature"]:g}', s['max_siblings'],
             _fmt(s['tau_without_replacement']), _fmt(s['tau_iid']), _fmt(s['ratio'], 3),
             _fmt(s['alpha1_without_replacement']), _fmt(s['alpha1_iid']),
             'yes' if s['target_met'] else 'no']
            for s in result['siblings']
        ]  # fmt: skip
        parts.append('**Sibling rules** (static trees at T > 0: τ without replacement vs '
                     'i.i.d.; target: ≥, strictly > with ≥ 3 siblings)\n\n'
                     + markdown_table(['tree', 'batch', 'T', 'max siblings', 'τ w/o repl.',
                                       'τ iid', 'ratio', 'α₁ w/o repl.', 'α₁ iid', 'target met'],
                                      sib))  # fmt: skip
    if result.get('siblings_resampled'):
        sib = [
            [s['tree'], s['batch'], f'{s["temperature"]:g}', s['calls'], s['max_siblings'],
             _fmt(s['tau_without_replacement'], 3), _fmt(s['tau_iid'], 3),
             f'{s["diff"]:+.3f} ± {s["se"]:.3f}', _fmt(s['z'], 1),
             _fmt(s['alpha1_without_replacement'], 3), _fmt(s['alpha1_iid'], 3),
             'yes' if s['target_met'] else 'no']
            for s in result['siblings_resampled']
        ]  # fmt: skip
        parts.append('**Sibling rules, resampled** (untimed decodes with new keys; paired per-call '
                     'τ difference ± standard error; target met: z > -2, and z > 2 with ≥ 3 '
                     'siblings)\n\n'
                     + markdown_table(['tree', 'batch', 'T', 'calls', 'max siblings',
                                       'τ w/o repl.', 'τ iid', 'Δτ', 'z', 'α₁ w/o repl.',
                                       'α₁ iid', 'target met'], sib))  # fmt: skip
    return '\n\n'.join(parts)


def _dynamic(text: str):
    """'4:2:8,5:3:12' -> ((4, 2, 8), (5, 3, 12)); '' -> ()."""
    return tuple(tuple(int(x) for x in item.split(':')) for item in text.split(',') if item)


def parser():
    p = cli.parser(
        __doc__,
        out='/tmp/specjax/bench_trees.json',
        seed=0,
        repeats=3,
        compilation_cache=True,
    )
    cli.add_workdir_pair(p)
    p.add_argument(
        '--preset',
        default='embedded',
        choices=('embedded', 'smollm2'),
        help='the quickstart preset the workdir ran (configs/quickstart.py:preset=)',
    )
    p.add_argument('--size', default='full', help='its size (configs/quickstart.py:size=)')
    p.add_argument('--temperatures', default='0,1', type=cli.floats)
    p.add_argument('--prompts_per_domain', default=2, type=int)
    p.add_argument('--batch_sizes', default='1,8', type=cli.ints)
    p.add_argument('--chains', default='1,2,3,4,5,6', type=cli.ints, help='chain lengths k')
    p.add_argument(
        '--stops',
        default='0.05,0.15',
        type=cli.floats,
        help='stop_below thresholds of the confidence-stopped k = 6 chain',
    )
    p.add_argument(
        '--static',
        default=','.join(TREES),
        type=lambda text: tuple(x for x in text.split(',') if x),
        help='the static trees of TREES to measure, by name, comma-separated',
    )
    p.add_argument(
        '--dynamic',
        default='4:2:8,5:3:12,6:4:20',
        type=_dynamic,
        help='dynamic trees D:m:N (depth, expand, nodes), comma-separated',
    )
    p.add_argument(
        '--sibling_keys',
        default=32,
        type=int,
        help='untimed extra decodes of the prompts per static tree at T > 0 for the '
        'sibling-rule comparison (0: off)',
    )
    cli.add_bool(p, 'trees', True, 'measure the static and dynamic trees')
    p.add_argument('--prompt_len', default=32, type=int)
    p.add_argument('--max_new', default=48, type=int)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    cli.setup_cache(args)
    return run(args)


if __name__ == '__main__':
    main()
