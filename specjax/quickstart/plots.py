"""The quickstart report's PNGs, drawn from the dict of stage JSON that report_data.load reads.

quality_vs_latency.png      held-out loss against time per token (batch 1, serve) of the target,
                            the drafts served alone and the speculative pairs: the question's
                            answer in one picture (lower left is better), the bigram as a line
route_quality_vs_latency.png
                            with a route stage: quality cost against latency relative to the
                            target of the router's and the cascade's curves (report_route)
acceptance_by_position.png  conditional acceptance at each draft position, per draft, with
                            bootstrap intervals and the examined counts
speedup_vs_k.png            measured speedup (median, bars: range over repeats) beside the
                            predicted tau / (k c + v(k)) at the measured k only, chosen k circled
alpha_over_steps.png        alpha_T1 (solid) and alpha_T0 (dashed) over each draft's own steps,
                            with the number of held-out positions
acceptance_by_temperature_domain.png
                            acceptance at the reference k per sampling setting (bootstrap
                            intervals) and per domain (prompt counts)
Figures come from plots.new_figure (no pyplot, no backend selected).
"""

from __future__ import annotations

import os

import numpy as np

from specjax.evaluation.tables import human_label
from specjax.quickstart import report_data as qr
from specjax.quickstart.report_route import route_quality_vs_latency
from specjax.sweeps.plots import new_figure

_MAIN = ('T=0', 'T=1,top_k=0,top_p=1')


def _save(fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    return path


def _floats(values) -> np.ndarray:
    """float64 array of JSON numbers, None (a NaN the JSON wrote as null) as NaN."""
    return np.array([np.nan if x is None else x for x in values], np.float64)


def _yerr(values, intervals) -> np.ndarray:
    """[2, n] asymmetric error bars from [lo, hi] intervals (0 where an interval is missing)."""
    v = _floats(values)
    lo = np.array([np.nan if not i or i[0] is None else i[0] for i in intervals], np.float64)
    hi = np.array([np.nan if not i or i[1] is None else i[1] for i in intervals], np.float64)
    return np.nan_to_num(np.stack([v - lo, hi - v]).clip(min=0.0))


def acceptance_by_position(d: dict, out_dir: str) -> str:
    fig = new_figure(figsize=(10, 4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, label in zip(axes, _MAIN):
        for i, (stage, (name, _)) in enumerate(qr.pairs(d).items()):
            runs = qr.spec_runs(d[stage], label)
            if not runs:
                continue
            r = runs[-1]
            acc = _floats(r['acceptance_per_position_conditional'])  # None: never examined
            pos = np.arange(1, len(acc) + 1) + 0.06 * (i - 1)
            bars = (r.get('intervals') or {}).get('acceptance_per_position_conditional') or []
            ax.errorbar(
                pos,
                acc,
                yerr=_yerr(acc, bars or [None] * len(acc)),
                fmt='o-',
                capsize=3,
                label=f'{name} (k={r["k"]})',
            )
            for x, y, (_, examined) in zip(pos, acc, qr.position_counts(r)):
                ax.annotate(
                    f'n={examined}', (x, y), fontsize=6, xytext=(3, 3), textcoords='offset points'
                )
        ax.set_title(f'acceptance per position, {human_label(label)}')
        ax.set_xlabel('draft position i (bars: 95% bootstrap over prompts; n examined)')
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('P(accept at i | i examined)')
    axes[0].legend(fontsize=8)
    return _save(fig, out_dir, 'acceptance_by_position.png')


def speedup_vs_k(d: dict, out_dir: str) -> str:
    fig = new_figure(figsize=(10, 4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, label in zip(axes, _MAIN):
        for i, (stage, (name, _)) in enumerate(qr.pairs(d).items()):
            spec = d[stage]
            runs = qr.spec_runs(spec, label)
            if not runs:
                continue
            color = f'C{i}'
            pred = spec['optimal_k'][label]['predicted_speedups']
            ks = [r['k'] for r in runs]  # predictions only where measured
            ax.plot(ks, [pred[str(k)] for k in ks], 'x--', color=color, alpha=0.6,
                    label=f'{name}: predicted')  # fmt: skip
            measured = [r['measured_speedup'] for r in runs]
            ranges = [(r.get('speedup') or {}).get('range') for r in runs]
            ax.errorbar(ks, measured, yerr=_yerr(measured, ranges), fmt='o', color=color,
                        capsize=3, label=f'{name}: measured')  # fmt: skip
            best = spec['optimal_k'][label]['best_measured_k']
            chosen = next(r for r in runs if r['k'] == best)
            ax.plot([best], [chosen['measured_speedup']], 'o', markersize=14,
                    markerfacecolor='none', color=color)  # fmt: skip
        ax.axhline(1.0, color='gray', lw=0.8)
        ax.set_title(f'speedup vs k, {human_label(label)} (circle: best measured k)')
        ax.set_xlabel('k (draft tokens per round); bars: range over timing repeats')
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('speedup over the target alone')
    axes[0].legend(fontsize=7)
    return _save(fig, out_dir, 'speedup_vs_k.png')


def _own_steps(d: dict, stage: str, rows: list[dict]) -> list[int]:
    """Each draft's own training steps: co-training logs the target's step numbers and starts
    its fresh draft at the target's init step, so its draft has taken step - init steps."""
    start = 0
    if stage == 'cotrain':
        start = max(0, int(d['cotrain'].get('config', {}).get('init', {}).get('target_step', 0)))
    return [r['step'] - start for r in rows]


def alpha_over_steps(d: dict, out_dir: str) -> str:
    fig = new_figure(figsize=(7, 4))
    ax = fig.subplots()
    names = {stage: name for name, stage in qr.PAIRS.values()}
    for i, stage in enumerate(('draft_ce', 'draft_distilled', 'cotrain')):
        rows = d['curves'].get(stage)
        if not rows:
            continue
        steps, name = _own_steps(d, stage, rows), names[stage]
        ax.plot(steps, [r['alpha_T1'] for r in rows], 'o-', color=f'C{i}', label=f'{name} T = 1')
        ax.plot(steps, [r['alpha_T0'] for r in rows], 'o--', color=f'C{i}', label=f'{name} T = 0')
    ax.set_xlabel("the draft's own training step")
    n = d['target'].get('eval', {}).get('targets')  # the drafts are evaluated on the same tokens
    count = f', {int(n)} positions' if n else ''
    ax.set_ylabel(f'alpha (held-out{count}, vs its target)')
    ax.set_title('alpha over training steps')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, 'alpha_over_steps.png')


def acceptance_by_temperature_domain(d: dict, out_dir: str) -> str:
    fig = new_figure(figsize=(11, 4))
    axes = fig.subplots(1, 2, sharey=True)
    k = qr.ref_k(d['spec_distilled'])
    pairs = list(qr.pairs(d).items())
    width = 0.8 / len(pairs)
    labels = qr.labels(d['spec_distilled'])
    for i, (stage, (name, _)) in enumerate(pairs):
        runs = [qr.run_at(d[stage], lab, k) for lab in labels if qr.has_run(d[stage], lab, k)]
        if len(runs) < len(labels):  # a pair evaluated at other ks (its own grid)
            continue
        vals = [r['acceptance_rate'] for r in runs]
        bars = _yerr(vals, [qr.interval(r, 'acceptance_rate') for r in runs])
        x = np.arange(len(labels)) + (i - (len(pairs) - 1) / 2) * width
        axes[0].bar(x, vals, width, yerr=bars, capsize=2, label=name)
    axes[0].set_xticks(range(len(labels)))
    axes[0].set_xticklabels([human_label(lab) for lab in labels], rotation=15, fontsize=7)
    axes[0].set_title(f'acceptance by sampling (k={k}; bars: 95% bootstrap)')
    groups, counts = [], {}
    for stage, _ in pairs:
        for b in d[stage]['buckets']['domain']:
            if b['k'] == k:
                groups.append((b['domain'], b['sampling_label']))
                counts[groups[-1]] = b['rows']
    groups = [g for g in dict.fromkeys(groups) if g[1] in _MAIN]
    for i, (stage, (name, _)) in enumerate(pairs):
        by = {
            (b['domain'], b['sampling_label']): b['acceptance_rate']
            for b in d[stage]['buckets']['domain']
            if b['k'] == k
        }
        axes[1].bar(
            np.arange(len(groups)) + (i - (len(pairs) - 1) / 2) * width,
            [by.get(g, np.nan) for g in groups],
            width,
            label=name,
        )
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels(
        [f'{g[0]} (n={counts[g]})\n{human_label(g[1])}' for g in groups], fontsize=7
    )
    axes[1].set_title(f'acceptance by domain (k={k})')
    axes[0].set_ylabel('acceptance rate')
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis='y')
    return _save(fig, out_dir, 'acceptance_by_temperature_domain.png')


def quality_vs_latency(d: dict, out_dir: str) -> str:
    """Held-out loss (nats) against ms per token at batch 1 (serve stage): the target, each
    draft served alone and each speculative pair (the target's output, hence its loss). Bars:
    min..max over the serve pass's timing repeats, scaled to the row's time per token."""
    sv = d['serve']
    b1 = min(r['batch_size'] for r in sv['rows'])
    target_loss = d['target']['eval']['loss']
    loss = {
        'target': target_loss,
        'draft_ce': d['draft_ce']['draft_val_loss'],
        'draft_distilled': d['draft_distilled']['draft_val_loss'],
        'spec_ce': target_loss,
        'spec_distilled': target_loss,
    }
    fig = new_figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, (method, y) in enumerate(loss.items()):
        r = next((r for r in sv['rows'] if r['method'] == method and r['batch_size'] == b1), None)
        if r is None:
            continue
        x = 1e3 * r['tpot_s']
        t = r.get('timing') or {}
        # the pass's repeats (min, median, max / min) scaled to this row's per-token time
        spread = t.get('spread', np.nan)
        lo = x * t['min_s'] / t['median_s'] if t.get('median_s') else x
        hi = lo * spread if np.isfinite(spread) else x
        xerr = [[max(x - lo, 0.0)], [max(hi - x, 0.0)]]  # >= 0 through float rounding
        marker = 's' if method.startswith('spec') else 'o'
        ax.errorbar([x], [y], xerr=xerr, fmt=marker, color=f'C{i}', capsize=3,
                    label=qr.SERVE_NAMES[method])  # fmt: skip
    bigram = d['target'].get('baselines', {}).get('bigram')
    if bigram is not None:
        ax.axhline(bigram, color='gray', ls=':', lw=1, label='count-bigram baseline')
    ax.set_xlabel(f'ms per output token (batch {b1}, greedy; bars: repeat spread)')
    ax.set_ylabel("held-out loss, nats (speculative = the target's)")
    ax.set_title('quality against latency (lower left is better)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir, 'quality_vs_latency.png')


PLOTS = (
    quality_vs_latency,
    route_quality_vs_latency,  # None without a route stage
    acceptance_by_position,
    speedup_vs_k,
    alpha_over_steps,
    acceptance_by_temperature_domain,
)


def write_all(d: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    return [path for path in (plot(d, out_dir) for plot in PLOTS) if path]
