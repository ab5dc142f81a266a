"""The quickstart report's feature-draft section: the feature draft (stage spec_feature) against
the goals set for it at EAGLE-3's scale, by how much it misses each, and where it loses the
target (acceptance at the first draft position, which reads the target's features, against the
later ones, which read the draft's own output states).

Every number comes from the JSON loaded by specjax.quickstart.report_data; only the goals
(FEATURE_GOALS) are constants.
"""

from __future__ import annotations

from specjax.evaluation.tables import fmt, fmt_interval, human_label, markdown_table
from specjax.quickstart.report_data import (
    has_run,
    interval,
    labels,
    position_counts,
    ref_k,
    run_at,
    serve_row,
)

# The goals of the feature draft on SmolLM2-135M (docs/quickstart.md, "The feature draft against
# its goals"): alpha and tau of a k = 4 chain per sampling, the end-to-end speedup over the target
# alone at batch 1 (greedy: serve; T = 1 has no batch-1 measurement), and training wall seconds
# including the feature cache.
FEATURE_GOALS = {
    'alpha': {'T=0': 0.65, 'T=1': 0.55},
    'tau': {'T=0': 2.5, 'T=1': 2.2},
    'speedup_batch1': {'T=0': 1.5, 'T=1': 1.3},
    'train_seconds': 1200.0,
}


def _sampling_labels(spec: dict) -> dict[str, str]:
    """'T=0' / 'T=1' -> the run's label for greedy and for plain T = 1 (no top-k / top-p)."""
    found = {}
    for label in labels(spec):
        if label == 'T=0':
            found['T=0'] = label
        elif label in ('T=1', 'T=1,top_k=0,top_p=1'):
            found['T=1'] = label
    return found


def _against(value, goal: float, higher: bool = True) -> str:
    """'met' or 'short by X' (goal minus value; for a ceiling, value minus goal)."""
    if value is None:
        return '-'
    gap = goal - value if higher else value - goal
    return 'met' if gap <= 0 else f'short by {fmt(gap)}'


def feature_goal_rows(d: dict) -> list[list]:
    """[figure, measured, goal, against the goal] for the feature draft (needs spec_feature,
    serve and the run record)."""
    spec, rows = d['spec_feature'], []
    k = ref_k(spec)
    found = _sampling_labels(spec)
    for name, key in (('alpha', 'alpha'), ('tau', 'block_efficiency')):
        for t, label in found.items():
            if not has_run(spec, label, k):  # k not evaluated at this sampling
                continue
            r = run_at(spec, label, k)
            goal = FEATURE_GOALS[name][t]
            rows.append(
                [
                    f'{name}, {human_label(label)}, chain k = {k}',
                    fmt_interval(r[key], interval(r, key)),
                    f'>= {fmt(goal)}',
                    _against(r[key], goal),
                ]
            )
    sv = d['serve']
    methods = {row['method'] for row in sv['rows'] if row['batch_size'] == 1}
    greedy = sv.get('sampling', {}).get('temperature') == 0.0
    if greedy and {'spec_feature', 'target'} <= methods:
        pair, alone = serve_row(sv, 'spec_feature', 1), serve_row(sv, 'target', 1)
        speedup = pair['tokens_per_s'] / alone['tokens_per_s']
        goal = FEATURE_GOALS['speedup_batch1']['T=0']
        rows.append(
            [
                f'speedup over the target alone, batch 1, greedy, end to end (serve, k = '
                f'{sv["k"]}, prefill included)',
                f'{fmt(speedup)}x',
                f'>= {fmt(goal)}x',
                _against(speedup, goal),
            ]
        )
    if 'T=1' in found:
        best = spec['optimal_k'][found['T=1']]
        batch = spec['prompts']['batch_size']
        rows.append(
            [
                'speedup over the target alone, T = 1, batch 1',
                f'not measured at batch 1 (serve is greedy); batch {batch}, best k = '
                f'{best["best_measured_k"]}: {fmt(best["best_measured_speedup"])}x',
                f'>= {fmt(FEATURE_GOALS["speedup_batch1"]["T=1"])}x',
                '-',
            ]
        )
    wall = d['run'].get('stage_seconds', {}).get('draft_feature')
    cache_s = (d.get('draft_feature', {}).get('feature_cache') or {}).get('seconds')
    goal = FEATURE_GOALS['train_seconds']
    rows.append(
        [
            'training wall seconds, feature caching included (stage draft_feature)',
            f'{fmt(wall)} (feature cache {fmt(cache_s)})',
            f'<= {fmt(goal)}',
            _against(wall, goal, higher=False),
        ]
    )
    return rows


def first_and_later(run: dict) -> tuple[float | None, float | None]:
    """Conditional acceptance at draft position 1 and pooled over positions 2..k (accepted /
    examined; None where nothing was examined)."""
    counts = position_counts(run)
    first, later = counts[:1], counts[1:]

    def rate(cs):
        examined = sum(e for _, e in cs)
        return sum(a for a, _ in cs) / examined if examined else None

    return rate(first), rate(later)


def section_feature_goals(d: dict) -> list[str]:
    """The feature draft against FEATURE_GOALS and its acceptance by position ([] without a
    feature draft)."""
    if 'spec_feature' not in d:
        return []
    spec = d['spec_feature']
    k = ref_k(spec)
    out = [
        '## The feature draft (EAGLE-3) against its goals',
        '',
        markdown_table(['figure', 'measured', 'goal', 'against the goal'], feature_goal_rows(d)),
        '',
    ]
    where = []
    for label in _sampling_labels(spec).values():
        if not has_run(spec, label, k):
            continue
        first, later = first_and_later(run_at(spec, label, k))
        where.append(f'{human_label(label)}: {fmt(first)} at position 1, {fmt(later)} after')
    if where and k > 1:
        out += [
            f'Where it loses the target (chain k = {k}, acceptance given the position was '
            'examined): ' + '; '.join(where) + '. At position 1 the draft reads the '
            "target's features of the prefix; past it, its own output states stand in for "
            'features the target has not computed yet (trained on only when '
            'config.draft_feature.feature.ttt_steps > 1).',
            '',
        ]
    return out
