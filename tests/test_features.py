"""Target features (the hidden state after chosen blocks, what a feature draft reads): equal to a
block-by-block recomputation, the same from the full forward and from cached decoding, the same
with scanned layers, free when not asked (the logits program is unchanged) and refused when a
layer is out of range. The feature draft (specjax.models.feature_draft, EAGLE-3's layer; its
equality to vLLM's forward is tests/test_interop_eagle3.py): sized from its target, refusing
targets it cannot read, cached decoding equal to its forward, a custom attention mask (training-
time test) equal to running the masked-apart segments on their own."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Transformer, TransformerConfig, apply, apply_cached, init_cache, split
from specjax.models import layout as lay
from specjax.models.feature_draft import FeatureDraftConfig, from_target

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


# ---------------------------------------------------------------- the feature draft model


def _draft(model, **kw):
    cfg = FeatureDraftConfig.for_target(model.config, **kw)
    return from_target(model, cfg, rngs=nnx.Rngs(1))


def test_feature_draft_config_sizes_from_the_target_and_refuses_what_does_not_fit(model):
    cfg = FeatureDraftConfig.for_target(CFG)
    assert cfg.feature_layers == (0, 2, 3) and cfg.n_layers == 1
    assert cfg.vocab_size == CFG.vocab_size and cfg.decoder.d_model == CFG.d_model
    assert FeatureDraftConfig.from_dict(cfg.to_dict()) == cfg
    shallow = dataclasses.replace(CFG, n_layers=2)
    with pytest.raises(ValueError, match='target n_layers=2'):
        FeatureDraftConfig.for_target(shallow)
    with pytest.raises(ValueError, match=r'feature_layers=\(0, 1, 4\).*n_layers=4'):
        FeatureDraftConfig.for_target(CFG, feature_layers=(0, 1, 4))
    with pytest.raises(ValueError, match='need >= 3 distinct'):
        FeatureDraftConfig.for_target(CFG, feature_layers=(0, 1, 1))
    with pytest.raises(ValueError, match='draft_vocab_size=99'):
        FeatureDraftConfig.for_target(CFG, draft_vocab_size=99)
    with pytest.raises(ValueError, match='n_layers must be an int >= 1'):
        FeatureDraftConfig.for_target(CFG, n_layers=0)
    nbr = FeatureDraftConfig.for_target(CFG, norm_before_residual=True)
    assert FeatureDraftConfig.from_dict(nbr.to_dict()) == nbr
    assert 'norm_before_residual' not in cfg.to_dict()  # older configs' dicts stay identical
    with pytest.raises(ValueError, match="norm_before_residual must be a bool, got 'yes'"):
        FeatureDraftConfig.for_target(CFG, norm_before_residual='yes')
    other = Transformer(dataclasses.replace(CFG, d_model=48, head_dim=None), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match='differs from FeatureDraftConfig.target'):
        from_target(other, cfg, rngs=nnx.Rngs(0))


def test_feature_draft_reads_fused_target_features_and_caches_like_its_forward(model):
    """The draft over target features: embedding copied from the target, logits over the reduced
    vocabulary, and cached decoding (prefill then one position at a time, feeding its own output
    state) equal to the uncached forward over the same inputs."""
    draft = _draft(model, draft_vocab_size=17, n_layers=2)
    np.testing.assert_array_equal(draft.embed[...], model.embed[...])
    b, t, prompt = 2, 9, 5
    tokens = _tokens(b, t + 1, seed=3)
    _, target_feats = model(tokens[:, :t], feature_layers=draft.config.feature_layers)
    feats = draft.fuse_features(target_feats)  # f_t, paired with token x_{t+1}
    assert feats.shape == (b, t, CFG.d_model)
    logits, state = draft(tokens[:, 1:], feats)
    assert logits.shape == (b, t, 17) and state.shape == (b, t, CFG.d_model)
    cache = draft.init_cache(b, capacity=16)
    lg, st, cache = draft.decode(
        tokens[:, 1 : prompt + 1], feats[:, :prompt], jnp.full((b,), prompt), cache
    )
    got = [lg]
    for i in range(prompt, t):
        lg, _, cache = draft.decode(
            tokens[:, i + 1 : i + 2], feats[:, i : i + 1], jnp.ones((b,), jnp.int32), cache
        )
        got.append(lg)
    np.testing.assert_allclose(jnp.concatenate(got, 1), logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(st, state[:, :prompt], rtol=1e-4, atol=1e-4)


def test_feature_draft_mask_separates_segments_as_running_them_apart(model):
    """An explicit causal mask is the default; a block-diagonal mask (positions restarting per
    segment) gives each segment what running it alone gives, the state fed back included."""
    draft = _draft(model, n_layers=2)
    b, t, cut = 2, 9, 4
    tokens = _tokens(b, t, seed=4)
    feats = jax.random.normal(jax.random.key(5), (b, t, CFG.d_model))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    default = draft(tokens, feats)
    explicit = draft(tokens, feats, mask=causal)
    for a, c in zip(default, explicit):
        np.testing.assert_array_equal(a, c)
    seg = jnp.arange(t) >= cut
    mask = causal & (seg[:, None] == seg[None, :])[None]
    positions = jnp.broadcast_to(jnp.where(seg, jnp.arange(t) - cut, jnp.arange(t)), (b, t))
    logits, state = draft(tokens, feats, positions, mask)
    for lo, hi in ((0, cut), (cut, t)):
        alone_logits, alone_state = draft(tokens[:, lo:hi], feats[:, lo:hi])
        np.testing.assert_allclose(logits[:, lo:hi], alone_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state[:, lo:hi], alone_state, rtol=1e-5, atol=1e-5)


def test_entry_zero_is_seen_by_itself_only(model):
    """(c_0, zero feature) has no counterpart in vLLM's and SGLang's drafts: changing it changes
    entry 0's output and nothing after it, uncached and cached alike."""
    draft = _draft(model)
    b, t = 2, 7
    tokens = _tokens(b, t, seed=6)
    feats = jax.random.normal(jax.random.key(7), (b, t, CFG.d_model))
    other_tokens = tokens.at[:, 0].set((tokens[:, 0] + 1) % CFG.vocab_size)
    other_feats = feats.at[:, 0].set(1.0)
    (la, sa), (lb, sb) = draft(tokens, feats), draft(other_tokens, other_feats)
    assert not np.allclose(la[:, 0], lb[:, 0])
    np.testing.assert_array_equal(la[:, 1:], lb[:, 1:])
    np.testing.assert_array_equal(sa[:, 1:], sb[:, 1:])
    cache = draft.init_cache(b, capacity=16)
    lc, _, _ = draft.decode(other_tokens, other_feats, jnp.full((b,), t), cache)
    np.testing.assert_allclose(lc[:, 1:], lb[:, 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('tie', [True, False])
def test_head_from_the_target_gives_the_targets_logits_of_the_draft_vocabulary(tie):
    """from_target(..., head_ids=ids): the draft's final norm and head are the target's, so its
    logits of any output state are the target's logits of it at ids; a wrong length is refused."""
    target = Transformer(dataclasses.replace(CFG, tie_embeddings=tie), rngs=nnx.Rngs(2))
    target.final_norm.scale[...] = 1.0 + jax.random.uniform(jax.random.key(3), (CFG.d_model,))
    ids = np.array([5, 0, 60, 17, 33, 2, 41])
    cfg = FeatureDraftConfig.for_target(target.config, draft_vocab_size=len(ids))
    draft = from_target(target, cfg, rngs=nnx.Rngs(1), head_ids=ids)
    h = jax.random.normal(jax.random.key(4), (2, 3, CFG.d_model))
    want = np.asarray(target._logits(h))[..., ids]
    np.testing.assert_allclose(np.asarray(draft._head(h)), want, rtol=1e-5, atol=1e-5)
    seeded = from_target(target, cfg, rngs=nnx.Rngs(1))  # EAGLE-3's start: only the embedding
    assert not np.allclose(np.asarray(seeded._head(h)), want, atol=1e-2)
    with pytest.raises(ValueError, match=r'head_ids has shape \(3,\).*\(7,\)'):
        from_target(target, cfg, rngs=nnx.Rngs(1), head_ids=ids[:3])
