"""The quickstart report's PNGs, drawn from the dict of stage JSON that report_data.load reads.

acceptance_by_position.png  conditional acceptance at each draft position, per draft
speedup_vs_k.png            measured speedup (points) on the predicted tau / (k c + v(k)) curve
                            from alpha, chosen (best measured) k circled, T = 0 and T = 1
alpha_over_steps.png        alpha_T1 (solid) and alpha_T0 (dashed) over training, per draft
acceptance_by_temperature_domain.png
                            acceptance at the reference k per sampling setting and per domain
Figures come from plots.new_figure (no pyplot, no backend selected).
"""

from __future__ import annotations

import os

import numpy as np

from specjax.quickstart import report_data as qr
from specjax.sweeps.plots import new_figure

_MAIN = ('T=0', 'T=1,top_k=0,top_p=1')


def _save(fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    return path


def acceptance_by_position(d: dict, out_dir: str) -> str:
    fig = new_figure(figsize=(10, 4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, label in zip(axes, _MAIN):
        for stage, (name, _) in qr.pairs(d).items():
            runs = qr.spec_runs(d[stage], label)
            if not runs:
                continue
            r = runs[-1]
            acc = r['acceptance_per_position_conditional']
            ax.plot(range(1, len(acc) + 1), acc, 'o-', label=f'{name} (k={r["k"]})')
        ax.set_title(f'acceptance per position, {label}')
        ax.set_xlabel('draft position i')
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
            ks = sorted(int(k) for k in pred)
            ax.plot(
                ks,
                [pred[str(k)] for k in ks],
                '-',
                color=color,
                alpha=0.6,
                label=f'{name}: predicted',
            )
            ax.plot(
                [r['k'] for r in runs],
                [r['measured_speedup'] for r in runs],
                'o',
                color=color,
                label=f'{name}: measured',
            )
            best = spec['optimal_k'][label]['best_measured_k']
            chosen = next(r for r in runs if r['k'] == best)
            ax.plot(
                [best],
                [chosen['measured_speedup']],
                'o',
                markersize=14,
                markerfacecolor='none',
                color=color,
            )
        ax.axhline(1.0, color='gray', lw=0.8)
        ax.set_title(f'speedup vs k, {label} (circle: chosen k)')
        ax.set_xlabel('k (draft tokens per round)')
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('speedup over autoregressive')
    axes[0].legend(fontsize=7)
    return _save(fig, out_dir, 'speedup_vs_k.png')


def alpha_over_steps(d: dict, out_dir: str) -> str:
    fig = new_figure(figsize=(7, 4))
    ax = fig.subplots()
    for i, stage in enumerate(('draft_ce', 'draft_distilled', 'cotrain')):
        rows = d['curves'].get(stage)
        if not rows:
            continue
        steps = [r['step'] for r in rows]
        ax.plot(steps, [r['alpha_T1'] for r in rows], 'o-', color=f'C{i}', label=f'{stage} T=1')
        ax.plot(steps, [r['alpha_T0'] for r in rows], 'o--', color=f'C{i}', label=f'{stage} T=0')
    ax.set_xlabel('training step')
    ax.set_ylabel('alpha (held-out, vs its target)')
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
        vals = [qr.run_at(d[stage], lab, k)['acceptance_rate'] for lab in labels]
        axes[0].bar(
            np.arange(len(labels)) + (i - (len(pairs) - 1) / 2) * width, vals, width, label=name
        )
    axes[0].set_xticks(range(len(labels)))
    axes[0].set_xticklabels(labels, rotation=15, fontsize=7)
    axes[0].set_title(f'acceptance by sampling (k={k})')
    groups = []
    for stage, _ in pairs:
        for b in d[stage]['buckets']['domain']:
            if b['k'] == k:
                groups.append((b['domain'], b['sampling_label']))
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
    axes[1].set_xticklabels([f'{g[0]}\n{g[1]}' for g in groups], fontsize=7)
    axes[1].set_title(f'acceptance by domain (k={k})')
    axes[0].set_ylabel('acceptance rate')
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis='y')
    return _save(fig, out_dir, 'acceptance_by_temperature_domain.png')


PLOTS = (acceptance_by_position, speedup_vs_k, alpha_over_steps, acceptance_by_temperature_domain)


def write_all(d: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    return [plot(d, out_dir) for plot in PLOTS]
