"""Request-level routing (specjax.evaluation.routing) and its curves (route_curves).

The router at threshold -inf is the target-with-speculation path bit for bit (same prompts, same
key) and at +inf the student alone; in between each row is one or the other. Teacher-forced
scores match the models' own log-probabilities (a reduced-vocabulary student included). The
threshold, the cascade's lenience and the probe are chosen from validation prompts only: moving
every held-out prompt changes none of them.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from sampling_models import full_logits, greedy_models, make_model, ragged_prompts, tiny_config

from specjax.evaluation import route_curves, routing
from specjax.evaluation.route_stage import add_probe, choose_tier, split_labels
from specjax.models import split
from specjax.sampling import SamplingConfig, make_autoregressive_fn, make_speculative_fn

PROMPTS = ([5], [2, 9, 4], [7, 7, 1, 3, 12, 6], [11, 0], [3, 8, 8, 1], [16, 2, 5, 9, 10])
MAX_NEW = 10


def _paths():
    """(student path, target-with-speculation path, student graphdef and params) at T = 1."""
    target, draft = greedy_models()
    (t_gd, t_params), (d_gd, d_params) = split(target), split(draft)
    common = dict(max_new_tokens=MAX_NEW, sampling=SamplingConfig(1.0))
    spec = make_speculative_fn(t_gd, d_gd, num_draft_tokens=2, **common)
    alone = make_autoregressive_fn(d_gd, **common)
    student = routing.student_path(alone, [d_params], None, target.config.vocab_size)
    tier = lambda prompts, lengths, rng: spec(t_params, d_params, prompts, lengths, rng)
    return student, tier, (d_gd, d_params)


def _uncertainty(d_gd, d_params):
    def u(prompts, lengths, out):
        sc = routing.token_scores(d_gd, d_params, prompts, lengths, out.tokens, out.lengths)
        return routing.answer_uncertainty(sc['logp'], sc['mask'], 'mean_nll')

    return u


def test_router_ends_are_the_target_tier_and_the_student_bit_for_bit():
    student, tier, (d_gd, d_params) = _paths()
    prompts, lengths = ragged_prompts(PROMPTS, 12)
    key = jax.random.key(7)
    u = _uncertainty(d_gd, d_params)
    to_target = routing.Router(student, tier, u, -math.inf)(prompts, lengths, key)
    direct = tier(prompts, lengths, key)
    np.testing.assert_array_equal(to_target.tokens, np.asarray(direct.tokens))
    np.testing.assert_array_equal(to_target.lengths, np.asarray(direct.lengths))
    assert not to_target.kept.any()
    alone = routing.Router(student, tier, u, math.inf)(prompts, lengths, key)
    own = student(prompts, lengths, key)
    np.testing.assert_array_equal(alone.tokens, own.tokens)
    assert alone.kept.all()
    assert (alone.tokens != to_target.tokens).any()  # the two paths differ: informative
    middle = routing.Router(student, tier, u, float(np.median(alone.uncertainty)))
    mixed = middle(prompts, lengths, key)
    assert 0 < mixed.kept.sum() < len(mixed.kept)
    want = np.where(mixed.kept[:, None], own.tokens, np.asarray(direct.tokens))
    np.testing.assert_array_equal(mixed.tokens, want)
    with pytest.raises(ValueError, match='threshold must be a number'):
        routing.Router(student, tier, u, float('nan'))


def test_token_scores_are_the_models_log_probabilities():
    target, _ = greedy_models()
    prompts, lengths = ragged_prompts(PROMPTS[:3], 3)
    answers = np.array([[3, 4, 1, 0], [2, 2, 9, 0], [1, 16, 0, 0]], np.int32)
    answer_len = np.array([3, 3, 2], np.int32)
    sc = routing.token_scores(*split(target), prompts, lengths, answers, answer_len)
    for b in range(3):
        seq = np.concatenate([prompts[b, : lengths[b]], answers[b, : answer_len[b]]])[None]
        logp = np.asarray(jax.nn.log_softmax(full_logits(target, seq)[0], -1), np.float64)
        for j in range(answer_len[b]):
            pos = lengths[b] - 1 + j
            assert np.isclose(sc['logp'][b, j], logp[pos, answers[b, j]], atol=1e-4)
            assert sc['agree'][b, j] == (np.argmax(logp[pos]) == answers[b, j])
        assert (sc['logp'][b, answer_len[b] :] == 0).all() and not sc['mask'][
            b, answer_len[b] :
        ].any()
        n = lengths[b]
        prompt_mean = np.mean([logp[i, seq[0, i + 1]] for i in range(n - 1)]) if n > 1 else 0.0
        assert np.isclose(sc['prompt_mean_logp'][b], prompt_mean, atol=1e-4)
        last = logp[n - 1]
        assert np.isclose(sc['last_entropy'][b], -(np.exp(last) * last).sum(), atol=1e-4)
    # a reduced-vocabulary model: its inputs and answers mapped to its indices
    ids = [1, 3, 4, 9, 16]
    small = make_model(tiny_config(5, max_len=48), seed=5, scale=8.0)
    sc = routing.token_scores(*split(small), prompts, lengths, answers, answer_len, ids=ids)
    table = {t: i for i, t in enumerate(ids)}
    seq = np.array([[table.get(int(t), 0) for t in prompts[1, :3]] + [0, 0, 3]], np.int32)
    logp = np.asarray(jax.nn.log_softmax(full_logits(small, seq)[0], -1))
    assert np.isclose(sc['logp'][1, 2], logp[4, 3], atol=1e-4)  # answer token 9 = index 3


def test_answer_uncertainty_signals():
    logp = np.log(np.array([[0.5, 0.25, 0.5, 1.0], [0.9, 0.1, 1.0, 1.0]]))
    mask = np.array([[True, True, True, False], [True, True, False, False]])
    au = routing.answer_uncertainty
    np.testing.assert_allclose(au(logp, mask, 'mean_nll'), -(logp * mask).sum(1) / [3, 2])
    np.testing.assert_allclose(au(logp, mask, 'max_nll'), [np.log(4), np.log(10)])
    np.testing.assert_allclose(au(logp, mask, 'mean_nll_first_m', 1), [np.log(2), -np.log(0.9)])
    np.testing.assert_allclose(au(logp, mask, 'max_nll_first_m', 1), [np.log(2), -np.log(0.9)])
    with pytest.raises(ValueError, match='needs m >= 1'):
        au(logp, mask, 'max_nll_first_m', 0)


def _table(seed=0, n=12):
    """A synthetic per-prompt table (route_curves' format): the student fast and worse where its
    uncertainty is high, the tier exact (cost 0), a cascade at two leniences."""
    rng = np.random.default_rng(seed)
    u = rng.uniform(0, 3, n)
    count = np.full(n, 16.0)
    t = {
        'split': split_labels(np.array(['a', 'b'] * (n // 2), dtype=object)),
        'time/target': rng.uniform(0.9, 1.1, n), 'time/tier': rng.uniform(0.6, 0.8, n),
        'time/student': rng.uniform(0.05, 0.1, n), 'time/student_m': rng.uniform(0.02, 0.03, n),
        'time/student_prefill': np.full(n, 0.01),
        'll/tier': -1.0 * count, 'll/target': -1.0 * count, 'll/student': -(1.0 + 0.2 * u) * count,
        'u/mean_nll': u, 'u/max_nll': 2 * u + rng.normal(0, 0.1, n),
        'u/mean_nll_first_m': u + rng.normal(0, 0.3, n), 'u/max_nll_first_m': u,
        'u/probe': u + rng.normal(0, 0.5, n),
    }  # fmt: skip
    for j, cost in enumerate((0.05, 0.3)):
        t[f'time/cascade/{j}'] = rng.uniform(0.4, 0.6, n) - 0.1 * j
        t[f'll/cascade/{j}'] = -(1.0 + cost) * count
        t[f'accepted/cascade/{j}'] = count * (0.5 + 0.3 * j)
    for name in ('target', 'tier', 'student', 'cascade/0', 'cascade/1'):
        t[f'count/{name}'] = count
        t[f'agree/{name}'] = count * (1.0 if name in ('target', 'tier') else 0.7)
    return t


def _moved_held_out(table, seed):
    """The table with every held-out prompt's measurements replaced by other random ones."""
    other = _table(seed)
    held = np.asarray(table['split']) == 'held_out'
    return {k: np.where(held, other[k], v) if k != 'split' else v for k, v in table.items()}


def test_threshold_and_lenience_are_chosen_on_validation_prompts_only():
    table = _table()
    floor = 0.1
    summary = route_curves.summarize(table, routing.SIGNALS, (0.3, 1.0), floor)
    for seed in (1, 2):
        moved = route_curves.summarize(
            _moved_held_out(table, seed), routing.SIGNALS, (0.3, 1.0), floor
        )
        for signal in routing.SIGNALS:
            a, b = summary['routers'][signal], moved['routers'][signal]
            assert a['chosen'] == b['chosen']
            chosen_a, chosen_b = a['curve'][a['chosen']], b['curve'][b['chosen']]
            assert chosen_a['threshold'] == chosen_b['threshold']
            assert chosen_a['validation'] == chosen_b['validation']
            assert chosen_a['held_out'] != chosen_b['held_out']  # the held-out figures did move
        assert summary['cascade']['chosen'] == moved['cascade']['chosen'] == 0  # 0.3 > floor
        assert summary['best_signal'] == moved['best_signal']
    # a chosen point meets the floor on validation; -inf is the tier (cost 0), +inf the student
    for r in summary['routers'].values():
        chosen = r['curve'][r['chosen']]
        assert chosen['validation']['quality_cost'] <= floor
        first, last = r['curve'][0], r['curve'][-1]
        assert first['threshold'] == '-inf' and last['threshold'] == 'inf'
        assert first['held_out']['quality_cost'] == 0 and first['held_out']['kept_fraction'] == 0
        assert last['held_out']['kept_fraction'] == 1
        lo, hi = chosen['held_out']['relative_latency_interval']
        assert 0 < lo <= hi


def test_probe_is_fitted_on_validation_prompts_only():
    table = _table()
    features = np.random.default_rng(3).normal(size=(12, 3))
    probe = add_probe(dict(table), features, 0.1, 1.0)
    moved = _moved_held_out(table, 4)
    held = np.asarray(table['split']) == 'held_out'
    other = np.where(held[:, None], np.random.default_rng(5).normal(size=(12, 3)), features)
    moved_table = dict(moved)
    assert add_probe(moved_table, other, 0.1, 1.0) == probe
    np.testing.assert_allclose(
        moved_table['u/probe'][~held], routing.probe_uncertainty(probe, features)[~held]
    )


def test_routed_costs_follow_what_the_router_ran():
    t = _table()
    for signal, kept_cost, deferred_cost in [
        ('mean_nll', t['time/student'], t['time/student'] + t['time/tier']),
        ('max_nll_first_m', t['time/student'], t['time/student_m'] + t['time/tier']),
        ('probe', t['time/student_prefill'] + t['time/student'], 0.01 + t['time/tier']),
    ]:
        np.testing.assert_allclose(route_curves.routed(t, signal, math.inf)['latency'], kept_cost)
        np.testing.assert_allclose(
            route_curves.routed(t, signal, -math.inf)['latency'], deferred_cost
        )


def test_tier_is_the_fastest_exact_path_serve_measured():
    rows = [
        dict(method='target', batch_size=1, wall_s=1.0, k=None),
        dict(method='draft_distilled', batch_size=1, wall_s=0.1, k=None),  # not exact
        dict(method='spec_ce', batch_size=1, wall_s=0.9, k=1),
        dict(method='spec_ngram', batch_size=1, wall_s=0.7, k=8),
    ]
    assert choose_tier({'rows': rows}, 'fastest') == {'method': 'spec_ngram', 'k': 8}
    assert choose_tier({'rows': rows}, 'target') == {'method': 'target', 'k': None}
    with pytest.raises(ValueError, match='config.route.tier'):
        choose_tier({'rows': rows}, 'draft_distilled')
