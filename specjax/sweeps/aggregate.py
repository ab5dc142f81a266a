"""Sweep results -> means and bootstrap intervals over seeds -> summary.{md,csv,json}.

Interval: percentile bootstrap of the mean over a configuration's seeds (resample the n seed values
with replacement `resamples` times from np.random.default_rng(seed), take the mean of each
resample, report the (1 - confidence)/2 and (1 + confidence)/2 percentiles). Undefined (NaN) for
fewer than 2 seeds. With 3 seeds there are only 10 distinct resamples, so the interval is close
to [min, max] of the seed values: treat it as a spread, not a calibrated 95% interval.

Verdict per metric: the best configuration is the one with the best mean (higher or lower,
per metric). It is the *winner* when its interval overlaps no other configuration's interval
(closed intervals; this includes the runner-up, and also catches a lower-mean point whose wide
interval reaches past the best). Otherwise: "no clear winner", listing the overlapping points.
If any configuration with data has fewer than 2 seeds there is no interval and no verdict.
summary.md is rendered by specjax.sweeps.summary_markdown.
"""

from __future__ import annotations

import csv
import json
import math
import os

import numpy as np

from specjax.sweeps.spec import RESULTS_FILE, point_dir, read_status, sha256_file
from specjax.sweeps.summary_markdown import markdown


def bootstrap_ci(values, *, confidence=0.95, resamples=2000, seed=0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of `values` [n]; (nan, nan) for n < 2."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f'values must be 1-D, got shape {x.shape}')
    if x.size < 2:
        return math.nan, math.nan
    if not 0 < confidence < 1:
        raise ValueError(f'confidence must be in (0, 1), got {confidence!r}')
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def verdict(stats: dict[str, dict], higher_is_better: bool) -> dict:
    """stats: label -> {'mean', 'lo', 'hi', 'n'}; returns best, kind and overlapping labels."""
    rows = {k: s for k, s in stats.items() if s['n'] > 0 and math.isfinite(s['mean'])}
    if not rows:
        return {'best': None, 'kind': 'no data', 'overlaps': [], 'text': 'no data'}
    sign = 1 if higher_is_better else -1
    best = max(rows, key=lambda k: sign * rows[k]['mean'])
    if len(rows) == 1:
        return {'best': best, 'kind': 'only point', 'overlaps': [], 'text': f'only {best}'}
    few = sorted(k for k, s in rows.items() if s['n'] < 2)
    if few:
        text = f'no interval ({len(few)} of {len(rows)} points have < 2 seeds); best mean: {best}'
        return {'best': best, 'kind': 'no interval', 'overlaps': [], 'text': text}
    b = rows[best]
    overlaps = [
        k for k, s in rows.items() if k != best and s['lo'] <= b['hi'] and b['lo'] <= s['hi']
    ]
    overlaps.sort(key=lambda k: -sign * rows[k]['mean'])
    if overlaps:
        text = f'no clear winner (best mean {best} overlaps {", ".join(overlaps)})'
        return {'best': best, 'kind': 'no clear winner', 'overlaps': overlaps, 'text': text}
    return {'best': best, 'kind': 'winner', 'overlaps': [], 'text': f'winner: {best}'}


def lookup(results: dict, key: str):
    """results['a']['b'] for key 'a.b' (or results['a.b']); None if absent, not a number or NaN."""
    node = results
    if key in node:
        node = node[key]
    else:
        for part in key.split('.'):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
    if isinstance(node, bool) or not isinstance(node, int | float) or not math.isfinite(node):
        return None
    return float(node)


def numeric_keys(results: dict, prefix: str = '') -> list[str]:
    """Dotted keys of every number in `results` (the recorded top-level 'config' excluded)."""
    keys = []
    for k, v in results.items():
        if not prefix and k == 'config':
            continue
        if isinstance(v, dict):
            keys += numeric_keys(v, f'{prefix}{k}.')
        elif isinstance(v, int | float) and not isinstance(v, bool):
            keys.append(prefix + k)
    return keys


def collect(plan, sweep) -> dict:
    """Reads every point's status and results.json; computes the summary dict."""
    points, results = [], {}
    for run in plan.points:
        entry, found = _point(plan, run)
        if found is not None:
            results[run.name] = found
        points.append(entry)

    metrics = list(sweep.metrics) or sorted({k for r in results.values() for k in numeric_keys(r)})
    guessed = set() if sweep.metrics else {m for m in metrics if 'loss' in m}
    minimize = set(sweep.minimize) | guessed
    configurations = [
        _configuration(plan, sweep, label, metrics, results, points) for label in plan.labels
    ]
    verdicts = []
    for m in metrics:
        higher = m not in minimize
        v = verdict({c['label']: c['metrics'][m] for c in configurations}, higher)
        verdicts.append({'metric': m, 'better': 'higher' if higher else 'lower', **v})
    return {
        'workdir': plan.workdir,
        'base': plan.base.flag,
        'grid_fields': list(plan.grid_fields),
        'seeds': sorted({r.seed for r in plan.points}),
        'interval': {
            'method': 'percentile bootstrap of the mean over seeds',
            'confidence': sweep.confidence,
            'resamples': sweep.bootstrap_resamples,
            'rng_seed': sweep.bootstrap_seed,
        },
        'metrics': verdicts,
        'configurations': configurations,
        'points': points,
        'prereqs': [_prereq(plan, run, metrics) for run in plan.prereqs],
    }


def _point(plan, run) -> tuple[dict, dict | None]:
    """A point's summary entry (status, seconds, results path and sha256, error and log) and
    its results.json (None unless the point is complete)."""
    wd = point_dir(plan, run)
    rel = os.path.relpath(os.path.join(wd, RESULTS_FILE), plan.workdir)
    status = read_status(wd) or {}
    entry = {
        'name': run.name,
        'label': run.label,
        'seed': run.seed,
        'status': status.get('status', 'not run'),
        'results': rel,
        'duration_s': status.get('duration_s'),
        'cpu_s': status.get('cpu_s'),
    }
    path = os.path.join(wd, RESULTS_FILE)
    if entry['status'] == 'complete' and not os.path.isfile(path):
        entry['status'] = 'results.json missing'
    results = None
    if entry['status'] == 'complete':
        with open(path) as f:
            results = json.load(f)
        entry['results_sha256'] = sha256_file(path)
        if entry['results_sha256'] != status.get('results_sha256'):
            entry['warning'] = 'results.json changed after the point finished'
    elif 'error' in status:
        entry['error'] = status['error']
        entry['log'] = os.path.relpath(os.path.join(wd, status.get('log', '')), plan.workdir)
    return entry, results


def _configuration(plan, sweep, label: str, metrics, results: dict, points: list) -> dict:
    """One configuration (grid point over seeds): its fields and, per metric, the mean, the
    bootstrap interval and the values with their seeds."""
    runs = [r for r in plan.points if r.label == label]
    done = [r for r in runs if r.name in results]
    stats = {}
    for m in metrics:
        pairs = [(r.seed, lookup(results[r.name], m)) for r in done]
        pairs = [(s, v) for s, v in pairs if v is not None]
        values = [v for _, v in pairs]
        lo, hi = bootstrap_ci(
            values,
            confidence=sweep.confidence,
            resamples=sweep.bootstrap_resamples,
            seed=sweep.bootstrap_seed,
        )
        mean = float(np.mean(values)) if values else math.nan
        stats[m] = {
            'mean': mean,
            'lo': lo,
            'hi': hi,
            'n': len(values),
            'values': values,
            'seeds': [s for s, _ in pairs],
        }
    return {
        'label': label,
        'fields': {k: v for k, v in runs[0].fields},
        'variant': label in plan.variants,
        'n_complete': len(done),
        'n_points': len(runs),
        'metrics': stats,
        'sources': [p['results'] for p in points if p['label'] == label and p['name'] in results],
    }


def _prereq(plan, run, metrics) -> dict:
    """A prerequisite's status, wall and CPU seconds, and the summary metrics its results.json
    holds (e.g. train_flops of a pretrained target: the compute a distilled draft builds on)."""
    wd = point_dir(plan, run)
    status = read_status(wd) or {}
    entry = {
        'name': run.name,
        'status': status.get('status', 'not run'),
        'duration_s': status.get('duration_s'),
        'cpu_s': status.get('cpu_s'),
        'metrics': {},
    }
    path = os.path.join(wd, RESULTS_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            results = json.load(f)
        entry['results'] = os.path.relpath(path, plan.workdir)
        found = {m: lookup(results, m) for m in metrics}
        entry['metrics'] = {m: v for m, v in found.items() if v is not None}
    return entry


def write_csv(summary: dict, path: str) -> None:
    """One row per configuration: fields, seeds done, then mean/lo/hi/n per metric."""
    names = [m['metric'] for m in summary['metrics']]
    fields = summary['grid_fields']
    with open(path, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(
            [
                'point',
                *fields,
                'n_complete',
                'n_points',
                *[f'{m}_{s}' for m in names for s in ('mean', 'lo', 'hi', 'n')],
            ]
        )
        for c in summary['configurations']:
            stats = [c['metrics'][m][s] for m in names for s in ('mean', 'lo', 'hi', 'n')]
            w.writerow(
                [
                    c['label'],
                    *[c['fields'].get(k, '') for k in fields],
                    c['n_complete'],
                    c['n_points'],
                    *stats,
                ]
            )


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def write_summary(plan, sweep) -> dict:
    """Writes <workdir>/summary.{md,csv,json}; returns the summary dict."""
    summary = collect(plan, sweep)
    base = os.path.join(plan.workdir, 'summary')
    with open(base + '.json', 'w') as f:
        json.dump(_json_safe(summary), f, indent=1)
        f.write('\n')
    write_csv(summary, base + '.csv')
    with open(base + '.md', 'w') as f:
        f.write(markdown(summary))
    return summary
