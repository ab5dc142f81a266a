"""Smoke test of benchmarks.trees' measurement (benchmarks.tree_points) on the tiny greedy pair:
every point carries every field with consistent counts, and best_shape picks the maxima. At
T = 1 only (every shape and both sibling rules; greedy programs are the samplers' own tests)."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_models import (
    GREEDY_PROMPTS,
    greedy_models,
    make_model,
    ragged_prompts,
    tiny_config,
)

from benchmarks import tree_points, trees

MAX_NEW = 8


@pytest.fixture(scope='module')
def result():
    target, draft = greedy_models()
    tokens, lengths = ragged_prompts(GREEDY_PROMPTS[:2], 2)
    grid = tree_points.Grid(
        chains=(2,), stops=(0.5,), stop_k=2, trees={'w2': ((0,), (1,), (0, 0))},
        dynamic=((2, 2, 3),),
    )  # fmt: skip
    return tree_points.measure(
        target, draft, tokens, lengths, grid=grid, batch_sizes=(1, 2), temperatures=(1.0,),
        max_new=MAX_NEW, repeats=1, sibling_keys=2,
    )  # fmt: skip


def test_every_point_has_every_field(result):
    names = {(p['name'], p['batch'], p['temperature']) for p in result['points']}
    for b in (1, 2):
        for name in [
            'ar',
            'chain k=2',
            'chain k=2 stop<0.5',
            'tree w2 (w/o repl.)',
            'tree w2 (iid)',
            'dynamic D=2 m=2 N=3',
        ]:
            assert (name, b, 1.0) in names
    for p in result['points']:
        assert set(tree_points.POINT_FIELDS) <= set(p), set(tree_points.POINT_FIELDS) - set(p)
        assert p['emitted'] == 2 * MAX_NEW  # no eos: every prompt emits max_new tokens
        assert p['cpu_s'] > 0 and p['wall_s'] > 0
        np.testing.assert_allclose(p['tokens_per_cpu_s'], p['emitted'] / p['cpu_s'])
        np.testing.assert_allclose(p['round_cpu_ms'], 1e3 * p['cpu_s'] / p['loop_rounds'])
        if p['kind'] == 'ar':
            assert p['tau'] == 1.0 and p['speedup_vs_ar'] == 1.0
            continue
        assert len(p['alpha_per_depth']) == p['depth']
        for a, e in zip(p['alpha_per_depth'], p['examined_per_depth'], strict=True):
            assert (a is None) if e == 0 else 0 <= a <= 1
        # Each round emits its accepted nodes and one token, but a row's last round may be cut.
        full = sum(p['accepted_per_depth']) + p['rounds']
        assert full - 2 <= p['emitted'] <= full
        if p['batch'] == 1:
            assert p['loop_rounds'] == p['rounds'] and p['tau_round'] == p['tau']
        assert p['predicted_speedup'] > 0 and p['predicted_cost_steps'] > 0
    assert set(result['calibration']) == {'1', '2'}
    assert len(result['siblings']) == 2 and all('target_met' in s for s in result['siblings'])
    (resampled,) = result['siblings_resampled']
    assert (resampled['tree'], resampled['batch'], resampled['calls']) == ('tree w2', 2, 2)
    assert resampled['max_siblings'] == 2 and np.isfinite(resampled['se'])


def test_best_shape_picks_the_maxima(result):
    best = tree_points.best_shape(result['points'])
    assert best == result['best'] and set(best) == {'b=1 T=1', 'b=2 T=1'}
    for v in best.values():
        group = [p for p in result['points']
                 if (p['batch'], p['temperature']) == (v['batch'], v['temperature'])
                 and p['kind'] != 'ar']  # fmt: skip
        top = max(group, key=lambda p: p['tokens_per_cpu_s'])
        assert v['measured'] == top['name']
        assert v['predicted'] == max(group, key=lambda p: p['predicted_speedup'])['name']
        assert 0 < v['predicted_pick_vs_measured_best'] <= 1
        assert v['chain_k_measured'] in (1, 2) and v['chain_k_predicted'] in (1, 2)


def test_best_shape_on_made_up_points():
    point = lambda name, kind, tps, pred, k=1: dict(
        name=name, kind=kind, batch=1, temperature=0.0, tokens_per_cpu_s=tps,
        predicted_speedup=pred, speedup_vs_ar=tps / 100, nodes=k,
    )  # fmt: skip
    points = [
        point('ar', 'ar', 100, 1.0),
        point('chain k=1', 'chain', 120, 1.5, 1),
        point('chain k=2', 'chain', 90, 1.6, 2),
        point('tree a', 'tree', 150, 1.2, 4),
    ]
    best = tree_points.best_shape(points)['b=1 T=0']
    assert (best['measured'], best['predicted']) == ('tree a', 'chain k=2')
    assert (best['chain_k_measured'], best['chain_k_predicted']) == (1, 2)
    assert best['predicted_pick_vs_measured_best'] == 90 / 150


def test_table_renders(result):
    text = trees.table(dict(result, prompts=2, max_new=MAX_NEW, repeats=1))
    assert '**Best shape**' in text and '**Sibling rules**' in text and 'chain k=2' in text
    assert '**Sibling rules, resampled**' in text


def test_calibration_takes_a_reduced_drafts_vocabulary_map():
    """A reduced-vocabulary draft (6 of the target's 12 ids) calibrates with its map, as the
    samplers run it; without the map the vocabularies disagree and calibrate refuses."""
    target = make_model(tiny_config(vocab_size=12), seed=0)
    draft = make_model(tiny_config(vocab_size=6), seed=1)
    kw = dict(context_len=4, capacity=16, repeats=1)
    with pytest.raises(ValueError, match='vocab_size=12 != draft vocab_size=6'):
        tree_points.calibrations(target, draft, (1,), [2], **kw)
    ids = np.arange(0, 12, 2, dtype=np.int32)
    (cal,) = tree_points.calibrations(target, draft, (1,), [2], draft_vocab_ids=ids, **kw).values()
    assert cal.c > 0 and set(cal.v) == {2}
