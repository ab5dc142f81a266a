"""KV cache: an explicit pytree with per-layer keys/values and per-row lengths.

A cached call writes its T new tokens at each row's own length and advances the row by its count
of valid new tokens; rolling back rejected tokens is lowering a row's length. Entries at or past a
row's length are masked and never read. `lax.dynamic_update_slice` clamps a write that would run
past the end back onto valid entries, so callers check capacity (`check_capacity`) before
compiling: a write at length L of T tokens needs L + T <= capacity.

Heads-major, contracted axis last: keys are kept as [B, K, capacity, D] and values as
[B, K, D, capacity], so each of attention's two contractions (scores q·k over D, then probs·v
over the capacity) reads its cache operand with the contracted axis minor-most, the layout
XLA:CPU's dot wants: it then reads the cache in place instead of transposing every layer's keys
and values on every call (docs/performance.md, "Verification cost").

Two layouts, chosen by the model's config (`init_cache`): per-layer tuples for unrolled blocks,
and for scan_layers one array per k and v stacked on a leading layer axis, which the scanned
blocks read inside their `lax.scan` and `write_entries` updates in place after it (no stacking
or splitting per call).
Code that rewrites cache entries goes through `map_layers`, which takes either layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.config import TransformerConfig


@struct.dataclass
class KVCache:
    """k: per layer [B, n_kv_heads, capacity, head_dim], v: per layer [B, n_kv_heads, head_dim,
    capacity] (tuples), or each stacked on a leading n_layers axis (one array, scan_layers
    models); lengths: int32 [B] valid entries."""

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    lengths: jax.Array

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def capacity(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-2]

    @property
    def batch_size(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-4]


# Compiler options for programs that decode in a loop (the samplers, calibration): XLA:CPU's copy
# insertion with region analysis sees that a loop body which reads a layer's cache (attention over
# the cache as it was: specjax.models.layers) and then updates it in place needs no copy; its
# default analysis copies every layer's keys and values on every step. An XLA:CPU option, which
# other backends do not read.
DECODE_COMPILER_OPTIONS = {'xla_cpu_copy_insertion_use_region_analysis': True}

K_CAPACITY_AXIS = 2  # of a layer's keys [B, K, capacity, D]
V_CAPACITY_AXIS = 3  # of a layer's values [B, K, D, capacity]


def map_layers(fn, cache: KVCache) -> KVCache:
    """`cache` with fn(array, capacity_axis) -> same shape applied to every layer's k ([B, K, C,
    D], axis 2) and v ([B, K, D, C], axis 3), in either layout (stacked: vmapped over layers)."""
    fk = lambda a: fn(a, K_CAPACITY_AXIS)
    fv = lambda a: fn(a, V_CAPACITY_AXIS)
    if cache.stacked:
        return cache.replace(k=jax.vmap(fk)(cache.k), v=jax.vmap(fv)(cache.v))
    return cache.replace(k=tuple(map(fk, cache.k)), v=tuple(map(fv, cache.v)))


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
    stacked on a leading layer axis when cfg.scan_layers (the layout the scanned blocks read)."""
    if capacity < 1 or capacity > cfg.max_len:
        raise ValueError(
            f'cache capacity={capacity} must be in [1, max_len={cfg.max_len}] '
            '(TransformerConfig.max_len bounds every position, scratch positions included)'
        )
    dtype = jnp.dtype(dtype or cfg.dtype)
    k_shape = (batch_size, cfg.n_kv_heads, capacity, cfg.head_dim)
    v_shape = (batch_size, cfg.n_kv_heads, cfg.head_dim, capacity)
    if lengths is None:
        lengths = jnp.zeros((batch_size,), jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if cfg.scan_layers:
        layers = lambda shape: jnp.zeros((cfg.n_layers, *shape), dtype)
        return KVCache(k=layers(k_shape), v=layers(v_shape), lengths=lengths)
    zeros = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
    return KVCache(k=zeros(k_shape), v=zeros(v_shape), lengths=lengths)


def _scatter_rows(cache, new, lengths_B, axis: int):
    """cache [B, ...] with each row's T entries of `new` (the same layout, T on `axis`)
    written at positions lengths[b] + t of its capacity `axis` (an in-place scatter)."""
    positions_BT = lengths_B[:, None] + jnp.arange(new.shape[axis], dtype=jnp.int32)[None, :]
    index = (slice(None),) * (axis - 1)
    update = lambda c, n, p: c.at[(*index, p)].set(n, unique_indices=True, indices_are_sorted=True)
    return jax.vmap(update)(cache, new.astype(cache.dtype), positions_BT)


def write_entries(cache: KVCache, new: KVCache, num_valid_B) -> KVCache:
    """`cache` with a cached call's new entries written and each row advanced by num_valid[b].

    `new` holds the T entries per layer in the cache's layout and dtype (a KVCache of capacity
    T, either layout as `cache`'s); row b's go to positions lengths[b] + t.
    """
    write = lambda axis: lambda c, n: _scatter_rows(c, n, cache.lengths, axis)
    if cache.stacked:
        k = jax.vmap(write(K_CAPACITY_AXIS))(cache.k, new.k)
        v = jax.vmap(write(V_CAPACITY_AXIS))(cache.v, new.v)
    else:
        k = tuple(map(write(K_CAPACITY_AXIS), cache.k, new.k))
        v = tuple(map(write(V_CAPACITY_AXIS), cache.v, new.v))
    return KVCache(k=k, v=v, lengths=cache.lengths + jnp.asarray(num_valid_B, jnp.int32))


def cached_mask(lengths_B, num_new: int, capacity: int):
    """[B, T, capacity] mask: query t of row b (at position lengths[b] + t) sees keys j <= it."""
    query_pos = lengths_B[:, None] + jnp.arange(num_new)[None, :]
    return jnp.arange(capacity)[None, None, :] <= query_pos[:, :, None]


def split_mask(mask_BTC, lengths_B, num_new: int):
    """A cached call's mask [B, T, capacity] split into what its queries see of the cache as it
    was (bool [B, T, capacity]: the T slots from each row's length, which this call overwrites,
    hidden) and of its own new entries (bool [B, T, T]: the mask at slots lengths[b] + u)."""
    b, t, capacity = mask_BTC.shape
    slots_BU = lengths_B[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]
    slot_C = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    overwritten_BC = (slot_C >= lengths_B[:, None]) & (slot_C < lengths_B[:, None] + num_new)
    slots_BTU = jnp.broadcast_to(slots_BU[:, None, :], (b, t, num_new))
    new_BTT = jnp.take_along_axis(mask_BTC, slots_BTU, axis=2)
    return mask_BTC & ~overwritten_BC[:, None, :], new_BTT


def gather_window(cache_B, starts_B, order_BW, axis: int):
    """Per row, rewrites the W entries from starts[b] along the capacity `axis` (of the batched
    array: 2 for keys, 3 for values) as entries starts[b] + order[b, :].

    Compacts a kept path of tree nodes into place (order[b, j] = where the j-th kept entry
    sits, relative to starts[b]); entries past what a row keeps are don't-care.
    """
    row_axis = axis - 1

    def one(c, s, o):
        window = jax.lax.dynamic_slice_in_dim(c, s, o.shape[0], axis=row_axis)
        moved = jnp.take(window, o, axis=row_axis)
        return jax.lax.dynamic_update_slice_in_dim(c, moved, s, axis=row_axis)

    return jax.vmap(one)(cache_B, starts_B, order_BW)
