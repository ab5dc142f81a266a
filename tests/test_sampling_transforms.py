"""SamplingConfig and the logits transform: against a NumPy reference and hand-made cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import SamplingConfig, sample_from_probs
from specjax.sampling import inverse_cdf as _inverse_cdf
from specjax.sampling import transform_logits as _transform_logits

# Jitted: op-by-op dispatch compiles every primitive separately, which is slower here.
transform_logits = jax.jit(_transform_logits, static_argnums=1)
inverse_cdf = jax.jit(_inverse_cdf)


def reference(logits, temperature, top_k, top_p):
    """The SamplingConfig transform (docs/design.md) written out with float64 NumPy, row by row."""
    out = []
    for row in np.asarray(logits, np.float64).reshape(-1, logits.shape[-1]):
        if temperature == 0:
            out.append(np.eye(len(row))[np.argmax(row)])
            continue
        z = row / temperature
        keep = np.ones(len(z), bool)
        if 0 < top_k < len(z):
            keep[np.argsort(-z)[top_k:]] = False
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        order = np.argsort(-p)
        mass_before = np.cumsum(p[order]) - p[order]
        keep = np.zeros(len(z), bool)
        keep[order[mass_before < top_p]] = True
        p = np.where(keep, p, 0.0)
        out.append(p / p.sum())
    return np.array(out).reshape(logits.shape)


@pytest.mark.parametrize(
    'temperature, top_k, top_p',
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.6), (0.5, 8, 0.9), (2.0, 3, 0.5)],
)
def test_transform_matches_reference(temperature, top_k, top_p):
    logits = 3.0 * np.random.default_rng(0).standard_normal((4, 3, 20), np.float32)
    probs = transform_logits(logits, SamplingConfig(temperature, top_k, top_p))
    assert probs.dtype == jnp.float32 and probs.shape == logits.shape
    np.testing.assert_allclose(probs, reference(logits, temperature, top_k, top_p), atol=2e-6)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()


def test_greedy_is_one_hot_argmax_with_lowest_index_on_ties():
    logits = jnp.array([[0.1, 2.0, -1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    for sampling in (SamplingConfig(0.0), SamplingConfig(0.0, top_k=2, top_p=0.3)):
        np.testing.assert_array_equal(transform_logits(logits, sampling), np.eye(4)[[1, 0]])


def test_top_p_keeps_the_crossing_token():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    kept = lambda top_p: int((transform_logits(logits, SamplingConfig(1.0, 0, top_p)) > 0).sum())
    assert [kept(p) for p in (0.3, 0.5, 0.75, 0.85, 0.97, 1.0)] == [1, 1, 2, 3, 4, 4]
    np.testing.assert_allclose(
        transform_logits(logits, SamplingConfig(1.0, 0, 0.75)), [0.625, 0.375, 0, 0], rtol=1e-6
    )


def test_top_k_zero_or_at_least_vocab_keeps_everything():
    logits = np.random.default_rng(1).standard_normal((2, 7), np.float32)
    full = transform_logits(logits, SamplingConfig(0.8))
    for top_k in (7, 100):
        np.testing.assert_array_equal(transform_logits(logits, SamplingConfig(0.8, top_k)), full)
    np.testing.assert_allclose(full, jax.nn.softmax(logits / 0.8), rtol=1e-6)


def test_sampling_config_validation_and_normalisation():
    for kwargs, match in [
        (dict(temperature=-1.0), r'temperature .*-1\.0'),
        (dict(temperature='hot'), 'temperature'),
        (dict(top_k=-2), 'top_k .*-2'),
        (dict(top_k=1.5), 'top_k'),
        (dict(top_p=0.0), r'top_p .*0\.0'),
        (dict(top_p=1.01), r'top_p .*1\.01'),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**kwargs)
    assert SamplingConfig(1, 0, 1) == SamplingConfig(1.0, 0, 1.0)
    assert hash(SamplingConfig(np.float32(0.5))) == hash(SamplingConfig(0.5))
    assert SamplingConfig.from_dict({'temperature': 0.0}).greedy
    with pytest.raises(ValueError, match='top_q'):
        SamplingConfig.from_dict({'top_q': 0.5})


def test_inverse_cdf_is_exact_on_a_uniform_grid():
    """u on an n-point grid gives each token n * p tokens up to 1; zero-mass tokens never."""
    probs = jnp.array([0.0, 0.1, 0.0, 0.35, 0.55, 0.0])
    n = 1000
    grid = (jnp.arange(n) + 0.5) / n
    counts = np.bincount(inverse_cdf(jnp.broadcast_to(probs, (n, 6)), grid), minlength=6)
    assert np.abs(counts - n * np.asarray(probs)).max() <= 1
    edges = jnp.array([0.0, 1.0 - 2.0**-24, 0.99999])
    tokens = inverse_cdf(jnp.broadcast_to(probs, (3, 6)), edges)
    assert set(np.asarray(tokens).tolist()) <= {1, 3, 4} and tokens[0] == 1 and tokens[1] == 4


def test_sample_from_probs_shapes_and_support():
    logits = np.random.default_rng(2).standard_normal((3, 50, 9), np.float32)
    probs = transform_logits(logits, SamplingConfig(1, 2))
    tokens = jax.jit(sample_from_probs)(jax.random.key(3), probs)
    assert tokens.shape == (3, 50) and tokens.dtype == jnp.int32
    assert (jnp.take_along_axis(probs, tokens[..., None], -1) > 0).all()
