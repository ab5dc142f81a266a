"""Acceptance statistics: hand-computed cases, Leviathan's formula, optimal k, row buckets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specjax.sampling import rescore
from specjax.sampling import stats as st


def _two_rows():
    """Two rows, k = 3, written out round by round.

    Row 0, 2 rounds: accepts 3 (all, + bonus), then accepts 1 and rejects position 2.
      drafted 6, examined 3 + 2 = 5, accepted 4, emitted 4 + 2 = 6.
      accepted per position [2, 1, 1], examined per position [2, 2, 1].
    Row 1, 3 rounds: rejects position 1 three times.
      drafted 9, examined 3, accepted 0, emitted 3.
      accepted per position [0, 0, 0], examined per position [3, 0, 0].
    """
    return {
        'row_drafted': np.array([6, 9]),
        'row_examined': np.array([5, 3]),
        'row_accepted': np.array([4, 0]),
        'row_rounds': np.array([2, 3]),
        'row_target_calls': np.array([3, 4]),  # rounds + prefill
        'row_draft_calls': np.array([6, 9]),
        'row_accepted_per_position': np.array([[2, 1, 1], [0, 0, 0]]),
        'row_examined_per_position': np.array([[2, 2, 1], [3, 0, 0]]),
    }


def test_hand_computed_totals():
    table = st.row_table(_two_rows(), lengths=[6, 3], emitted=[6, 3])
    s = st.summarize(st.reduce_rows(table))
    assert s['drafted'] == 15 and s['examined'] == 8 and s['accepted'] == 4 and s['rounds'] == 5
    assert s['acceptance_rate'] == pytest.approx(4 / 8)
    assert s['accepted_fraction'] == pytest.approx(4 / 15)
    np.testing.assert_allclose(s['acceptance_per_position_conditional'], [2 / 5, 1 / 2, 1 / 1])
    np.testing.assert_allclose(s['acceptance_per_position_unconditional'], [2 / 5, 1 / 5, 1 / 5])
    assert s['block_efficiency'] == pytest.approx(9 / 5)


def test_per_row_buckets_and_default_emitted():
    table = st.row_table(_two_rows(), lengths=[6, 3], domain=np.array(['code', 'prose']), t=1.0)
    buckets = st.bucket_stats(table, ['domain', 't'])
    assert set(buckets) == {('code', 1.0), ('prose', 1.0)}
    code, prose = buckets[('code', 1.0)], buckets[('prose', 1.0)]
    assert code['acceptance_rate'] == pytest.approx(4 / 5)
    assert code['accepted_fraction'] == pytest.approx(4 / 6)
    assert code['block_efficiency'] == pytest.approx(3.0)  # (accepted + rounds) / rounds
    np.testing.assert_allclose(code['acceptance_per_position_conditional'], [1, 1 / 2, 1])
    assert prose['acceptance_rate'] == 0.0 and prose['block_efficiency'] == 1.0
    assert math.isnan(prose['acceptance_per_position_conditional'][1])  # never examined
    (everything,) = st.bucket_stats(table, []).values()
    assert everything['rows'] == 2 and everything['acceptance_rate'] == pytest.approx(0.5)


def test_concat_and_length_buckets():
    table = st.concat_tables([st.row_table(_two_rows(), lengths=[6, 3])] * 2)
    assert table['drafted'].tolist() == [6, 9, 6, 9]
    labels = st.length_bucket([3, 6, 16, 40], [4, 16, 32])
    assert labels.tolist() == ['<4', '[4,16)', '[16,32)', '>=32']
    with pytest.raises(ValueError, match='columns differ'):
        st.concat_tables([table, {'drafted': np.zeros(1)}])
    with pytest.raises(ValueError, match='no column'):
        st.bucket_stats(table, ['domain'])


def test_leviathan_limits():
    assert st.expected_block_efficiency(0.0, 5) == pytest.approx(1.0)
    assert st.expected_block_efficiency(1.0, 5) == pytest.approx(6.0)
    assert st.expected_block_efficiency(1.0 - 1e-7, 5) == pytest.approx(6.0, rel=1e-5)
    assert st.expected_block_efficiency(0.5, 1) == pytest.approx(1.5)
    assert st.expected_block_efficiency(0.5, 2) == pytest.approx(1.75)
    # E[tau] = sum_{i=0..k} alpha^i, increasing in k towards 1 / (1 - alpha).
    a = 0.8
    taus = [st.expected_block_efficiency(a, k) for k in range(1, 60)]
    assert all(x < y for x, y in zip(taus, taus[1:]))
    assert taus[-1] == pytest.approx(1 / (1 - a), rel=1e-4)
    np.testing.assert_allclose(st.expected_block_efficiency(np.array([0.0, 1.0]), 2), [1.0, 3.0])
    with pytest.raises(ValueError):
        st.expected_block_efficiency(1.5, 2)


def test_alpha_for_tau_inverts_leviathan():
    for k in (1, 2, 4, 8):
        for a in (0.05, 0.3, 0.6, 0.95):
            tau = st.expected_block_efficiency(a, k)
            assert st.alpha_for_tau(tau, k) == pytest.approx(a, abs=1e-9)
    assert st.alpha_for_tau(1.0, 4) == 0.0 and st.alpha_for_tau(0.5, 4) == 0.0
    assert st.alpha_for_tau(5.0, 4) == pytest.approx(1.0) and st.alpha_for_tau(5.01, 4) is None
    # required_alpha is the same inversion at tau = speedup x (k c + v(k)).
    assert st.required_alpha(4, 0.1, 1.2, 1.5) == pytest.approx(st.alpha_for_tau(2.4, 4))


def test_predicted_speedup_and_optimal_k():
    v = {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0}
    # alpha = 0.5, c = 0.1: E[tau] = 1.5, 1.75, 1.875, 1.9375; costs 1.1, 1.2, 1.3, 2.4.
    speedups = st.predicted_speedups(0.5, 0.1, v)
    expected = {1: 1.5 / 1.1, 2: 1.75 / 1.2, 3: 1.875 / 1.3, 4: 1.9375 / 2.4}
    for k in v:
        assert speedups[k] == pytest.approx(expected[k])
    assert st.optimal_k(0.5, 0.1, v) == 2
    assert st.optimal_k(0.99, 0.01, v) == 3  # v(4) = 2 makes k = 4 lose
    assert st.optimal_k(0.0, 0.1, v) == 1
    assert st.predicted_speedup(2.0, 3, 0.5, v) == pytest.approx(2.0 / 2.5)
    assert st.predicted_speedup(2.0, 3, 0.5, 1.5) == pytest.approx(2.0 / 3.0)
    with pytest.raises(ValueError):
        st.optimal_k(0.5, 0.1, {})


def test_row_table_checks():
    rows = _two_rows()
    with pytest.raises(ValueError, match='3 rows, expected 2'):
        st.row_table(rows, lengths=[1, 2, 3])
    del rows['row_rounds']
    with pytest.raises(ValueError, match='row_rounds'):
        st.row_table(rows)


def _peaked_model(d_model, seed):
    """A random-init model whose tied embeddings are scaled up, so alpha sits mid-range."""
    from flax import nnx

    from specjax.models import Transformer, TransformerConfig

    m = Transformer(TransformerConfig(64, d_model, 1, 2, 2, 2 * d_model, 32), rngs=nnx.Rngs(seed))
    m.embed.set_value(m.embed.get_value() * 10.0)
    return m


@pytest.mark.parametrize('temperature, top_k', [(0.8, 20), (0.0, 0)])
def test_acceptance_rate_matches_alpha_at_examined_positions(temperature, top_k):
    """accepted / examined of the real sampler vs alpha re-scored at the same positions.

    With max_new_tokens <= k no bonus token is ever emitted, so the emitted positions are exactly
    the examined ones. Given its context, an examined proposal is accepted with probability
    alpha, so accepted - sum(alpha) is a sum of martingale differences with variance
    sum(alpha (1 - alpha)): a 4-sigma normal bound. Greedy acceptance is deterministic: equal.
    """
    import jax

    from specjax.sampling import SamplingConfig, speculative_sample

    target, draft = _peaked_model(32, 0), _peaked_model(16, 1)
    batch, k = 256, 4
    prompts = np.random.default_rng(0).integers(3, 64, (batch, 4)).astype(np.int32)
    lengths = np.full((batch,), 4, np.int32)
    sampling = SamplingConfig(temperature, top_k, 1.0)
    out = speculative_sample(
        target,
        draft,
        prompts,
        lengths,
        num_draft_tokens=k,
        max_new_tokens=k,
        sampling=sampling,
        rng=jax.random.key(1),
    )
    alpha, mask = rescore.alpha_of_sequences(
        target, draft, prompts, lengths, out.tokens, out.lengths, sampling
    )
    stats = jax.device_get(out.stats)
    assert int(stats['examined']) == int(mask.sum()) == int(np.asarray(out.lengths).sum())
    np.testing.assert_array_equal(stats['row_examined'], mask.sum(1))
    accepted, expected = int(stats['accepted']), float(alpha.sum())
    sd = float(np.sqrt((alpha * (1 - alpha)).sum()))
    if temperature == 0:  # random tied-embedding models mostly agree on argmax (echo the input)
        assert expected < mask.sum() and accepted == round(expected)
    else:
        assert 0.1 < expected / mask.sum() < 0.9  # an informative regime
        assert abs(accepted - expected) <= 4 * sd + 1, (accepted, expected, sd)
    assert int(stats['examined_per_position'].sum()) == int(stats['examined'])


def test_batch_block_efficiency_follows_the_slowest_row():
    stats = {'emitted': 9, 'batch_rounds': 3}  # rows of 6 and 3 tokens, the slower one 3 rounds
    assert st.batch_block_efficiency(stats, 2) == pytest.approx(9 / 6)
    table = st.row_table(dict(_two_rows(), row_emitted=np.array([6, 3])))
    assert table['emitted'].tolist() == [6, 3]
