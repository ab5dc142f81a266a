"""The one decoder every role shares (target, draft, teacher, student): Llama-style, Flax NNX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models import kv_cache as kvc
from specjax.models.config import TransformerConfig
from specjax.models.layers import Attention, RMSNorm, SwiGLU, param
from specjax.models.layout import stack_layers


class Block(nnx.Module):
    """Pre-norm residual block: attention then SwiGLU."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x_BTE, positions_BT, mask_BTS, cache_kv=None, lengths_B=None):
        """Without cache_kv, attends within the T tokens; with (k, v) caches, attends over them
        and this call's entries -> (x, this call's (k, v) entries) (Attention)."""
        out, kv = self.attn(self.attn_norm(x_BTE), positions_BT, mask_BTS, cache_kv, lengths_B)
        x_BTE = x_BTE + out
        return x_BTE + self.mlp(self.mlp_norm(x_BTE)), kv


class Transformer(nnx.Module):
    """Decoder-only LM: embed -> n_layers blocks -> RMSNorm -> (tied or untied) float32 logits.

    With config.scan_layers, `blocks` is one Block whose parameters are stacked on a leading
    [n_layers] axis and the layers run as one `lax.scan` body; built from the same random draws
    as the unstacked model (so the two equal each other under `layout.stack_layers`).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'), cfg.param_dtype)
        blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)]
        if cfg.scan_layers:
            graphdef = nnx.graphdef(blocks[0])
            per_layer = {'blocks': {i: nnx.state(b) for i, b in enumerate(blocks)}}
            self.blocks = nnx.merge(graphdef, stack_layers(per_layer)['blocks'])
        else:
            self.blocks = nnx.List(blocks)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(
                rngs, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'), cfg.param_dtype
            )

    def _embed(self, tokens_BT):
        """The lookup reads the table with its embed dimension whole (under a mesh set by the
        train steps, see parallel.on_mesh): FSDP's all-gather of a weight before use, whose
        transpose reduce-scatters the gradient. Without it XLA must move the batch-sharded
        cotangent [B, T, E] onto the table's embed sharding (batch over data x fsdp -> embed
        over fsdp), which it can only do by gathering it whole ('involuntary full
        rematerialization' on a (2, 2, 2) mesh)."""
        table_VE = self.embed[...]
        if not jax.sharding.get_abstract_mesh().empty:
            spec = jax.sharding.PartitionSpec(jax.sharding.PartitionSpec.UNCONSTRAINED, None)
            table_VE = jax.lax.with_sharding_constraint(table_VE, spec)
        return jnp.take(table_VE, tokens_BT, axis=0).astype(self.config.dtype)

    def _run_blocks(self, x_BTE, positions_BT, mask_BTS, cache=None, feature_layers=()):
        """All blocks in order -> (x, this call's entries (per-layer k tuple, per-layer v tuple;
        stacked arrays for scan_layers) or None without a cache, features): features [B, T,
        len(feature_layers), E], the output of each listed block (None when none are listed:
        then nothing extra is computed or kept). The cache is only read."""
        if self.config.scan_layers:
            return self._scan_blocks(x_BTE, positions_BT, mask_BTS, cache, feature_layers)
        lengths = None if cache is None else cache.lengths
        kvs = [None] * self.config.n_layers if cache is None else list(zip(cache.k, cache.v))
        outputs = {}
        for i, block in enumerate(self.blocks):
            x_BTE, kvs[i] = block(x_BTE, positions_BT, mask_BTS, kvs[i], lengths)
            if i in feature_layers:
                outputs[i] = x_BTE
        features = jnp.stack([outputs[i] for i in feature_layers], 2) if feature_layers else None
        return x_BTE, None if cache is None else tuple(zip(*kvs)), features

    def _scan_blocks(self, x_BTE, positions_BT, mask_BTS, cache, feature_layers=()):
        """The stacked blocks as one `lax.scan` body over their leading layer axis.

        The cache is stacked too (a leading n_layers axis, `init_cache` for this config): layer
        i reads its slice and the scan emits its new entries, stacked as the cache (the caller
        writes them). Features: the scan also emits every layer's output [n_layers, B, T, E]
        (only when asked), then the listed layers are taken from it.
        """
        graphdef, stacked = nnx.split(self.blocks)
        if cache is not None and not cache.stacked:
            raise ValueError(
                'a scan_layers model takes a stacked KV cache (a leading n_layers axis): '
                'build it with init_cache(config, ...)'
            )
        lengths = None if cache is None else cache.lengths
        kv_L = None if cache is None else (cache.k, cache.v)

        def body(x, layer):
            params, i = layer
            kv = None if kv_L is None else tuple(a_L[i] for a_L in kv_L)
            x, new_kv = nnx.merge(graphdef, params)(x, positions_BT, mask_BTS, kv, lengths)
            return x, (x if feature_layers else None, None if kv_L is None else new_kv)

        layers = (stacked, jnp.arange(self.config.n_layers))
        x_BTE, (x_LBTE, new_kv_L) = jax.lax.scan(body, x_BTE, layers)
        features = None
        if feature_layers:
            features = jnp.moveaxis(x_LBTE[jnp.asarray(feature_layers)], 0, 2)
        return x_BTE, new_kv_L, features

    def _feature_layers(self, feature_layers) -> tuple[int, ...]:
        """The requested layers as a tuple of ints in [0, n_layers); ValueError otherwise."""
        layers = tuple(int(i) for i in feature_layers)
        bad = [i for i in layers if not 0 <= i < self.config.n_layers]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(
                f'feature_layers={layers}: each must be a distinct block index in '
                f'[0, n_layers={self.config.n_layers})'
            )
        return layers

    def _logits(self, x_BTE):
        x = self.final_norm(x_BTE)
        if self.config.tie_embeddings:
            w = self.embed[...].astype(self.config.dtype)
            return jnp.einsum('bte,ve->btv', x, w, preferred_element_type=jnp.float32)
        w = self.lm_head[...].astype(self.config.dtype)
        return jnp.einsum('bte,ev->btv', x, w, preferred_element_type=jnp.float32)

    def __call__(
        self, tokens, positions=None, segment_ids=None, *, feature_layers=(), logits_at=None
    ):
        """tokens int32 [B, T] -> logits float32 [B, T, V]; with logits_at int32 [B, E] (indices
        into T) -> logits [B, E, V] of those positions only (the output head, the widest matrix
        of a small-vocabulary draft's step, runs on E rows instead of T).

        Causal; with segment_ids [B, T] (0 = padding) attention is block-diagonal, so packed
        documents never see each other. positions default to 0..T-1 per row. With
        feature_layers (block indices, static) -> (logits, features [B, T, n, E]): the hidden
        state after each listed block, in the order listed (the features a feature draft reads).
        """
        feature_layers = self._feature_layers(feature_layers)
        b, t = tokens.shape
        if t > self.config.max_len:
            raise ValueError(
                f'sequence length {t} is above TransformerConfig.max_len={self.config.max_len}'
            )
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.tril(jnp.ones((t, t), bool))[None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        mask = jnp.broadcast_to(mask, (b, t, t))
        x, _, features = self._run_blocks(
            self._embed(tokens), positions, mask, None, feature_layers
        )
        if logits_at is not None:
            x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[..., None], axis=1)
        return (self._logits(x), features) if feature_layers else self._logits(x)

    def decode(
        self,
        tokens,
        num_valid,
        cache: kvc.KVCache,
        positions=None,
        mask=None,
        *,
        feature_layers=(),
        write=True,
    ):
        """Cached call: tokens int32 [B, T], num_valid int32 [B] -> (logits [B, T, V], cache).

        Writes all T tokens at each row's cache length and advances each row by num_valid[b]; logits
        at t >= num_valid[b] are meaningless. Prefill (right-padded prompts), one-token decode, the
        draft's 1-2 token catch-up and (k+1)-token verification all use this path. Token trees
        pass positions int32 [B, T] (default: length + t) and mask bool [B, T, capacity] (default:
        causal over the cache) to score tree nodes with an ancestor-only mask. With
        feature_layers -> (logits, cache, features [B, T, n, E]) as in `__call__`: a
        verification call returns the features of the positions it scored. With write=False the
        cache is only read and, in its place, the call's T new entries come back (a KVCache of
        capacity T, lengths the rows' lengths: `kv_cache.write_entries` writes them), so a call
        picked by `lax.switch` leaves the write to one place after it.
        """
        feature_layers = self._feature_layers(feature_layers)
        b, t = tokens.shape
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask is None:
            mask = kvc.cached_mask(cache.lengths, t, cache.capacity)
        x, (ks, vs), features = self._run_blocks(
            self._embed(tokens), positions, mask, cache, feature_layers
        )
        new_cache = kvc.KVCache(k=ks, v=vs, lengths=cache.lengths)
        if write:
            new_cache = kvc.write_entries(cache, new_cache, num_valid)
        if feature_layers:
            return self._logits(x), new_cache, features
        return self._logits(x), new_cache
