"""EAGLE-3's Llama draft (the layer vLLM's and SGLang's `llama_eagle3.py` load), Flax NNX.

Positions. Draft entry t pairs the context token c_t with the target feature f_{t-1}: the fused
target hidden state after the target consumed c_{t-1} (f_{-1} = zeros); entry t predicts
c_{t+1}. Past the target's last scored position the draft's own output state at t-1 stands in
for f_{t-1} (feature-level autoregression). vLLM and SGLang feed the same pairs (their draft
entry j is (c_{j+1}, h_j)) at RoPE position j, i.e. one below this module's default position t
for the same pair: a uniform offset, which RoPE's relative scores do not see. They have no
(c_0, zeros) entry, so here entry 0 is seen by itself only (every mask, given or default, hides
key position 0 from queries at positions > 0): it gives q_1 for a one-token prompt and leaves
every later entry's output as the loaders compute it.

Per entry: fuse_features turns the target's hidden states after the blocks `feature_layers`
[B, T, n, E] into f = fc(concat) [B, T, E]; the first layer (specjax.models.eagle3_layer:
input_norm(embed(c_t)) and hidden_norm(f) concatenated [2E] into attention, residual f, then a
Llama MLP), n_layers - 1 standard Llama blocks, a final norm and a head over the draft's
vocabulary: the full target vocabulary, or the N ids of a reduced map (the `draft_vocab_ids` of
specjax.sampling.draft_vocab, draft index i = target id ids[i]). The residual stream before the
final norm is the output state, fed back at the next entry. specjax.interop.eagle3 writes and
reads this draft in the loaders' checkpoint format.

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
from specjax.models.eagle3_layer import Eagle3FirstLayer
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
    N of a reduced map; freeze_embedding: train without updating the copied target embedding;
    norm_before_residual: the first layer's residual is hidden_norm(f) instead of f (a vLLM
    option; SGLang has only False)."""

    target: TransformerConfig
    feature_layers: tuple[int, ...]
    n_layers: int = 1
    draft_vocab_size: int | None = None
    freeze_embedding: bool = True
    norm_before_residual: bool = False

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
        if not isinstance(self.norm_before_residual, bool):
            raise ValueError(
                'FeatureDraftConfig.norm_before_residual must be a bool, got '
                f'{self.norm_before_residual!r}'
            )

    @classmethod
    def for_target(cls, target_config: TransformerConfig, *, feature_layers=None, n_layers=1,
                   draft_vocab_size=None, freeze_embedding=True,
                   norm_before_residual=False) -> FeatureDraftConfig:  # fmt: skip
        """The draft for `target_config`; feature_layers default: default_feature_layers."""
        if feature_layers is None:
            feature_layers = default_feature_layers(target_config.n_layers)
        return cls(
            target_config, tuple(feature_layers), n_layers, draft_vocab_size, freeze_embedding,
            norm_before_residual,
        )  # fmt: skip

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
        } | ({'norm_before_residual': True} if self.norm_before_residual else {})

    @classmethod
    def from_dict(cls, d: dict) -> FeatureDraftConfig:
        d = dict(d)
        return cls(TransformerConfig.from_dict(d.pop('target')), **d)


class FeatureDraft(nnx.Module):
    """EAGLE-3's Llama draft (module docstring). Token inputs are target ids; logits float32
    over config.vocab_size. Parameters: embed [V, E] (the target's), fuse [n*E, E] (fc),
    first (Eagle3FirstLayer), blocks (n_layers - 1 Llama blocks), final_norm, lm_head [E, V_d]."""

    def __init__(self, config: FeatureDraftConfig, *, rngs: nnx.Rngs):
        self.config = config
        t, e = config.target, config.target.d_model
        n = len(config.feature_layers)
        self.embed = param(rngs, (t.vocab_size, e), ('vocab', 'embed'), t.param_dtype)
        self.fuse = param(rngs, (n * e, e), ('mlp', 'embed'), t.param_dtype)
        self.first = Eagle3FirstLayer(
            config.decoder, norm_before_residual=config.norm_before_residual, rngs=rngs
        )
        self.blocks = nnx.List(
            [Block(config.decoder, rngs=rngs) for _ in range(config.n_layers - 1)]
        )
        self.final_norm = RMSNorm(e, t.norm_eps, t.param_dtype, rngs=rngs)
        self.lm_head = param(rngs, (e, config.vocab_size), ('embed', 'vocab'), t.param_dtype)

    def fuse_features(self, target_features_BTNE):
        """Target features [B, T, n, E] (Transformer(..., feature_layers=...)) -> [B, T, E]:
        fc(concat over n, in feature_layers order)."""
        b, t, n, e = target_features_BTNE.shape
        x = target_features_BTNE.reshape(b, t, n * e).astype(self.config.target.dtype)
        return x @ self.fuse[...].astype(x.dtype)

    def _layers(self, tokens_BT, features_BTE, positions, mask, kvs=None, lengths=None):
        """All layers -> (output state [B, T, E], per-layer (k, v) list: this call's entries;
        `kvs`, the caches, are only read)."""
        dtype = self.config.target.dtype
        emb = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype)
        kvs = kvs or [None] * self.config.n_layers
        x, kv0 = self.first(emb, features_BTE.astype(dtype), positions, mask, kvs[0], lengths)
        out = [kv0]
        for i, block in enumerate(self.blocks, start=1):
            x, kv = block(x, positions, mask, kvs[i], lengths)
            out.append(kv)
        return x, out

    @staticmethod
    def _hide_entry_zero(mask_BTS, query_positions_BT, key_positions_BS):
        """mask without key position 0 for queries at positions > 0 (module docstring)."""
        zero_key = key_positions_BS[:, None, :] == 0
        return mask_BTS & ~(zero_key & (query_positions_BT[:, :, None] > 0))

    def _head(self, h_BTE):
        x = self.final_norm(h_BTE)
        w = self.lm_head[...].astype(x.dtype)
        return jnp.einsum('bte,ev->btv', x, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens_BT, features_BTE, positions=None, mask=None):
        """tokens int32 [B, T] (c_t), features [B, T, E] (f_{t-1}) -> (logits float32
        [B, T, V_d], output state [B, T, E]). positions int32 [B, T] default 0..T-1; mask bool
        [B, T, T] (query t sees key s) default causal; key position 0 is hidden from later
        positions in either case."""
        b, t = tokens_BT.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if mask is None:
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
        mask = self._hide_entry_zero(mask, positions, positions)
        x, _ = self._layers(tokens_BT, features_BTE, positions, mask)
        return self._head(x), x

    def init_cache(self, batch_size: int, capacity: int) -> kvc.KVCache:
        """An empty KV cache for the draft's n_layers layers."""
        return kvc.init_cache(self.config.decoder, batch_size, capacity)

    def decode(self, tokens, features, num_valid, cache: kvc.KVCache, positions=None, mask=None,
               key_positions=None):  # fmt: skip
        """Cached call: tokens [B, T], features [B, T, E], num_valid [B] -> (logits [B, T, V_d],
        output state [B, T, E], cache), as Transformer.decode (written at each row's length,
        advanced by num_valid; positions default length + t, mask bool [B, T, capacity]
        default causal over the cache). key_positions int32 [B, capacity]: the position of the
        entry each slot holds, default the slot's index; slots holding position 0 are hidden
        from queries at positions > 0 (module docstring)."""
        b, t = tokens.shape
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask is None:
            mask = kvc.cached_mask(cache.lengths, t, cache.capacity)
        if key_positions is None:
            key_positions = jnp.arange(cache.capacity, dtype=jnp.int32)
            key_positions = jnp.broadcast_to(key_positions, (b, cache.capacity))
        mask = self._hide_entry_zero(mask, positions, key_positions)
        kvs = list(zip(cache.k, cache.v))
        x, kvs = self._layers(tokens, features, positions, mask, kvs, cache.lengths)
        ks, vs = zip(*kvs)
        new = kvc.KVCache(k=tuple(ks), v=tuple(vs), lengths=cache.lengths)
        return self._head(x), x, kvc.write_entries(cache, new, num_valid)


def from_target(
    target, config: FeatureDraftConfig, *, rngs: nnx.Rngs, head_ids=None
) -> FeatureDraft:
    """A FeatureDraft for `target` (a Transformer of config.target) with the target's embedding
    copied in; ValueError naming the field when the target's config is not config.target.

    head_ids: None (the head and final norm from `rngs`, EAGLE-3's start) or the draft's
    vocabulary as target ids, int [config.vocab_size] (arange for the full vocabulary): the final
    norm and head start as the target's, the head holding the target's output columns of those
    ids, so the draft's logits of an output state equal the target's logits of it at head_ids."""
    if target.config != config.target:
        raise ValueError(
            'from_target: the target model config differs from FeatureDraftConfig.target '
            f'(got {target.config}, expected {config.target})'
        )
    draft = FeatureDraft(config, rngs=rngs)
    draft.embed[...] = target.embed[...]
    if head_ids is not None:
        ids = jnp.asarray(head_ids, jnp.int32)
        if ids.shape != (config.vocab_size,):
            raise ValueError(
                f'from_target: head_ids has shape {ids.shape}, the draft vocabulary needs '
                f'({config.vocab_size},)'
            )
        out_EV = target.embed[...].T if config.target.tie_embeddings else target.lm_head[...]
        draft.lm_head[...] = jnp.take(out_EV, ids, axis=1).astype(draft.lm_head[...].dtype)
        draft.final_norm.scale[...] = target.final_norm.scale[...]
    return draft
