"""Sweep summary -> one PNG per metric: mean per point with its bootstrap interval as error bar.

With two grid fields the points are grouped like the paper tables: the second field along x, one
marker series per value of the first, variants (e.g. a baseline) as a final group. Otherwise one
marker per point. Reads only the summary dict.

Figures are matplotlib `Figure`s made without pyplot (`new_figure`): saving one needs no backend
and selects none, so a notebook's inline plots keep working after specjax has drawn a PNG.
"""

from __future__ import annotations

import math
import os
import re
import textwrap


def new_figure(**kwargs):
    """A matplotlib Figure outside pyplot (savefig picks Agg for PNGs; the session's backend is
    left alone). ImportError saying how to install matplotlib when it is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            'specjax draws its plots with matplotlib, which is not installed: pip install '
            "matplotlib (or pip install -e '.' to get specjax's dependencies)"
        ) from e
    return Figure(**kwargs)


def _errors(stats: list[dict]) -> tuple[list, list, list]:
    """means, and lower/upper error bar lengths (0 where there is no interval)."""
    means, lower, upper = [], [], []
    for s in stats:
        m = s['mean'] if s['n'] else math.nan
        ok = s['n'] >= 2 and math.isfinite(s['lo'])
        means.append(m)
        lower.append(m - s['lo'] if ok else 0.0)
        upper.append(s['hi'] - m if ok else 0.0)
    return means, lower, upper


def _grouped(ax, summary: dict, metric: str) -> None:
    f1, f2 = summary['grid_fields']
    confs = summary['configurations']
    grid = [c for c in confs if not c['variant']]
    extra = [c for c in confs if c not in grid]
    series = list(dict.fromkeys(c['fields'][f1] for c in grid))
    groups = list(dict.fromkeys(c['fields'][f2] for c in grid))
    width = 0.8 / max(len(series), 1)
    for i, value in enumerate(series):
        xs, stats = [], []
        for j, g in enumerate(groups):
            for c in grid:
                if c['fields'][f1] == value and c['fields'][f2] == g:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    stats.append(c['metrics'][metric])
        means, lo, hi = _errors(stats)
        ax.errorbar(
            xs, means, yerr=[lo, hi], fmt='o', capsize=3, label=f'{f1.split(".")[-1]}={value}'
        )
    for k, c in enumerate(extra):
        means, lo, hi = _errors([c['metrics'][metric]])
        ax.errorbar(
            [len(groups) + k],
            means,
            yerr=[lo, hi],
            fmt='s',
            color='black',
            capsize=3,
            label=c['label'],
        )
    ax.set_xticks(range(len(groups) + len(extra)))
    ax.set_xticklabels([str(g) for g in groups] + [c['label'] for c in extra], rotation=20)
    ax.set_xlabel(f2.split('.')[-1])
    ax.legend(fontsize=7, ncol=2)


def _flat(ax, summary: dict, metric: str) -> None:
    confs = summary['configurations']
    means, lo, hi = _errors([c['metrics'][metric] for c in confs])
    ax.errorbar(range(len(confs)), means, yerr=[lo, hi], fmt='o', capsize=3)
    ax.set_xticks(range(len(confs)))
    ax.set_xticklabels([c['label'] for c in confs], rotation=60, ha='right', fontsize=7)


def write_plots(summary: dict, out_dir: str, metrics=()) -> list[str]:
    """Writes <out_dir>/<metric>.png for each metric with data (default: all in the summary)."""
    known = {m['metric']: m for m in summary['metrics']}
    missing = [m for m in metrics if m not in known]
    if missing:
        print(f'[sweep] no data yet for plot_metrics {missing}: not plotted', flush=True)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name in [m for m in metrics if m in known] or ([] if metrics else list(known)):
        info = known[name]
        fig = new_figure(figsize=(8, 4.5))
        ax = fig.subplots()
        if len(summary['grid_fields']) == 2:
            _grouped(ax, summary, name)
        else:
            _flat(ax, summary, name)
        pct = f'{summary["interval"]["confidence"]:.0%}'
        ax.set_ylabel(f'{name} (mean, {pct} bootstrap CI)')
        ax.set_title(textwrap.fill(f'{name}: {info["text"]}', 110), fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, re.sub(r'[^A-Za-z0-9_.-]', '_', name) + '.png')
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
