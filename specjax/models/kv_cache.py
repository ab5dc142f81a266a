"""KV cache: an explicit pytree with per-layer keys/values and per-row lengths.

A cached call writes its T new tokens at each row's own length and advances the row by its count
of valid new tokens; rolling back rejected tokens is lowering a row's length. Entries at or past a
row's length are masked and never read. `lax.dynamic_update_slice` clamps a write that would run
past the end back onto valid entries, so callers check capacity (`check_capacity`) before
compiling: a write at length L of T tokens needs L + T <= capacity.

Two layouts, chosen by the model's config (`init_cache`): per-layer tuples for unrolled blocks,
and for scan_layers one array per k and v stacked on a leading layer axis, which the scanned
blocks read and update in place inside their `lax.scan` (no stacking or splitting per call).
Code that rewrites cache entries goes through `map_layers`, which takes either layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.config import TransformerConfig


@struct.dataclass
class KVCache:
    """k, v: per layer [B, capacity, n_kv_heads, head_dim] (a tuple), or stacked
    [n_layers, B, capacity, n_kv_heads, head_dim] (one array, scan_layers models);
    lengths: int32 [B] valid entries."""

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    lengths: jax.Array

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def capacity(self) -> int:
        return self.k.shape[2] if self.stacked else self.k[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1] if self.stacked else self.k[0].shape[0]


def map_layers(fn, cache: KVCache) -> KVCache:
    """`cache` with fn([B, capacity, K, D]) -> same shape applied to every layer's k and v, in
    either layout (stacked: vmapped over the layer axis)."""
    if cache.stacked:
        return cache.replace(k=jax.vmap(fn)(cache.k), v=jax.vmap(fn)(cache.v))
    return cache.replace(k=tuple(map(fn, cache.k)), v=tuple(map(fn, cache.v)))


def check_capacity(capacity: int, needed: int, what: str = 'cache capacity') -> None:
    """Raises ValueError if `needed` positions do not fit in `capacity` (before any compile)."""
    if needed > capacity:
        raise ValueError(
            f'{what}: needs {needed} positions but the cache capacity is {capacity}; '
            'writes past the end would be clamped onto valid entries'
        )


def init_cache(
    cfg: TransformerConfig, batch_size: int, capacity: int, lengths=None, dtype=None
) -> KVCache:
    """An empty (or `lengths`-prefilled-with-zeros) cache of `capacity` <= cfg.max_len positions,
    stacked on a leading layer axis when cfg.scan_layers (the layout the scanned blocks update)."""
    if capacity < 1 or capacity > cfg.max_len:
        raise ValueError(
            f'cache capacity={capacity} must be in [1, max_len={cfg.max_len}] '
            '(TransformerConfig.max_len bounds every position, scratch positions included)'
        )
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (batch_size, capacity, cfg.n_kv_heads, cfg.head_dim)
    if lengths is None:
        lengths = jnp.zeros((batch_size,), jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if cfg.scan_layers:
        stacked = (cfg.n_layers, *shape)
        return KVCache(k=jnp.zeros(stacked, dtype), v=jnp.zeros(stacked, dtype), lengths=lengths)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
    return KVCache(k=zeros(), v=zeros(), lengths=lengths)


def write(cache_BCKD, new_BTKD, lengths_B):
    """Writes each row's T new entries at that row's length."""
    update = lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (i, 0, 0))
    return jax.vmap(update)(cache_BCKD, new_BTKD.astype(cache_BCKD.dtype), lengths_B)


def cached_mask(lengths_B, num_new: int, capacity: int):
    """[B, T, capacity] mask: query t of row b (at position lengths[b] + t) sees keys j <= it."""
    query_pos = lengths_B[:, None] + jnp.arange(num_new)[None, :]
    return jnp.arange(capacity)[None, None, :] <= query_pos[:, :, None]


def gather_window(cache_BCKD, starts_B, order_BW):
    """Per row, rewrites the W entries from starts[b] as entries starts[b] + order[b, :].

    Compacts a kept path of tree nodes into place (order[b, j] = where the j-th kept entry
    sits, relative to starts[b]); entries past what a row keeps are don't-care.
    """

    def one(c, s, o):
        window = jax.lax.dynamic_slice_in_dim(c, s, o.shape[0], axis=0)
        return jax.lax.dynamic_update_slice_in_dim(c, window[o], s, axis=0)

    return jax.vmap(one)(cache_BCKD, starts_B, order_BW)
