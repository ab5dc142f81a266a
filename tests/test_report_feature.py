"""The quickstart report's feature-draft section (specjax.quickstart.report_feature) on a
hand-built run record: every figure is the JSON's, each goal is met or missed by the right gap,
and acceptance by position splits position 1 from the rest."""

import numpy as np

from specjax.quickstart.report_feature import (
    FEATURE_GOALS,
    feature_goal_rows,
    first_and_later,
    section_feature_goals,
)


def _run(label, k, alpha, tau, accepted, examined):
    return {
        'sampling_label': label,
        'method': 'speculative',
        'k': k,
        'alpha': alpha,
        'block_efficiency': tau,
        'intervals': {'alpha': [alpha - 0.01, alpha + 0.01]},
        'per_row': {'accepted_per_position': accepted, 'examined_per_position': examined},
    }


def _record():
    acc = [[3, 1, 0, 0], [2, 0, 1, 0]]  # two prompts x 4 positions
    exa = [[8, 3, 1, 0], [6, 2, 1, 1]]
    runs = [{'sampling_label': label, 'method': 'autoregressive', 'k': 0} for label in ('T=0',)]
    runs += [
        _run('T=0', 1, 0.40, 1.40, [[5], [4]], [[9], [9]]),
        _run('T=0', 4, 0.70, 2.60, acc, exa),
        _run('T=1,top_k=0,top_p=1', 4, 0.42, 1.50, acc, exa),
    ]
    spec = {
        'runs': runs,
        'optimal_k': {'T=1,top_k=0,top_p=1': {'best_measured_k': 1, 'best_measured_speedup': 1.06}},
        'prompts': {'batch_size': 8},
    }
    serve = {
        'k': 2,
        'sampling': {'temperature': 0.0},
        'rows': [
            {'method': 'target', 'batch_size': 1, 'tokens_per_s': 30.0},
            {'method': 'spec_feature', 'batch_size': 1, 'tokens_per_s': 27.0},
        ],
    }
    return {
        'spec_feature': spec,
        'serve': serve,
        'run': {'stage_seconds': {'draft_feature': 1500.0}},
        'draft_feature': {'feature_cache': {'seconds': 160.0}},
    }


def test_each_goal_is_met_or_missed_by_its_gap():
    rows = {r[0]: r[1:] for r in feature_goal_rows(_record())}
    assert rows['alpha, T = 0 (greedy), chain k = 4'] == ['0.7 [0.69, 0.71]', '>= 0.65', 'met']
    assert rows['alpha, T = 1, chain k = 4'][2] == 'short by 0.13'  # 0.55 - 0.42
    assert rows['tau, T = 0 (greedy), chain k = 4'][2] == 'met'
    assert rows['tau, T = 1, chain k = 4'][2] == 'short by 0.7'  # 2.2 - 1.5
    speed = next(v for name, v in rows.items() if name.startswith('speedup over the target alone, '
                                                                  'batch 1, greedy'))  # fmt: skip
    assert speed[0] == '0.9x' and speed[2] == 'short by 0.6'
    t1 = rows['speedup over the target alone, T = 1, batch 1']
    assert 'batch 8, best k = 1: 1.06x' in t1[0] and t1[2] == '-'
    train = rows['training wall seconds, feature caching included (stage draft_feature)']
    assert train == [
        '1500 (feature cache 160)',
        f'<= {FEATURE_GOALS["train_seconds"]:g}',
        'short by 300',
    ]


def test_serve_at_t1_gives_no_greedy_batch1_row():
    d = _record()
    d['serve']['sampling']['temperature'] = 1.0
    names = [r[0] for r in feature_goal_rows(d)]
    assert not any(n.startswith('speedup over the target alone, batch 1, greedy') for n in names)


def test_position_one_against_the_rest_pools_the_prompts():
    run = _record()['spec_feature']['runs'][2]
    first, later = first_and_later(run)
    acc, exa = (
        np.sum(run['per_row']['accepted_per_position'], 0),
        np.sum(run['per_row']['examined_per_position'], 0),
    )
    assert first == acc[0] / exa[0] and later == acc[1:].sum() / exa[1:].sum()
    text = '\n'.join(section_feature_goals(_record()))
    assert 'T = 0 (greedy): 0.357 at position 1, 0.25 after' in text


def test_no_feature_draft_no_section():
    d = _record()
    del d['spec_feature']
    assert section_feature_goals(d) == []
