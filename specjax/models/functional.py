"""The pure functional core that jitted code calls: (graphdef, params) instead of a live module.

Use these inside `jax.jit`, not `nnx.jit` (its per-call overhead: docs/performance.md): the
module is rebuilt from `params` at trace time only.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer


def split(model: Transformer):
    """Returns (graphdef, params): the static structure and an nnx.State of all parameters."""
    return nnx.split(model)


def merge(graphdef, params) -> Transformer:
    return nnx.merge(graphdef, params)


def abstract_model(cfg):
    """(graphdef, abstract params: an nnx.State of ShapeDtypeStructs) of Transformer(cfg),
    allocating nothing. Traced once per config in a process; every call gets its own copy of
    the state (callers may fill its variables)."""
    graphdef, state = _abstract_model(cfg)
    return graphdef, jax.tree.map(lambda x: x, state)


@functools.lru_cache(maxsize=16)
def _abstract_model(cfg):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def apply(
    graphdef, params, tokens, positions=None, segment_ids=None, *, feature_layers=(),
    logits_at=None,
):  # fmt: skip
    """Uncached forward: int32 [B, T] -> float32 logits [B, T, V]; with feature_layers (static
    block indices) -> (logits, features [B, T, n, E]); with logits_at int32 [B, E] the logits of
    those positions only, [B, E, V] (Transformer.__call__)."""
    model = merge(graphdef, params)
    return model(
        tokens, positions=positions, segment_ids=segment_ids, feature_layers=feature_layers,
        logits_at=logits_at,
    )  # fmt: skip


def apply_cached(
    graphdef,
    params,
    tokens,
    num_valid,
    cache: KVCache,
    positions=None,
    mask=None,
    *,
    feature_layers=(),
    write=True,
):
    """Cached forward: (tokens [B, T], num_valid [B], cache) -> (logits [B, T, V], cache), with
    feature_layers -> (logits, cache, features [B, T, n, E]) (Transformer.decode).

    positions [B, T] / mask [B, T, capacity] override the defaults (token trees); write=False
    returns the call's new entries in place of the cache (Transformer.decode).
    """
    model = merge(graphdef, params)
    return model.decode(
        tokens, num_valid, cache, positions, mask, feature_layers=feature_layers, write=write
    )
