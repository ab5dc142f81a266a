"""Device meshes from config: named axes, sizes (-1 = all remaining devices), Auto axis types."""

from __future__ import annotations

import math

import jax
import ml_collections
from jax.sharding import AxisType, Mesh

DEFAULT_AXES = ('data', 'fsdp', 'tensor')

# Every logical axis a parameter or activation carries, mapped to mesh axes (None = replicated).
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),
    ('length', None),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('norm', None),
)


def default_mesh_config() -> ml_collections.ConfigDict:
    """config.mesh: axis names, sizes and logical-axis rules."""
    cfg = ml_collections.ConfigDict()
    cfg.axes = DEFAULT_AXES  # mesh axis names
    cfg.shape = (-1, 1, 1)  # size per axis; one -1 takes all remaining devices
    cfg.rules = DEFAULT_RULES  # (logical axis, mesh axis | tuple | None) for every logical axis
    return cfg


def resolve_shape(axes, shape, num_devices: int) -> tuple[int, ...]:
    """Replaces a single -1 in `shape` so the product is `num_devices`; errors name the field."""
    axes, shape = tuple(axes), tuple(int(s) for s in shape)
    if len(axes) != len(shape):
        raise ValueError(f'config.mesh.shape={shape} does not match config.mesh.axes={axes}')
    if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
        raise ValueError(f'config.mesh.shape={shape}: sizes must be >= 1, with at most one -1')
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f'config.mesh.shape={shape} does not divide {num_devices} devices')
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(
            f'config.mesh.shape={shape} needs {math.prod(shape)} devices, have {num_devices}'
        )
    return shape


def make_mesh(mesh_config, devices=None) -> Mesh:
    """A mesh over `devices` (default: all global devices) with Auto axis types."""
    devices = jax.devices() if devices is None else list(devices)
    shape = resolve_shape(mesh_config.axes, mesh_config.shape, len(devices))
    axes = tuple(mesh_config.axes)
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)
