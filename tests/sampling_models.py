"""Tiny test models for the sampling tests: a Transformer with a scaled, offset logit head.

Scaling the logits makes random tiny models' distributions peaked and the target/draft pair
disagree strongly; a common offset (softmax-invariant in float32, as real LMs' large logits are)
makes bfloat16 rounding of the logits matter. Both are Params, so models of one shape share a
graphdef and the samplers compile once for all of them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import Transformer, TransformerConfig, apply, split
from specjax.sampling import PAD_ID


class ScaledTransformer(Transformer):
    """logits = scale * Transformer logits + offset."""

    def __init__(self, config, scale=1.0, offset=0.0, *, rngs):
        super().__init__(config, rngs=rngs)
        self.logit_scale = nnx.Param(jnp.float32(scale), out_sharding=(), eager_sharding=False)
        self.logit_offset = nnx.Param(jnp.float32(offset), out_sharding=(), eager_sharding=False)

    def _logits(self, x_BTE):
        return super()._logits(x_BTE) * self.logit_scale[...] + self.logit_offset[...]


def tiny_config(vocab_size=5, max_len=32, d_model=16, n_layers=1) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=2, n_kv_heads=1,
        d_ff=32, max_len=max_len, tie_embeddings=False,
    )  # fmt: skip


def make_model(config, seed, scale=1.0, offset=0.0) -> ScaledTransformer:
    return ScaledTransformer(config, scale, offset, rngs=nnx.Rngs(seed))


def perturbed(model, seed, noise, scale=None):
    """A copy of `model` with every matrix multiplied by (1 + noise * N(0, 1)) elementwise."""
    graphdef, params = split(model)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        x * (1 + noise * jax.random.normal(key, x.shape)) if x.ndim >= 2 else x
        for x, key in zip(leaves, keys, strict=True)
    ]
    copy = nnx.merge(graphdef, jax.tree.unflatten(treedef, new))
    if scale is not None:
        copy.logit_scale.value = jnp.float32(scale)
    return copy


def ragged_prompts(prompts, batch):
    """Rows cycling through `prompts` (lists of ints), right-padded: (int32 [B, P], int32 [B])."""
    width = max(len(p) for p in prompts)
    table = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        table[i, : len(p)] = p
    which = np.arange(batch) % len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)[which]
    return table[which], lengths


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, tokens):
    return apply(graphdef, params, tokens)


def full_logits(model, tokens):
    """Uncached logits [B, T, V] of int [B, T] tokens (jitted: eager dispatch is slow)."""
    return _apply(*split(model), jnp.asarray(tokens, jnp.int32))


@functools.cache
def greedy_models():
    """(target, draft) with sharp logits (ties are rare) that agree on about half the argmaxes."""
    config = tiny_config(vocab_size=17, max_len=48)
    target = make_model(config, seed=3, scale=30.0)
    return target, perturbed(target, seed=4, noise=0.6)


GREEDY_PROMPTS = ([5], [2, 9, 4], [7, 7, 1, 3, 12, 6], [11, 0], [3, 8, 8, 1], [16, 2, 5, 9, 10])
GREEDY_MAX_NEW = 12
GREEDY_EOS = 5  # ends some rows early (at different positions), not others


def check_invariants(out, k, max_new):
    """Count identities every output satisfies, whatever the models."""
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    lengths, rounds = np.asarray(out.lengths), s['row_rounds']
    assert ((lengths >= 1) & (lengths <= max_new)).all()
    np.testing.assert_array_equal(s['row_emitted'], lengths)
    # Each round emits its counted accepted proposals plus one token, except a last round cut
    # short by eos/max_new_tokens.
    assert np.isin(lengths - s['row_accepted'] - rounds, [-1, 0]).all()
    rejected = s['row_examined'] - s['row_accepted']
    assert ((rejected >= 0) & (rejected <= rounds)).all()
    assert (np.diff(s['row_examined_per_position'], axis=1) <= 0).all()  # examined in order
    assert (s['row_accepted_per_position'] <= s['row_examined_per_position']).all()
    np.testing.assert_array_equal(s['row_drafted'], k * rounds)
    np.testing.assert_array_equal(s['row_target_calls'], rounds + 1)
    np.testing.assert_array_equal(s['row_draft_calls'], k * rounds + 1)
    for name in ('drafted', 'examined', 'accepted', 'rounds', 'target_calls', 'draft_calls'):
        assert s[name] == s[f'row_{name}'].sum(), name
    np.testing.assert_array_equal(s['accepted_per_position'], s['row_accepted_per_position'].sum(0))
    assert s['batch_rounds'] == rounds.max()
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (len(lengths), max_new)
    assert (tokens[np.arange(max_new)[None, :] >= lengths[:, None]] == PAD_ID).all()
