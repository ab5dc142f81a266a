"""Bootstrap intervals, timing summaries and flags of specjax.evaluation.intervals; the report's
cell formats and its accelerator model."""

import numpy as np
import pytest
from scipy import stats as sps

from specjax.evaluation import intervals
from specjax.evaluation.tables import fmt, fmt_interval, human_label
from specjax.quickstart import report_data
from specjax.sampling import stats as st


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


def test_ratio_summary_decides_by_the_95_percent_interval():
    s = intervals.ratio_summary([2.0, 2.1, 2.2], [1.0, 1.0, 1.0])
    assert s['verdict'] == 'faster' and 1 < s['interval'][0] < 2.1 < s['interval'][1]
    # two repeats: no interval, the range decides
    s = intervals.ratio_summary([1.0, 1.0], [2.0, 1.5])
    assert s['verdict'] == 'slower' and s['interval'] is None
    s = intervals.ratio_summary([1.2, 0.9, 1.1], [1.0, 1.0, 1.0])
    assert s['verdict'] == 'indistinguishable' and s['range'] == [0.9, 1.2]
    # every repeat above 1 but spread too wide for 95 %: indistinguishable, not faster
    s = intervals.ratio_summary([1.01, 1.5, 1.02], [1.0, 1.0, 1.0])
    assert s['verdict'] == 'indistinguishable' and s['interval'][0] < 1
    # the interval of log ratios against scipy's t interval
    logs = np.log([2.0, 2.1, 2.2])
    lo, hi = sps.t.interval(0.95, 2, loc=logs.mean(), scale=logs.std(ddof=1) / np.sqrt(3))
    s = intervals.ratio_summary([2.0, 2.1, 2.2], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(s['interval'], np.exp([lo, hi]))


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
    assert any('predicted at 1 of 1 points (T = 0 (greedy) k = 1)' in f for f in out)
    assert any('at 1 points (T = 0 (greedy) AR 2.7x)' in f for f in out)
    assert intervals.flags({'v': {'1': 1.0, '2': 1.2}}, runs[1:2][:0]) == []


def test_report_cells_read_as_words_and_numbers():
    assert human_label('T=0') == 'T = 0 (greedy)'
    assert human_label('T=1,top_k=0,top_p=1') == 'T = 1'
    assert human_label('T=0.7,top_k=40,top_p=0.9') == 'T = 0.7, top-k 40, top-p 0.9'
    assert human_label('bucket <8') == 'bucket <8'  # not a sampling label: unchanged
    assert [fmt(x) for x in (3000.0, 999.9, 0.000123, 1.5)] == ['3000', '1000', '0.000123', '1.5']
    assert fmt_interval(0.41234, [0.35, 0.47]) == '0.412 [0.35, 0.47]'
    assert fmt_interval(0.5, None) == '0.5'


def test_accelerator_model_ranges_c_and_v_and_predicts_only_measured_k_with_measured_v():
    spec = {
        'models': {
            'target': {'num_params': 1000, 'n_layers': 4},
            'draft': {'num_params': 250, 'n_layers': 2},
        },
        'calibration': {'c': 0.6, 'v': {'1': 1.5, '2': 1.8}},
        'optimal_k': {'T=0': {'alpha': 0.7}},
        'runs': [{'method': 'speculative', 'sampling_label': 'T=0', 'k': k} for k in (1, 2)],
    }
    m = report_data.accelerator_model(spec, 'T=0', ks=(1, 2, 3, 4))
    assert report_data.cost_ratios(spec) == {
        'parameter ratio': 0.25,
        'layer ratio': 0.5,
        'measured': 0.6,
    }
    assert len(m['scenarios']) == 6
    for s in m['scenarios']:
        v = 1.0 if s['v_source'] == 'v = 1' else spec['calibration']['v'][str(s['k'])]
        expected = st.expected_block_efficiency(0.7, s['k']) / (s['k'] * s['c'] + v)
        assert s['speedup'] == pytest.approx(expected)
        if s['v_source'] == 'v measured':
            assert s['k'] in (1, 2)
    best = max(m['scenarios'], key=lambda s: s['speedup'])
    assert (best['c_source'], best['v_source']) == ('parameter ratio', 'v = 1')
    assert m['range'] == (min(s['speedup'] for s in m['scenarios']), best['speedup'])
