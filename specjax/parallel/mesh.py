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


# Named rule sets: the target's FSDP + tensor parallelism, and two for small drafts that should
# not be split: 'data_parallel' (parameters replicated, batch and caches over data x fsdp) and
# 'replicated' (everything on every device).
RULE_PRESETS = {
    'fsdp_tp': DEFAULT_RULES,
    'data_parallel': tuple(
        (n, ('data', 'fsdp') if n == 'batch' else None) for n, _ in DEFAULT_RULES
    ),
    'replicated': tuple((n, None) for n, _ in DEFAULT_RULES),
}
SAME_RULES = 'same'  # config.mesh.draft_rules: use config.mesh.rules


def default_mesh_config(draft_rules=SAME_RULES) -> ml_collections.ConfigDict:
    """config.mesh: axis names, sizes and logical-axis rules (of the target and of the draft).

    draft_rules is an argument because ml_collections fixes a field's type: pass pairs here to
    give the draft explicit rules; on the command line use a preset name.
    """
    cfg = ml_collections.ConfigDict()
    cfg.axes = DEFAULT_AXES  # mesh axis names
    cfg.shape = (-1, 1, 1)  # size per axis; one -1 takes all remaining devices
    cfg.rules = DEFAULT_RULES  # (logical axis, mesh axis | tuple | None) for every logical axis
    # The draft's rules: 'same' (= rules), a RULE_PRESETS name ('data_parallel', 'replicated',
    # 'fsdp_tp') or (default_mesh_config(draft_rules=...)) (logical axis, mesh axes) pairs.
    cfg.draft_rules = draft_rules
    return cfg


def resolve_rules(value, field: str = 'config.mesh.rules') -> tuple:
    """Rules as a tuple of (logical axis, mesh axis | tuple | None) from a preset name or pairs."""
    if isinstance(value, str):
        if value not in RULE_PRESETS:
            raise ValueError(f'{field}={value!r}: known presets are {sorted(RULE_PRESETS)}')
        return RULE_PRESETS[value]
    try:
        return tuple((n, tuple(a) if isinstance(a, list) else a) for n, a in value)
    except (TypeError, ValueError):
        raise ValueError(
            f'{field}={value!r} must be a preset name or (logical axis, mesh axes) pairs'
        ) from None


def mesh_rules(mesh_config) -> tuple[tuple, tuple]:
    """(target rules, draft rules) of a config.mesh; draft_rules 'same' or absent = rules."""
    rules = resolve_rules(mesh_config.rules)
    draft = mesh_config.get('draft_rules', SAME_RULES)
    if draft is None or draft == SAME_RULES:
        return rules, rules
    return rules, resolve_rules(draft, 'config.mesh.draft_rules')


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
