"""The two layouts of a Transformer's blocks, and exact conversions between them.

Unstacked (TransformerConfig.scan_layers=False): params['blocks'] = {0: block_0, 1: block_1, ...},
one tree per layer. Stacked (scan_layers=True): params['blocks'] is one block tree whose arrays
carry a leading [n_layers] axis, logical axis 'layers' (the mesh rules map it, default
replicated). Everything outside 'blocks' is the same in both.

`stack_layers` / `unstack_layers` are pure and bit exact. They take an nnx.State (each Param
keeps its metadata, with 'layers' added to or dropped from its logical axes) or a nested dict of
arrays (a checkpoint's pure tree; numpy stays numpy). `to_layout` converts a live model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LAYERS_AXIS = 'layers'  # logical name of the stacked layer axis
_SHARDING = 'out_sharding'  # the Param metadata key holding logical axis names


def _is_index(key) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def is_stacked(params) -> bool:
    """True if params['blocks'] is one stacked block tree, False if it is a per-layer mapping."""
    if 'blocks' not in params:
        raise ValueError(f'params have no "blocks" entry (keys: {sorted(map(str, params))})')
    keys = list(params['blocks'].keys())
    return not (keys and all(_is_index(k) for k in keys))


def num_layers(params) -> int:
    """The number of blocks in either layout."""
    if not is_stacked(params):
        return len(params['blocks'])
    return int(jax.tree.leaves(params['blocks'])[0].shape[0])


def stacked_axes(path) -> int:
    """1 if the parameter at `path` (a jax key path) has a leading layer axis, else 0.

    True of every leaf under a stacked 'blocks' (one whose next key is a name, not an index),
    wherever 'blocks' sits (a co-trained pair's params nest two models).
    """
    keys = [getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', None))) for k in path]
    for i, key in enumerate(keys[:-1]):
        if key == 'blocks':
            return 0 if _is_index(keys[i + 1]) else 1
    return 0


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _xp(values):
    return np if all(isinstance(v, np.ndarray) for v in values) else jnp


def _stack(*leaves):
    if not _is_variable(leaves[0]):
        return _xp(leaves).stack(leaves)
    values = [v.get_value() for v in leaves]
    axes = leaves[0].get_metadata().get(_SHARDING)
    updates = {} if axes is None else {_SHARDING: (LAYERS_AXIS, *axes)}
    return leaves[0].replace(_xp(values).stack(values), **updates)


def _take(leaf, i: int):
    if not _is_variable(leaf):
        return leaf[i]
    axes = leaf.get_metadata().get(_SHARDING)
    updates = {}
    if axes is not None:
        if not axes or axes[0] != LAYERS_AXIS:
            raise ValueError(
                f'stacked parameter has logical axes {axes}, expected {LAYERS_AXIS!r} first'
            )
        updates = {_SHARDING: tuple(axes[1:])}
    return leaf.replace(leaf.get_value()[i], **updates)


def _plain(tree):
    """Nested mappings as plain dicts (the form nnx.split gives inside its State)."""
    if isinstance(tree, nnx.State | dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _with_blocks(params, blocks):
    out = {k: v for k, v in params.items() if k != 'blocks'}
    out['blocks'] = blocks
    return nnx.State(_plain(out)) if isinstance(params, nnx.State) else _plain(out)


def stack_layers(params):
    """Unstacked params -> stacked: block i's arrays become index i of one [n_layers, ...] stack."""
    if is_stacked(params):
        raise ValueError('stack_layers: params["blocks"] is already stacked (scan_layers layout)')
    blocks = params['blocks']
    order = sorted(blocks.keys(), key=int)
    if [int(k) for k in order] != list(range(len(order))):
        raise ValueError(f'stack_layers: block indices {order} are not 0..{len(order) - 1}')
    layers = [blocks[k] for k in order]
    try:
        stacked = jax.tree.map(_stack, *layers, is_leaf=_is_variable)
    except ValueError as e:
        raise ValueError(f'stack_layers: the blocks do not share one structure ({e})') from None
    return _with_blocks(params, stacked)


def unstack_layers(params):
    """Stacked params -> unstacked: index i of every [n_layers, ...] array becomes block i."""
    if not is_stacked(params):
        raise ValueError('unstack_layers: params["blocks"] is already unstacked (one per layer)')
    blocks = params['blocks']
    n = num_layers(params)
    layers = {}
    for i in range(n):
        layer = jax.tree.map(lambda leaf, i=i: _take(leaf, i), blocks, is_leaf=_is_variable)
        layers[i] = layer
    return _with_blocks(params, layers)


def convert_params(params, scan_layers: bool):
    """`params` in the layout `scan_layers` names (unchanged if already there)."""
    if is_stacked(params) == bool(scan_layers):
        return params
    return stack_layers(params) if scan_layers else unstack_layers(params)


def to_layout(model, scan_layers: bool):
    """A model equal to `model` in the layout `scan_layers` names (`model` if already).

    `model` is a Transformer (or a subclass built as `cls(config, rngs=...)`); the result's
    config differs only in scan_layers and its parameters are new arrays.
    """
    if model.config.scan_layers == bool(scan_layers):
        return model
    cfg = dataclasses.replace(model.config, scan_layers=bool(scan_layers))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, convert_params(nnx.state(model), scan_layers))
