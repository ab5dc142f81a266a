"""Target features (the hidden state after chosen blocks, what a feature draft reads): equal to a
block-by-block recomputation, the same from the full forward and from cached decoding, the same
with scanned layers, free when not asked (the logits program is unchanged) and refused when a
layer is out of range."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Transformer, TransformerConfig, apply, apply_cached, init_cache, split
from specjax.models import layout as lay

CFG = TransformerConfig(
    vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_len=64,
)  # fmt: skip
LAYERS = (0, 2, 3)  # low / mid / high


@pytest.fixture(scope='module')
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _tokens(b, t, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size, dtype=jnp.int32)


def _by_hand(model, tokens):
    """The hidden state after every block, one block at a time (the reference)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    x, out = model._embed(tokens), []
    for block in model.blocks:
        x, _ = block(x, positions, mask)
        out.append(x)
    return out


def test_forward_features_are_the_listed_blocks_outputs_and_logits_unchanged(model):
    tokens = _tokens(2, 12)
    graphdef, params = split(model)
    logits, features = jax.jit(apply, static_argnums=0, static_argnames='feature_layers')(
        graphdef, params, tokens, feature_layers=LAYERS
    )
    assert features.shape == (2, 12, len(LAYERS), CFG.d_model)
    hand = _by_hand(model, tokens)
    for j, layer in enumerate(LAYERS):
        np.testing.assert_allclose(features[:, :, j], hand[layer], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        logits, jax.jit(apply, static_argnums=0)(graphdef, params, tokens)
    )


def test_cached_features_equal_the_full_forward_token_by_token(model):
    """Prefill of a ragged batch, then one token at a time: every position's features equal the
    uncached forward's at that position."""
    b, t, prompt = 2, 10, 4
    tokens = _tokens(b, t, seed=1)
    _, full = model(tokens, feature_layers=LAYERS)
    cache = init_cache(CFG, b, capacity=16)
    graphdef, params = split(model)
    cached = jax.jit(apply_cached, static_argnums=0, static_argnames='feature_layers')
    _, cache, feats = cached(
        graphdef, params, tokens[:, :prompt], jnp.full((b,), prompt), cache, feature_layers=LAYERS
    )
    got = [feats]
    for i in range(prompt, t):
        _, cache, feats = cached(
            graphdef, params, tokens[:, i : i + 1], jnp.ones((b,), jnp.int32), cache,
            feature_layers=LAYERS,
        )  # fmt: skip
        got.append(feats)
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, rtol=1e-4, atol=1e-4)


def test_scanned_layers_give_the_same_features(model):
    scanned = Transformer(dataclasses.replace(CFG, scan_layers=True), rngs=nnx.Rngs(0))
    # the same seed gives the same parameters, stacked (tests/test_scan_layers.py)
    assert lay.is_stacked(nnx.state(scanned))
    tokens = _tokens(2, 8, seed=2)
    _, a = model(tokens, feature_layers=(3, 0))
    _, b = scanned(tokens, feature_layers=(3, 0))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_not_asking_costs_nothing_and_bad_layers_are_refused(model):
    graphdef, params = split(model)
    tokens = _tokens(1, 6)
    plain = jax.jit(apply, static_argnums=0).lower(graphdef, params, tokens).as_text()
    again = (
        jax.jit(apply, static_argnums=0, static_argnames='feature_layers')
        .lower(graphdef, params, tokens, feature_layers=())
        .as_text()
    )
    assert plain == again
    for bad in ((4,), (-1,), (1, 1)):
        with pytest.raises(ValueError, match=r'feature_layers=.*\[0, n_layers=4\)'):
            model(tokens, feature_layers=bad)
