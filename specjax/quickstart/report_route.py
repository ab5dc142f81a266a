"""The report's fourth answer, `route`: the curve between "distill" and "speculate".

From <root>/route/route.json (specjax.evaluation.route_stage): the verdict row `route_row` (the
router's point chosen on validation prompts under the quality floor, its held-out latency
against the target alone, the fraction of requests the student kept and the quality cost, with
95 % bootstrap intervals over held-out prompts), the section `section_route` (every signal's
chosen point and the speculative cascade's points, each cascade figure marked lossy by design),
and the plot `route_quality_vs_latency` (quality cost against latency relative to the target
alone: the target, the student, every exact speculative option, the router's and the cascade's
curves). Nothing here when the run has no route stage (the embedded-corpus preset).
"""

from __future__ import annotations

import os

import numpy as np

from specjax.evaluation.tables import fmt, fmt_interval, markdown_table
from specjax.sweeps.plots import new_figure

LOSSY = 'not exact by design'  # said next to every figure of the cascade
SIGNAL_WORDS = {
    'mean_nll': "the student's mean token log-probability over its answer",
    'max_nll': "the student's minimum token log-probability over its answer",
    'mean_nll_first_m': "the student's mean token log-probability over its first {m} tokens",
    'max_nll_first_m': "the student's minimum token log-probability over its first {m} tokens",
    'probe': 'a logistic probe on prompt features (no student answer)',
}
TIER_WORDS = {'target': 'the target alone (no speculative pair was faster)'}


def _chosen(curve: dict) -> dict:
    return curve['curve'][curve['chosen']]


def _signal(route: dict, signal: str) -> str:
    return SIGNAL_WORDS.get(signal, signal).format(m=route.get('first_m'))


def _tier(route: dict) -> str:
    t = route['tier']
    return TIER_WORDS.get(t['method'], f'{t["method"]} (k = {t["k"]})')


def _threshold(t) -> str:
    return t if isinstance(t, str) else f'{fmt(t)} nats'


def _cell(p: dict, stat: str) -> str:
    return fmt_interval(p[stat], p.get(f'{stat}_interval'))


def _within(route: dict, p: dict) -> str:
    floor, hi = route['quality_floor_nats'], (p.get('quality_cost_interval') or [None, None])[1]
    if p['quality_cost'] > floor:
        return f'held-out cost above the {fmt(floor)}-nat floor'
    if hi is not None and hi > floor:
        return f'held-out cost within the {fmt(floor)}-nat floor, its interval not'
    return f'held-out cost within the {fmt(floor)}-nat floor'


def route_row(d: dict) -> list:
    """The verdict row [option, latency vs target, quality, training CPU s, pays?]."""
    route = d['route']
    signal = route['best_signal']
    chosen = _chosen(route['routers'][signal])
    p = chosen['held_out']
    n_val = route['prompts']['validation']
    latency = (
        f"{_cell(p, 'relative_latency')}x the target alone's time per request (held-out "
        f'prompts, batch 1; {fmt(p["latency_s"] * 1e3)} ms a request), threshold '
        f'{_threshold(chosen["threshold"])} on {_signal(route, signal)}, chosen on {n_val} '
        'validation prompts'
    )
    quality = (
        f"target log-likelihood {_cell(p, 'quality_cost')} nats/token below the target's own "
        f'samples ({_within(route, p)}); greedy agreement {_cell(p, "agreement")}; the student '
        f'kept {_cell(p, "kept_fraction")} of {p["prompts"]} held-out requests'
    )
    lo, hi = p.get('relative_latency_interval') or [p['relative_latency']] * 2
    pays = (
        'faster than the target alone here (95 % interval below 1)'
        if hi < 1
        else 'slower than the target alone here'
        if lo > 1
        else 'indistinguishable from the target alone here (95 %)'
    )
    cascade = route.get('cascade')
    if cascade:
        c = _chosen(cascade)
        pays += (
            f'; speculative cascade ({cascade["rule"]}, k = {cascade["k"]}, {LOSSY}) at lenience '
            f'{fmt(c["lenience"])}: {_cell(c["held_out"], "relative_latency")}x, cost '
            f'{_cell(c["held_out"], "quality_cost")} nats/token'
        )
    cpu = d['run'].get('stage_cpu_seconds', {}).get(route.get('student', 'draft_distilled'))
    option = f'route (the distilled student when confident, else {_tier(route)})'
    return [option, latency, quality, cpu, pays + ' (report section "Routing")']


def section_route(d: dict) -> list[str]:
    """'## Routing and speculative cascades': every signal's chosen point, the cascade's."""
    route = d.get('route')
    if not route:
        return []
    pr, floor = route['prompts'], route['quality_floor_nats']
    out = [
        '## Routing and speculative cascades',
        '',
        f'{pr["count"]} prompts ({pr["validation"]} validation, {pr["held_out"]} held-out), '
        f'{route["max_new_tokens"]} new tokens, batch 1, '
        f'T = {fmt(route["sampling"]["temperature"])}; the target tier is {_tier(route)}. '
        'Thresholds and leniences are chosen on the validation prompts (the fastest point '
        f"within {fmt(floor)} nats/token of the target tier's log-likelihood); every figure "
        "below is the held-out prompts', with 95 % bootstrap intervals. Latency: time per "
        'request against the target alone measured in the same stage. Quality cost: the '
        "target's log-likelihood per token of the target's own samples minus that of the "
        'answers served.',
        '',
    ]
    rows = []
    for signal, curve in route['routers'].items():
        c = _chosen(curve)
        p = c['held_out']
        rows.append(
            [_signal(route, signal), _threshold(c['threshold']), _cell(p, 'relative_latency'),
             _cell(p, 'kept_fraction'), _cell(p, 'quality_cost'), _cell(p, 'agreement')]
        )  # fmt: skip
    for name, p in route['references'].items():
        cells = [_cell(p, 'relative_latency'), fmt(p['kept_fraction'])]
        cells += [_cell(p, 'quality_cost'), _cell(p, 'agreement')]
        rows.append([f'reference: {name}', '-', *cells])
    head = ['router signal', 'threshold', 'latency / target', 'student kept', 'quality cost',
            'greedy agreement']  # fmt: skip
    out += [markdown_table(head, rows), '']
    cascade = route.get('cascade')
    if cascade:
        out += [
            f'Speculative cascade ({cascade["rule"]}, k = {cascade["k"]}): **{LOSSY}**; its '
            'output follows the law pi of specjax.sampling.cascade, not the target\'s. "student '
            'share": the fraction of its tokens that were the student\'s proposals kept at '
            "positions 1..k of a round (a lower bound: a round's last token is not counted).",
            '',
        ]
        rows = [
            [fmt(c['lenience']) + (' (chosen)' if i == cascade['chosen'] else ''),
             _cell(c['held_out'], 'relative_latency'), _cell(c['held_out'], 'kept_fraction'),
             _cell(c['held_out'], 'quality_cost') + f' ({LOSSY})',
             _cell(c['held_out'], 'agreement')]
            for i, c in enumerate(cascade['curve'])
        ]  # fmt: skip
        head = ['lenience a', 'latency / target', 'student share', 'quality cost', 'agreement']
        out += [markdown_table(head, rows), '']
    return out


def _serve_ratios(d: dict) -> dict:
    """{spec method: its batch-1 time per request / the target alone's} from serve."""
    rows = d['serve']['rows']
    b1 = min(r['batch_size'] for r in rows)
    at = {r['method']: r['wall_s'] for r in rows if r['batch_size'] == b1}
    return {m: t / at['target'] for m, t in at.items() if m.startswith('spec_')}


def _errorbar(ax, points: list[dict], **kw):
    x = np.array([p['relative_latency'] for p in points])
    y = np.array([p['quality_cost'] for p in points])
    bars = lambda stat, v: np.abs(
        np.array([p.get(f'{stat}_interval') or [a, a] for p, a in zip(points, v)]).T - v
    )
    ax.errorbar(
        x, y, xerr=bars('relative_latency', x), yerr=bars('quality_cost', y), capsize=2, **kw
    )


def route_quality_vs_latency(d: dict, out_dir: str) -> str | None:
    """route_quality_vs_latency.png, or None without a route stage."""
    route = d.get('route')
    if not route:
        return None
    fig = new_figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    refs = route['references']
    _errorbar(ax, [refs['target']], fmt='ks', label='target alone')
    _errorbar(ax, [refs['student']], fmt='o', color='C3', label='distilled student alone')
    for i, (method, ratio) in enumerate(_serve_ratios(d).items()):
        ax.plot([ratio], [0.0], 'D', color=f'C{4 + i}', label=f'{method} (exact; serve stage)')
    best = route['best_signal']
    for signal, curve in route['routers'].items():
        strong = signal == best
        _errorbar(ax, [c['held_out'] for c in curve['curve']], fmt='o-' if strong else '.:',
                  color='C0', alpha=1.0 if strong else 0.35,
                  label=f'router: {signal}' + (' (best)' if strong else ''))  # fmt: skip
    chosen = _chosen(route['routers'][best])['held_out'] if best else None
    if chosen:
        xy = ([chosen['relative_latency']], [chosen['quality_cost']])
        ax.plot(*xy, 'o', markersize=14, markerfacecolor='none', color='C0',
                label='router: chosen on validation')  # fmt: skip
    if route.get('cascade'):
        cascade = route['cascade']
        _errorbar(ax, [c['held_out'] for c in cascade['curve']], fmt='^-', color='C2',
                  label=f"cascade {cascade['rule']} ({LOSSY})")  # fmt: skip
    ax.axhline(route['quality_floor_nats'], color='gray', ls='--', lw=0.8, label='quality floor')
    ax.set_xlabel('time per request / the target alone (batch 1; held-out, 95 % bootstrap)')
    ax.set_ylabel("quality cost, nats/token below the target's own samples")
    ax.set_title('routing and cascades: quality against latency (lower left is better)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(out_dir, 'route_quality_vs_latency.png')
    fig.savefig(path, dpi=100)
    return path
