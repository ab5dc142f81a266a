"""Logical axis names -> mesh shardings, by the explicit rules held in config.mesh.rules."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

# The stacked layer axis of scan_layers models (specjax.models.layout) replicates unless the
# rules say otherwise, so rules written before that option still cover every parameter.
IMPLICIT_RULES = (('layers', None),)


def _rules_dict(rules) -> dict:
    table = {name: (tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules}
    return {**dict(IMPLICIT_RULES), **table}


def logical_to_spec(logical_axes, rules) -> PartitionSpec:
    """('embed', 'mlp') -> PartitionSpec('fsdp', 'tensor'); an unknown logical axis is an error.

    A mesh axis already used by an earlier dimension is not reused (that dimension replicates).
    """
    table = _rules_dict(rules)
    used, out = set(), []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(
                f'logical axis {name!r} has no rule in config.mesh.rules '
                f'(rules cover {sorted(table)})'
            )
        axes = table[name]
        flat = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        if any(a in used for a in flat):
            out.append(None)
            continue
        used.update(flat)
        out.append(axes)
    return PartitionSpec(*out)


def param_shardings(mesh, params, rules):
    """NamedSharding tree matching `params` (an nnx.State whose Params carry logical axes)."""
    specs = nnx.get_partition_spec(params)
    to_sharding = lambda spec: NamedSharding(mesh, logical_to_spec(tuple(spec), rules))
    return jax.tree.map(to_sharding, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh, rules) -> NamedSharding:
    """Sharding of [B, ...] batch arrays: B over the 'batch' rule, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(('batch',), rules))


def on_mesh(fn, mesh):
    """`fn` traced with `mesh` as the abstract mesh, so model code can pin the layout of an
    intermediate by a bare PartitionSpec (the Transformer's embedding lookup does)."""

    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_divisible(params, shardings) -> None:
    """Raises ValueError naming the parameter whose dimension does not split evenly on the mesh."""
    flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_s = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, value), sharding in zip(flat_p, flat_s, strict=True):
        for dim, axes in zip(value.shape, sharding.spec, strict=False):
            if axes is None:
                continue
            axes = axes if isinstance(axes, tuple) else (axes,)
            size = 1
            for a in axes:
                size *= sharding.mesh.shape[a]
            if dim % size:
                name = jax.tree_util.keystr(path)
                raise ValueError(
                    f'parameter {name} dimension {dim} does not divide over mesh axes {axes} '
                    f'(size {size})'
                )


# Logical axes of the KV cache arrays (specjax.models.kv_cache's heads-major layout: keys
# [B, K, capacity, D], values [B, K, D, capacity]) and of the per-row lengths. CACHE_AXES: every
# logical axis a cache uses (each needs a rule).
KEY_AXES = ('batch', 'kv_heads', 'length', 'head_dim')
VALUE_AXES = ('batch', 'kv_heads', 'head_dim', 'length')
CACHE_AXES = KEY_AXES
LENGTHS_AXES = ('batch',)


def axes_size(mesh, axes) -> int:
    """Number of shards a PartitionSpec entry (None, a mesh axis or a tuple of them) makes."""
    flat = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = 1
    for a in flat:
        size *= mesh.shape[a]
    return size


def _divisible_spec(spec, shape, mesh) -> PartitionSpec:
    return PartitionSpec(
        *(a if d % axes_size(mesh, a) == 0 else None for d, a in zip(shape, spec, strict=False))
    )


def cache_shardings(mesh, rules, cache):
    """Shardings of a KVCache: keys over KEY_AXES, values over VALUE_AXES (a stacked cache's
    leading layer axis unsharded), lengths over the batch.

    A dimension that does not divide over its mesh axes (kv heads of a small draft) replicates.
    """
    lengths = NamedSharding(mesh, logical_to_spec(LENGTHS_AXES, rules))
    lead = (None,) if cache.stacked else ()  # a stacked cache's layer axis: whole
    specs = [PartitionSpec(*lead, *logical_to_spec(a, rules)) for a in (KEY_AXES, VALUE_AXES)]
    shard = lambda spec: lambda x: NamedSharding(mesh, _divisible_spec(spec, x.shape, mesh))
    fk, fv = shard(specs[0]), shard(specs[1])
    if cache.stacked:
        return type(cache)(k=fk(cache.k), v=fv(cache.v), lengths=lengths)
    return type(cache)(k=tuple(map(fk, cache.k)), v=tuple(map(fv, cache.v)), lengths=lengths)


def constrain_cache(cache, mesh, rules):
    """`cache` with its layout pinned inside jit (batch and, where divisible, kv heads)."""
    return jax.lax.with_sharding_constraint(cache, cache_shardings(mesh, rules, cache))


def check_model_on_mesh(cfg, mesh, rules, who: str, rules_field: str) -> None:
    """Clear errors before compiling: heads / kv heads that do not split over the tensor axes of
    `rules`, and logical axes (of parameters and caches) that have no rule."""
    for name in CACHE_AXES:
        logical_to_spec((name,), rules)
    for logical, field in (('heads', 'n_heads'), ('kv_heads', 'n_kv_heads')):
        axes = logical_to_spec((logical,), rules)[0]
        size = axes_size(mesh, axes)
        value = getattr(cfg, field)
        if value % size:
            raise ValueError(
                f'{who} TransformerConfig.{field}={value} does not divide over mesh axes '
                f'{axes} (size {size}) that {rules_field} maps {logical!r} to; give this model '
                "rules that replicate it (e.g. draft_rules='data_parallel')"
            )


def check_batch(batch: int, mesh, rules) -> None:
    """The global batch must split evenly over the mesh axes of the 'batch' rule."""
    axes = logical_to_spec(('batch',), rules)[0]
    size = axes_size(mesh, axes)
    if batch % size:
        raise ValueError(
            f'global batch size B={batch} does not divide over the data-parallel size {size} '
            f"(mesh axes {axes} of the 'batch' rule, mesh {dict(mesh.shape)})"
        )
