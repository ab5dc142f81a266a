"""Uncertainty of the evaluation figures: bootstrap intervals over prompts, timing summaries.

Acceptance figures are ratios of per-row counts summed over prompts (stats: "reduce first,
divide last"), so a bootstrap resample draws prompts (rows) with replacement and recomputes the
ratio of sums. `resample_index` fixes the draws by seed; the same draws applied to two row
tables over the same prompts give a paired interval for a ratio between them (the report's
tau ratio of two drafts on the same prompts).

Timings are repeated passes, interleaved across the points they are compared with
(sampling.calibrate.interleaved_times); `timing_summary` reports their min, median and spread
(max / min), and `ratio_summary` a measured speedup as the median of the per-repeat ratios with
the range over repeats. A point is called faster only when that whole range lies above 1.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy import stats

from specjax.evaluation.tables import human_label

LEVEL = 0.95  # two-sided coverage of every interval
RESAMPLES = 2000
SPREAD_FLAG = 1.5  # max / min of a point's repeats above this: its timings are flagged

# statistic -> (numerator column, denominator column) of a row table (sampling.stats names)
RATIOS = {
    'acceptance_rate': ('accepted', 'examined'),
    'block_efficiency': ('emitted', 'rounds'),
    'alpha': ('alpha_sum', 'alpha_count'),
}


def resample_index(n: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """int [resamples, n]: row indices drawn with replacement (row 0 of the draws: identity)."""
    if n < 1:
        raise ValueError(f'resample_index: need at least one row, got n={n}')
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    idx[0] = np.arange(n)
    return idx


def _percentiles(values: np.ndarray, level: float) -> list[float | None]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return [None, None]
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return [float(lo), float(hi)]


def resampled_ratios(table: Mapping, name: str, idx: np.ndarray) -> np.ndarray:
    """float [resamples]: statistic `name` (RATIOS) of the table's rows under each draw."""
    num_col, den_col = RATIOS[name]
    num = np.asarray(table[num_col], np.float64)[idx].sum(axis=1)
    den = np.asarray(table[den_col], np.float64)[idx].sum(axis=1)
    with np.errstate(divide='ignore', invalid='ignore'):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def ratio_interval(table: Mapping, name: str, seed: int = 0, level: float = LEVEL) -> list:
    """[lo, hi] of statistic `name` (RATIOS) over the table's rows, percentile bootstrap."""
    idx = resample_index(len(np.asarray(table[RATIOS[name][1]])), seed=seed)
    return _percentiles(resampled_ratios(table, name, idx), level)


def table_intervals(table: Mapping, seed: int = 0, level: float = LEVEL) -> dict:
    """{statistic: [lo, hi]} for each RATIOS statistic the row table has the columns of, and
    'acceptance_per_position_conditional': [[lo, hi]] per draft position (None where no row
    reached it); percentile bootstrap over rows."""
    n = len(np.asarray(table['rounds']))
    idx = resample_index(n, seed=seed)
    out = {
        name: _percentiles(resampled_ratios(table, name, idx), level)
        for name, (a, b) in RATIOS.items()
        if a in table and b in table
    }
    acc = np.asarray(table['accepted_per_position'], np.float64)  # [n, k]
    exa = np.asarray(table['examined_per_position'], np.float64)
    per_pos = []
    for i in range(acc.shape[1] if acc.ndim == 2 else 0):
        num, den = acc[idx, i].sum(axis=1), exa[idx, i].sum(axis=1)
        with np.errstate(divide='ignore', invalid='ignore'):
            per_pos.append(_percentiles(np.where(den > 0, num / den, np.nan), level))
    out['acceptance_per_position_conditional'] = per_pos
    return out


def paired_ratio_interval(
    table_a: Mapping, table_b: Mapping, name: str, seed: int = 0, level: float = LEVEL
) -> dict:
    """{'value', 'interval'} of statistic(b) / statistic(a) over the same prompts (rows in the
    same order in both tables), bootstrapped with the same draws for both; ValueError if the
    tables have different row counts."""
    n_a, n_b = len(np.asarray(table_a['rounds'])), len(np.asarray(table_b['rounds']))
    if n_a != n_b:
        raise ValueError(f'paired_ratio_interval: {n_a} rows against {n_b}: not the same prompts')
    idx = resample_index(n_a, seed=seed)
    with np.errstate(divide='ignore', invalid='ignore'):
        ratio = resampled_ratios(table_b, name, idx) / resampled_ratios(table_a, name, idx)
    return {'value': float(ratio[0]), 'interval': _percentiles(ratio, level)}


def timing_summary(seconds) -> dict:
    """Repeated timings of one point: min, median, max / min spread, repeats, and a flag."""
    t = np.asarray(seconds, np.float64)
    spread = float(t.max() / t.min()) if t.size and t.min() > 0 else float('nan')
    return {
        'repeats': int(t.size),
        'min_s': float(t.min()),
        'median_s': float(np.median(t)),
        'spread': spread,
        'noisy': bool(not np.isfinite(spread) or spread > SPREAD_FLAG),
    }


def ratio_summary(baseline_s, point_s) -> dict:
    """Measured speedup baseline / point from interleaved repeats (the i-th of each measured in
    the same round): median of the per-repeat ratios, their range, with 3 or more repeats a 95 %
    interval of the ratio (Student's t over the repeats' log ratios: each repeat's pair ran in
    one round, so drift cancels within a pair), and the verdict 'faster' / 'slower' when that
    interval (with fewer repeats: the whole range) lies above / below 1, else 'indistinguishable'
    (at 95 %)."""
    ratios = np.asarray(baseline_s, np.float64) / np.asarray(point_s, np.float64)
    lo, hi = float(ratios.min()), float(ratios.max())
    interval = None
    if len(ratios) >= 3:
        logs = np.log(ratios)
        half = float(stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs)))
        interval = [float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))]
    a, b = interval or (lo, hi)
    verdict = 'faster' if a > 1 else 'slower' if b < 1 else 'indistinguishable'
    return {
        'value': float(np.median(ratios)),
        'range': [lo, hi],
        'interval': interval,
        'repeats': ratios.tolist(),
        'verdict': verdict,
    }


PREDICTION_BAND = (2 / 3, 1.5)  # measured / predicted speedup outside this: flagged


def flags(calibration: Mapping, runs: list[dict]) -> list[str]:
    """What a reader must not take at face value, one sentence each: a verification cost v(k)
    that falls as k grows (calibration noise: every prediction built on it is suspect), a
    measured / predicted speedup outside PREDICTION_BAND, a point whose repeats spread more
    than SPREAD_FLAG."""
    out = []
    v = sorted((int(k), float(x)) for k, x in calibration.get('v', {}).items())
    for (k0, v0), (k1, v1) in zip(v, v[1:]):
        if v1 < v0:
            out.append(
                f'v(k) falls from v({k0}) = {v0:.3g} to v({k1}) = {v1:.3g}: verifying more '
                'tokens cannot cost less, so the calibration is noise-dominated and the '
                'predicted speedups and optimal k built on it are unreliable'
            )
    lo, hi = PREDICTION_BAND
    missed, noisy = [], []
    for r in runs:
        point = 'AR' if r.get('k') is None else f'k = {r["k"]}'
        where = f'{human_label(r.get("sampling_label", ""))} {point}'
        ratio = r.get('speedup_ratio')
        if ratio is not None and np.isfinite(ratio) and not lo <= ratio <= hi:
            missed.append((ratio, where))
        timing = r.get('timing') or {}
        if timing.get('noisy'):
            noisy.append((timing['spread'], where))
    n_spec = sum(r.get('speedup_ratio') is not None for r in runs)
    if missed:
        ratios = [x for x, _ in missed]
        out.append(
            f'measured speedup is {min(ratios):.2g}-{max(ratios):.2g}x the predicted at '
            f'{len(missed)} of {n_spec} points ({"; ".join(w for _, w in missed)}): the '
            'round-cost model k c + v(k) misses costs here, so predictions overstate or '
            'understate'
        )
    if noisy:
        out.append(
            f'timing repeats spread more than {SPREAD_FLAG:g}x (max / min) at {len(noisy)} '
            f'points ({"; ".join(f"{w} {x:.2g}x" for x, w in noisy)}): the machine was shared; '
            'compare ratios measured in the same round only'
        )
    return out
