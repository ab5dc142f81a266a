"""Divergences against float64 numpy references, limits, zeros, gradients and the registry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.distill import divergences as dv

B, T, V = 3, 7, 13


def _softmax64(logits, temperature=1.0):
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _kl64(p, q):
    return np.sum(p * (np.log(p) - np.log(q)), -1)


def _reference(name, p, q, beta=0.5):
    """Per-position float64 values [B, T]."""
    if name == 'fkl':
        return _kl64(p, q)
    if name == 'rkl':
        return _kl64(q, p)
    if name == 'jsd':
        m = beta * p + (1 - beta) * q
        return beta * _kl64(p, m) + (1 - beta) * _kl64(q, m)
    if name == 'tvd':
        return 0.5 * np.abs(p - q).sum(-1)
    if name == 'neg_log_alpha':
        return -np.log(np.minimum(p, q).sum(-1))
    raise KeyError(name)


def _masked_mean64(values, mask):
    return (values * mask).sum() / mask.sum()


@pytest.fixture(scope='module')
def logits():
    rng = np.random.default_rng(0)
    target = (rng.normal(size=(B, T, V)) * 2.0).astype(np.float32)
    draft = (rng.normal(size=(B, T, V)) * 2.0).astype(np.float32)
    mask = rng.random((B, T)) < 0.7
    mask[0, 0] = True
    return target, draft, mask


@pytest.mark.parametrize('name', ['fkl', 'rkl', 'jsd', 'tvd', 'neg_log_alpha'])
@pytest.mark.parametrize('temperature', [1.0, 2.5])
def test_matches_numpy_reference(logits, name, temperature):
    target, draft, mask = logits
    fn = dv.get_divergence(name, beta=0.3)
    loss, metrics = fn(
        jnp.asarray(target), jnp.asarray(draft), jnp.asarray(mask), temperature=temperature
    )
    p, q = _softmax64(target, temperature), _softmax64(draft, temperature)
    want = _masked_mean64(_reference(name, p, q, beta=0.3), mask)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    alpha = _masked_mean64(np.minimum(p, q).sum(-1), mask)
    np.testing.assert_allclose(float(metrics['alpha']), alpha, rtol=2e-5)
    assert float(metrics['tokens']) == mask.sum()


def test_expected_accepted_length_matches_block_loop(logits):
    target, draft, _ = logits
    k = 3
    mask = np.zeros((B, T), bool)
    mask[0, 1:7] = True  # one run of 6: blocks [1..3], [4..6]
    mask[1, 0:2] = True  # two runs: [0, 1] and [3..6] -> blocks [3..5], [6]
    mask[1, 3:7] = True
    mask[2, 2:4] = True
    loss, metrics = dv.expected_accepted_length(
        jnp.asarray(target), jnp.asarray(draft), jnp.asarray(mask), block_size=k
    )
    alpha = np.minimum(_softmax64(target), _softmax64(draft)).sum(-1)
    total, blocks = 0.0, 0
    for b in range(B):
        t = 0
        while t < T:
            if not mask[b, t]:
                t += 1
                continue
            run_end = t
            while run_end < T and mask[b, run_end]:
                run_end += 1
            for start in range(t, run_end, k):
                prod, length = 1.0, 0.0
                for j in range(start, min(start + k, run_end)):
                    prod *= alpha[b, j]
                    length += prod
                total += length
                blocks += 1
            t = run_end
    np.testing.assert_allclose(float(loss), -total / mask.sum(), rtol=2e-5)
    np.testing.assert_allclose(
        float(metrics['accepted_length_per_block']), total / blocks, rtol=2e-5
    )


def test_block_positions_cut_runs_into_blocks():
    mask = jnp.asarray([[0, 1, 1, 1, 1, 1, 0, 1, 1]], bool)
    index, start = dv.block_positions(mask, 2)
    np.testing.assert_array_equal(np.where(mask[0], index[0], -1), [-1, 0, 1, 0, 1, 0, -1, 0, 1])
    np.testing.assert_array_equal(start[0], [0, 1, 0, 1, 0, 1, 0, 1, 0])


@pytest.mark.parametrize('name', sorted(dv.DIVERGENCES))
def test_zero_when_equal_and_finite_gradients(logits, name):
    target, draft, mask = logits
    fn = dv.get_divergence(name, beta=0.5, block_size=3)
    same, _ = fn(jnp.asarray(target), jnp.asarray(target), jnp.asarray(mask))
    if name == 'expected_accepted_length':
        assert float(same) == pytest.approx(-1.0, abs=1e-5)  # every drafted token accepted
    else:
        assert abs(float(same)) < 1e-5
    extreme = jnp.asarray(target) * 40.0  # near-one-hot teacher, log-ratios far above 20
    for p_logits, q_logits in [(target, target), (target, draft), (extreme, draft)]:
        grad = jax.grad(lambda q, p=p_logits: fn(jnp.asarray(p), q, jnp.asarray(mask))[0])(
            jnp.asarray(q_logits)
        )
        assert np.all(np.isfinite(np.asarray(grad))), name
    loss, _ = fn(extreme, jnp.asarray(draft), jnp.asarray(mask))
    assert np.isfinite(float(loss))


def test_jsd_limits_and_endpoints(logits):
    target, draft, mask = (jnp.asarray(x) for x in logits)
    fkl = float(dv.forward_kl(target, draft, mask)[0])
    rkl = float(dv.reverse_kl(target, draft, mask)[0])
    errors = []
    for beta in (1e-2, 1e-3, 1e-4, 1e-5):
        small = float(dv.jsd(target, draft, mask, beta=beta)[0]) / beta
        large = float(dv.jsd(target, draft, mask, beta=1 - beta)[0]) / beta
        errors.append((abs(small - fkl) / fkl, abs(large - rkl) / rkl))
    # The gap is O(β) (first order, no float32 floor): each decade shrinks it about tenfold.
    assert max(errors[-1]) < 1e-3, errors
    for (a_small, a_large), (b_small, b_large) in zip(errors, errors[1:]):
        assert b_small < 0.2 * a_small and b_large < 0.2 * a_large, errors
    assert float(dv.jsd(target, draft, mask, beta=0.0)[0]) == pytest.approx(fkl, rel=1e-6)
    assert float(dv.jsd(target, draft, mask, beta=1.0)[0]) == pytest.approx(rkl, rel=1e-6)


def test_tvd_is_one_minus_alpha(logits):
    target, draft, mask = (jnp.asarray(x) for x in logits)
    loss, metrics = dv.tvd(target, draft, mask)
    assert float(loss) == pytest.approx(1.0 - float(metrics['alpha']), abs=1e-6)
    p, q = _softmax64(logits[0]), _softmax64(logits[1])
    np.testing.assert_allclose(
        0.5 * np.abs(p - q).sum(-1), 1 - np.minimum(p, q).sum(-1), atol=1e-12
    )


def test_loss_temperature_applies_to_both(logits):
    target, draft, mask = (jnp.asarray(x) for x in logits)
    a = dv.reverse_kl(target, draft, mask, temperature=2.0)[0]
    b = dv.reverse_kl(target / 2.0, draft / 2.0, mask)[0]
    assert float(a) == pytest.approx(float(b), rel=1e-6)


def test_distill_loss_t2_scaling_and_ce(logits):
    target, draft, mask = (jnp.asarray(x) for x in logits)
    fn = dv.get_divergence('fkl')
    plain, _ = dv.distill_loss(fn, target, draft, mask, temperature=2.0)
    scaled, _ = dv.distill_loss(fn, target, draft, mask, temperature=2.0, scale_by_t2=True)
    assert float(scaled) == pytest.approx(4.0 * float(plain), rel=1e-6)
    targets = jnp.zeros((B, T), jnp.int32)
    with_ce, metrics = dv.distill_loss(
        fn, target, draft, mask, ce_weight=0.5, ce_targets_BT=targets
    )
    nll = -np.log(_softmax64(logits[1])[..., 0])
    ce = _masked_mean64(nll, logits[2])
    assert float(metrics['ce']) == pytest.approx(ce, rel=1e-5)
    base = float(dv.distill_loss(fn, target, draft, mask)[0])
    assert float(with_ce) == pytest.approx(base + 0.5 * ce, rel=1e-5)
    # no gradient reaches the target logits
    g = jax.grad(lambda p: dv.distill_loss(fn, p, draft, mask)[0])(target)
    assert float(jnp.abs(g).max()) == 0.0


def test_registry_errors():
    with pytest.raises(ValueError, match=r"config\.distill\.divergence='kl2'"):
        dv.get_divergence('kl2')
    with pytest.raises(ValueError, match=r'config\.distill\.beta'):
        dv.get_divergence('jsd', beta=1.5)
