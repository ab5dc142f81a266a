"""A draft that reads the target's hidden states (EAGLE-3's shape), Flax NNX.

Inputs per position t: the embedding of token x_{t+1} (the target's table, frozen by default)
and a feature f_t of width E: either the fused target features, fc(concat of the target's hidden
states after the blocks `feature_layers` at t) [B, T, n, E] -> [B, T, E], or, past the first
proposed token where the target has not scored t yet, the draft's own output state at t
(feature-level autoregression). combine(concat(embed, f)) [B, T, 2E] -> [B, T, E] then
`n_layers` decoder blocks with their own KV cache, a final norm, and a head over the draft's
vocabulary: the full target vocabulary, or the N ids of a reduced map (the `draft_vocab_ids` of
specjax.sampling.draft_vocab, draft index i = target id ids[i]). The state after the blocks
(before the final norm) is the draft's output feature, fed back at the next position.

`FeatureDraftConfig.for_target(target_config, feature_layers=..., n_layers=1,
draft_vocab_size=None)` sizes the draft from its target and refuses, naming the field, a target
it cannot read (fewer than 3 blocks for the default low/mid/high layers, a layer out of range, a
reduced vocabulary larger than the target's).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from specjax.models import kv_cache as kvc
from specjax.models.config import TransformerConfig
from specjax.models.layers import RMSNorm, param
from specjax.models.transformer import Block

MIN_FEATURE_LAYERS = 3  # EAGLE-3 fuses low, mid and high features


def default_feature_layers(n_layers: int) -> tuple[int, int, int]:
    """Low / mid / high blocks of an n_layers target: (1, n // 2, n - 2) from 5 blocks on (EAGLE-3
    reads an early, the middle and a late block), (0, n // 2, n - 1) clamped below that."""
    if n_layers < MIN_FEATURE_LAYERS:
        raise ValueError(
            f'target n_layers={n_layers}: a feature draft reads {MIN_FEATURE_LAYERS} distinct '
            'blocks (low / mid / high), so the target needs at least that many'
        )
    deep = n_layers >= 5
    low, high = (1, n_layers - 2) if deep else (0, n_layers - 1)
    mid = min(max(n_layers // 2, low + 1), high - 1)
    return (low, mid, high)


@dataclasses.dataclass(frozen=True)
class FeatureDraftConfig:
    """target: the target's TransformerConfig (width, heads, RoPE and vocabulary come from it);
    feature_layers: the target blocks whose outputs are fused (>= 3 distinct, in range);
    n_layers: the draft's decoder blocks; draft_vocab_size: None (the target's vocabulary) or
    N of a reduced map; freeze_embedding: train without updating the copied target embedding."""

    target: TransformerConfig
    feature_layers: tuple[int, ...]
    n_layers: int = 1
    draft_vocab_size: int | None = None
    freeze_embedding: bool = True

    def __post_init__(self):
        object.__setattr__(self, 'feature_layers', tuple(int(i) for i in self.feature_layers))
        layers, n = self.feature_layers, self.target.n_layers
        if len(set(layers)) < MIN_FEATURE_LAYERS or len(set(layers)) != len(layers):
            raise ValueError(
                f'FeatureDraftConfig.feature_layers={layers}: need >= {MIN_FEATURE_LAYERS} '
                'distinct target blocks'
            )
        if any(not 0 <= i < n for i in layers):
            raise ValueError(
                f'FeatureDraftConfig.feature_layers={layers}: every layer must be in [0, '
                f'target n_layers={n})'
            )
        if (
            isinstance(self.n_layers, bool)
            or not isinstance(self.n_layers, int)
            or self.n_layers < 1
        ):
            raise ValueError(
                f'FeatureDraftConfig.n_layers must be an int >= 1, got {self.n_layers!r}'
            )
        v = self.draft_vocab_size
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= self.target.vocab_size
        ):
            raise ValueError(
                f'FeatureDraftConfig.draft_vocab_size={v!r}: must be None or an int in [1, '
                f'target vocab_size={self.target.vocab_size}]'
            )  # fmt: skip

    @classmethod
    def for_target(cls, target_config: TransformerConfig, *, feature_layers=None, n_layers=1,
                   draft_vocab_size=None, freeze_embedding=True) -> FeatureDraftConfig:  # fmt: skip
        """The draft for `target_config`; feature_layers default: default_feature_layers."""
        if feature_layers is None:
            feature_layers = default_feature_layers(target_config.n_layers)
        return cls(
            target_config, tuple(feature_layers), n_layers, draft_vocab_size, freeze_embedding
        )

    @property
    def vocab_size(self) -> int:
        """The draft's output vocabulary (N of a reduced map, else the target's)."""
        return self.draft_vocab_size or self.target.vocab_size

    @property
    def decoder(self) -> TransformerConfig:
        """The config of the draft's own blocks and KV cache (the target's width and heads)."""
        return dataclasses.replace(
            self.target, n_layers=self.n_layers, vocab_size=self.vocab_size,
            tie_embeddings=False, scan_layers=False,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return {
            'target': self.target.to_dict(),
            'feature_layers': list(self.feature_layers),
            'n_layers': self.n_layers,
            'draft_vocab_size': self.draft_vocab_size,
            'freeze_embedding': self.freeze_embedding,
        }

    @classmethod
    def from_dict(cls, d: dict) -> FeatureDraftConfig:
        d = dict(d)
        return cls(TransformerConfig.from_dict(d.pop('target')), **d)


class FeatureDraft(nnx.Module):
    """EAGLE-3-shaped draft (module docstring). Token inputs are target ids; logits float32 over
    config.vocab_size."""

    def __init__(self, config: FeatureDraftConfig, *, rngs: nnx.Rngs):
        self.config = config
        t, e = config.target, config.target.d_model
        n = len(config.feature_layers)
        self.embed = param(rngs, (t.vocab_size, e), ('vocab', 'embed'), t.param_dtype)
        self.fuse = param(rngs, (n * e, e), ('mlp', 'embed'), t.param_dtype)
        self.combine = param(rngs, (2 * e, e), ('mlp', 'embed'), t.param_dtype)
        self.blocks = nnx.List([Block(config.decoder, rngs=rngs) for _ in range(config.n_layers)])
        self.final_norm = RMSNorm(e, t.norm_eps, t.param_dtype, rngs=rngs)
        self.lm_head = param(rngs, (e, config.vocab_size), ('embed', 'vocab'), t.param_dtype)

    def fuse_features(self, target_features_BTNE):
        """Target features [B, T, n, E] (Transformer(..., feature_layers=...)) -> [B, T, E]."""
        b, t, n, e = target_features_BTNE.shape
        x = target_features_BTNE.reshape(b, t, n * e).astype(self.config.target.dtype)
        return x @ self.fuse[...].astype(x.dtype)

    def _step_input(self, tokens_BT, features_BTE):
        dtype = self.config.target.dtype
        emb = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype)
        x = jnp.concatenate([emb, features_BTE.astype(dtype)], -1)
        return x @ self.combine[...].astype(dtype)

    def _head(self, h_BTE):
        x = self.final_norm(h_BTE)
        w = self.lm_head[...].astype(x.dtype)
        return jnp.einsum('bte,ev->btv', x, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens, features, positions=None):
        """tokens int32 [B, T] (x_{t+1}), features [B, T, E] (f_t) -> (logits float32 [B, T, V_d],
        output state [B, T, E]); causal over the T positions."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
        x = self._step_input(tokens, features)
        for block in self.blocks:
            x, _ = block(x, positions, mask)
        return self._head(x), x

    def init_cache(self, batch_size: int, capacity: int) -> kvc.KVCache:
        """An empty KV cache for the draft's own blocks."""
        return kvc.init_cache(self.config.decoder, batch_size, capacity)

    def decode(self, tokens, features, num_valid, cache: kvc.KVCache, positions=None, mask=None):
        """Cached call: tokens [B, T], features [B, T, E], num_valid [B] -> (logits [B, T, V_d],
        output state [B, T, E], cache), as Transformer.decode (written at each row's length,
        advanced by num_valid)."""
        b, t = tokens.shape
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask is None:
            mask = kvc.cached_mask(cache.lengths, t, cache.capacity)
        x = self._step_input(tokens, features)
        kvs = list(zip(cache.k, cache.v))
        for i, block in enumerate(self.blocks):
            x, kvs[i] = block(x, positions, mask, kvs[i], cache.lengths)
        ks, vs = zip(*kvs)
        lengths = cache.lengths + jnp.asarray(num_valid, jnp.int32)
        return self._head(x), x, kvc.KVCache(k=tuple(ks), v=tuple(vs), lengths=lengths)


def from_target(target, config: FeatureDraftConfig, *, rngs: nnx.Rngs) -> FeatureDraft:
    """A FeatureDraft for `target` (a Transformer of config.target) with the target's embedding
    copied in; ValueError naming the field when the target's config is not config.target."""
    if target.config != config.target:
        raise ValueError(
            'from_target: the target model config differs from FeatureDraftConfig.target '
            f'(got {target.config}, expected {config.target})'
        )
    draft = FeatureDraft(config, rngs=rngs)
    draft.embed[...] = target.embed[...]
    return draft
