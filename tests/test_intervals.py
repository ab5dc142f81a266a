"""Bootstrap intervals, timing summaries and flags of specjax.evaluation.intervals."""

import numpy as np

from specjax.evaluation import intervals


def _table(accepted, examined):
    n = len(accepted)
    return {
        'accepted': np.asarray(accepted),
        'examined': np.asarray(examined),
        'emitted': np.asarray(accepted) + 1,
        'rounds': np.ones(n, np.int64),
        'accepted_per_position': np.asarray(accepted)[:, None],
        'examined_per_position': np.asarray(examined)[:, None],
    }


def test_bootstrap_of_bernoulli_rows_covers_and_matches_the_binomial_width():
    # 400 prompts, each one Bernoulli(0.3) trial: the ratio-of-sums interval is the proportion's,
    # whose 95% half-width is 1.96 sqrt(p (1 - p) / n) = 0.0449.
    rng = np.random.default_rng(0)
    acc = (rng.random(400) < 0.3).astype(np.int64)
    lo, hi = intervals.ratio_interval(_table(acc, np.ones(400, np.int64)), 'acceptance_rate')
    p = acc.mean()
    assert lo < p < hi
    assert abs((hi - lo) / 2 - 1.96 * np.sqrt(p * (1 - p) / 400)) < 0.01


def test_bootstrap_coverage_near_nominal_over_repeated_experiments():
    rng = np.random.default_rng(1)
    covered = 0
    for trial in range(100):
        acc = rng.binomial(10, 0.6, size=60)
        lo, hi = intervals.ratio_interval(
            _table(acc, np.full(60, 10)), 'acceptance_rate', seed=trial
        )
        covered += lo <= 0.6 <= hi
    assert 85 <= covered <= 100  # nominal 95; binomial spread over 100 trials is about 2


def test_identical_rows_give_a_point_interval_and_paired_ratio_of_one():
    t = _table(np.full(8, 3), np.full(8, 4))
    out = intervals.table_intervals(t)
    assert out['acceptance_rate'] == [0.75, 0.75]
    assert out['acceptance_per_position_conditional'] == [[0.75, 0.75]]
    paired = intervals.paired_ratio_interval(t, t, 'block_efficiency')
    assert paired['value'] == 1.0 and paired['interval'] == [1.0, 1.0]


def test_ratio_summary_calls_faster_only_when_the_range_excludes_one():
    assert intervals.ratio_summary([2.0, 2.1, 2.2], [1.0, 1.0, 1.0])['verdict'] == 'faster'
    assert intervals.ratio_summary([1.0, 1.0], [2.0, 1.5])['verdict'] == 'slower'
    s = intervals.ratio_summary([1.2, 0.9, 1.1], [1.0, 1.0, 1.0])
    assert s['verdict'] == 'unresolved' and s['range'] == [0.9, 1.2]


def test_flags_a_falling_v_a_missed_prediction_and_noisy_timings():
    cal = {'v': {'1': 1.46, '2': 1.25, '3': 1.13}}
    runs = [
        dict(sampling_label='T=0', k=None, timing=intervals.timing_summary([0.069, 0.184, 0.16])),
        dict(
            sampling_label='T=0',
            k=1,
            speedup_ratio=0.5,
            measured_speedup=0.56,
            predicted_speedup=1.12,
            timing=intervals.timing_summary([1.0, 1.1]),
        ),
    ]
    out = intervals.flags(cal, runs)
    assert sum('v(k) falls' in f for f in out) == 2
    assert any('k = 1: measured speedup' in f for f in out)
    assert any('T=0 AR: timing repeats spread' in f for f in out)
    assert intervals.flags({'v': {'1': 1.0, '2': 1.2}}, runs[1:2][:0]) == []
