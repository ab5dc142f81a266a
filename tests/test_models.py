"""Model properties: shapes, causality, segments, cache equivalence, RoPE and GQA references."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import (
    Transformer,
    TransformerConfig,
    apply,
    apply_cached,
    check_capacity,
    init_cache,
    split,
)
from specjax.models.layers import attend, inv_frequencies, rope

CFG = TransformerConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_len=64
)


@pytest.fixture(scope='module')
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _tokens(b, t, seed=0, vocab=CFG.vocab_size):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, dtype=jnp.int32)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('tie', [True, False])
def test_shapes_and_dtypes(dtype, tie):
    cfg = TransformerConfig(
        **{**CFG.to_dict(), 'dtype': dtype, 'param_dtype': dtype, 'tie_embeddings': tie}
    )
    m = Transformer(cfg, rngs=nnx.Rngs(1))
    logits = jax.jit(apply, static_argnums=0)(*split(m), _tokens(2, 7))
    assert logits.shape == (2, 7, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    n = sum(x.size for x in jax.tree.leaves(nnx.state(m)))
    assert n == cfg.num_params
    for leaf in jax.tree.leaves(nnx.state(m)):
        assert leaf.dtype == jnp.dtype(dtype)


def test_every_parameter_has_logical_axes(model):
    specs = nnx.get_partition_spec(nnx.state(model))
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    params = jax.tree.leaves(nnx.state(model))
    assert len(leaves) == len(params)
    for spec, p in zip(leaves, params, strict=True):
        assert len(spec) == p.ndim and all(isinstance(a, str) for a in spec)


def test_causality(model, highest_precision):
    tok = _tokens(2, 16)
    changed = tok.at[:, 9:].set((tok[:, 9:] + 7) % CFG.vocab_size)
    fwd = jax.jit(apply, static_argnums=0)
    a, b = fwd(*split(model), tok), fwd(*split(model), changed)
    np.testing.assert_array_equal(np.asarray(a[:, :9]), np.asarray(b[:, :9]))
    assert not np.allclose(a[:, 9:], b[:, 9:])


def test_segment_isolation(model, highest_precision):
    """Two packed documents (positions restarting) give each document's logits alone."""
    doc_a, doc_b = _tokens(1, 5, seed=1), _tokens(1, 8, seed=2)
    packed = jnp.concatenate([doc_a, doc_b, jnp.zeros((1, 3), jnp.int32)], axis=1)
    seg = jnp.array([[1] * 5 + [2] * 8 + [0] * 3])
    pos = jnp.array([list(range(5)) + list(range(8)) + [0] * 3])
    out = model(packed, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(out[:, :5], model(doc_a), atol=1e-5)
    np.testing.assert_allclose(out[:, 5:13], model(doc_b), atol=1e-5)


def test_cached_decoding_equals_uncached(model, highest_precision):
    """Right-padded prefill, one-token steps and ragged multi-token calls match the full forward."""
    b, total = 3, 20
    tok = _tokens(b, total, seed=3)
    full = np.asarray(model(tok))
    graphdef, params = split(model)
    step = jax.jit(apply_cached, static_argnums=0)
    cache = init_cache(CFG, b, capacity=32)
    prefill = jnp.array([4, 7, 1], jnp.int32)
    logits, cache = step(graphdef, params, tok[:, :8], prefill, cache)
    for r in range(b):
        np.testing.assert_allclose(logits[r, : prefill[r]], full[r, : prefill[r]], atol=1e-5)
    # Ragged calls of 3 tokens with 0..3 valid per row, then single tokens.
    plan = [jnp.array([3, 1, 2]), jnp.array([0, 3, 1]), jnp.array([1, 1, 1]), jnp.array([2, 0, 3])]
    for valid in plan:
        lengths = np.asarray(cache.lengths)
        chunk = jnp.stack([jax.lax.dynamic_slice(tok[r], (lengths[r],), (3,)) for r in range(b)])
        logits, cache = step(graphdef, params, chunk, valid.astype(jnp.int32), cache)
        for r in range(b):
            n = int(valid[r])
            np.testing.assert_allclose(
                logits[r, :n], full[r, lengths[r] : lengths[r] + n], atol=1e-5
            )
    np.testing.assert_array_equal(cache.lengths, np.asarray(prefill) + sum(np.asarray(plan)))


def test_rollback_by_lowering_length(model, highest_precision):
    """Writing junk, then lowering lengths, leaves the cache equivalent to never writing it."""
    tok = _tokens(2, 10, seed=4)
    full = np.asarray(model(tok))
    graphdef, params = split(model)
    step = jax.jit(apply_cached, static_argnums=0)
    cache = init_cache(CFG, 2, capacity=16)
    _, cache = step(graphdef, params, tok[:, :5], jnp.array([5, 5]), cache)
    junk = _tokens(2, 5, seed=5)
    _, cache = step(graphdef, params, junk, jnp.array([4, 4]), cache)
    cache = cache.replace(lengths=jnp.array([5, 5], jnp.int32))
    logits, _ = step(graphdef, params, tok[:, 5:10], jnp.array([5, 5]), cache)
    np.testing.assert_allclose(logits, full[:, 5:10], atol=1e-5)


def _np_rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[..., None] * inv
    cos = np.cos(np.concatenate([ang, ang], -1))[:, :, None]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, :, None]
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def test_rope_matches_hf_rotate_half_reference(highest_precision):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 9, 11, 100, 1000]])
    out = rope(jnp.asarray(x), jnp.asarray(pos), inv_frequencies(x.shape[-1], 500.0))
    np.testing.assert_allclose(out, _np_rope(x, pos, 500.0), atol=1e-4)


def test_gqa_matches_direct_reference(highest_precision):
    rng = np.random.default_rng(1)
    b, t, s, h, k, d = 2, 3, 5, 6, 2, 4
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    kk = rng.normal(size=(b, s, k, d)).astype(np.float32)
    v = rng.normal(size=(b, s, k, d)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.7
    mask[..., 0] = True
    k_bksd, v_bkds = kk.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1)  # the cache's layout
    out = np.asarray(attend(*map(jnp.asarray, (q, k_bksd, v_bkds, mask))))
    ref = np.zeros_like(out)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // k)  # query head hi uses key/value head hi // group
            sc = q[bi, :, hi] @ kk[bi, :, kv].T / np.sqrt(d)
            sc = np.where(mask[bi], sc, -np.inf)
            w = np.exp(sc - sc.max(-1, keepdims=True))
            ref[bi, :, hi] = (w / w.sum(-1, keepdims=True)) @ v[bi, :, kv]
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_functional_apply_matches_module(model):
    graphdef, params = split(model)
    tok = _tokens(2, 6)
    np.testing.assert_allclose(
        jax.jit(apply, static_argnums=0)(graphdef, params, tok), model(tok), atol=1e-5
    )


@pytest.mark.parametrize('tie', [True, False])
def test_logits_at_are_the_full_logits_at_those_positions(tie, highest_precision):
    m = Transformer(dataclasses.replace(CFG, tie_embeddings=tie), rngs=nnx.Rngs(1))
    graphdef, params = split(m)
    tok = _tokens(3, 9, seed=2)
    segments = jnp.asarray([[1] * 9, [1] * 6 + [0] * 3, [1] * 2 + [0] * 7])
    at = jnp.asarray([[0, 3, 8, 8], [1, 2, 4, 5], [0, 1, 0, 0]], jnp.int32)
    full = apply(graphdef, params, tok, segment_ids=segments)
    got = jax.jit(apply, static_argnums=0)(graphdef, params, tok, None, segments, logits_at=at)
    assert got.shape == (3, 4, CFG.vocab_size)
    np.testing.assert_allclose(got, jnp.take_along_axis(full, at[..., None], axis=1), atol=1e-5)


@pytest.mark.parametrize(
    'overrides, field',
    [
        ({'d_model': 30}, 'd_model=30'),
        ({'n_kv_heads': 3}, 'n_kv_heads=3'),
        ({'d_model': 12, 'n_heads': 4}, 'head_dim'),
        ({'vocab_size': 0}, 'vocab_size'),
        ({'dtype': 'float8'}, 'dtype'),
    ],
)
def test_bad_config_names_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{**CFG.to_dict(), **overrides})


def test_unknown_config_key():
    with pytest.raises(ValueError, match='n_experts'):
        TransformerConfig.from_dict({**CFG.to_dict(), 'n_experts': 4})


def test_sequence_above_max_len(model):
    with pytest.raises(ValueError, match='max_len=64'):
        model(_tokens(1, 65))


def test_capacity_errors():
    with pytest.raises(ValueError, match='capacity is 10'):
        check_capacity(10, 11, 'prompt + max_new_tokens + k + 1')
    with pytest.raises(ValueError, match='max_len=64'):
        init_cache(CFG, 1, capacity=65)


def test_cached_verification_reads_the_cache_and_weights_in_place():
    """The compiled (k + 1)-token cached call of a SmolLM2-shaped block (kv heads 3, head_dim 64)
    holds no copy or transpose of a KV cache layer (the heads-major layout: keys [B, K, C, D],
    values [B, K, D, C]) and none of a weight-shaped array (docs/performance.md)."""
    import re

    cfg = TransformerConfig(vocab_size=512, d_model=192, n_layers=2, n_heads=3, n_kv_heads=3,
                            d_ff=256, max_len=256, head_dim=64)  # fmt: skip
    graphdef, params = split(Transformer(cfg, rngs=nnx.Rngs(0)))
    cache = init_cache(cfg, 1, 256, lengths=jnp.array([64], jnp.int32))
    call = jax.jit(lambda p, t, c: apply_cached(graphdef, p, t, jnp.zeros((1,), jnp.int32), c),
                   donate_argnums=2)  # fmt: skip
    for width in (1, 5):
        hlo = call.lower(params, jnp.ones((1, width), jnp.int32), cache).compile().as_text()
        weights = {tuple(x.shape) for x in jax.tree.leaves(params) if x.ndim >= 2}
        for dims, op in re.findall(r'= \w+\[([\d,]*)\](?:\{[^}]*\})? (copy|transpose)\(', hlo):
            shape = tuple(int(x) for x in dims.split(',') if x)
            assert shape not in weights, (width, op, shape, 'a weight')
            if op == 'transpose':
                assert sorted(shape) != sorted((1, 3, 256, 64)), (width, shape, 'a cache layer')
