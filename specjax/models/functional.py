"""The pure functional core that jitted code calls: (graphdef, params) instead of a live module.

Use these inside `jax.jit`, not `nnx.jit` (its per-call overhead: docs/performance.md): the
module is rebuilt from `params` at trace time only.
"""

from __future__ import annotations

from flax import nnx

from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer


def split(model: Transformer):
    """Returns (graphdef, params): the static structure and an nnx.State of all parameters."""
    return nnx.split(model)


def merge(graphdef, params) -> Transformer:
    return nnx.merge(graphdef, params)


def apply(graphdef, params, tokens, positions=None, segment_ids=None):
    """Uncached forward: int32 [B, T] -> float32 logits [B, T, V]."""
    return merge(graphdef, params)(tokens, positions=positions, segment_ids=segment_ids)


def apply_cached(graphdef, params, tokens, num_valid, cache: KVCache, positions=None, mask=None):
    """Cached forward: (tokens [B, T], num_valid [B], cache) -> (logits [B, T, V], cache).

    positions [B, T] / mask [B, T, capacity] override the defaults (token trees).
    """
    return merge(graphdef, params).decode(tokens, num_valid, cache, positions, mask)
