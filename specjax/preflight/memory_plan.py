r"""Memory planner: the bytes each device holds for a run, known before launching it.

  python -m specjax.preflight.memory --config=configs/pretrain.py:size=base --num_devices=8 \
      --device=tpu-v5e

For the config's mesh, rules and batch, per device (the most loaded shard of every array):
parameters of each model, optimizer state of each trained model, KV caches (batch x capacity)
of each model that decodes, and the compiled step's temporaries from XLA's memory analysis.
Nothing is allocated: models and optimizer states are `eval_shape`d and the step is lowered on
abstract arrays. `--num_devices` simulates a slice on CPU devices so a pod can be planned from a
laptop; temporaries then come from the CPU compiler, an estimate of an accelerator's.

What speculative decoding costs in memory is the draft's params plus both caches; distillation
adds a frozen teacher beside the draft's params and optimizer state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax.models import TransformerConfig, init_cache
from specjax.parallel.sharding import (  # noqa: F401 (CACHE_AXES, LENGTHS_AXES: re-exported)
    CACHE_AXES,
    LENGTHS_AXES,
    cache_shardings,
    param_shardings,
)

GIB = 1024**3

# HBM per chip (GiB of device memory) of the accelerators people plan for.
DEVICE_MEMORY_GIB = {
    'tpu-v4': 32,
    'tpu-v5e': 16,
    'tpu-v5p': 95,
    'tpu-v6e': 32,
    'a100-40gb': 40,
    'a100-80gb': 80,
    'h100': 80,
    'h200': 141,
}


@dataclasses.dataclass(frozen=True)
class Item:
    """One thing held on every device: its name and its bytes on the most loaded device."""

    name: str
    bytes_per_device: int
    total_bytes: int  # over the whole mesh (replicas counted once)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory of a run; `temporaries` is None when the step was not compiled."""

    mode: str
    mesh_shape: dict[str, int]
    items: tuple[Item, ...]
    temporaries: int | None

    @property
    def bytes_per_device(self) -> int:
        return sum(i.bytes_per_device for i in self.items) + (self.temporaries or 0)

    def fits(self, device: str) -> bool:
        return self.bytes_per_device <= device_bytes(device)

    def to_dict(self) -> dict:
        return {
            'mode': self.mode,
            'mesh_shape': dict(self.mesh_shape),
            'items': [dataclasses.asdict(i) for i in self.items],
            'temporaries_bytes': self.temporaries,
            'bytes_per_device': self.bytes_per_device,
            'fits': {d: self.fits(d) for d in DEVICE_MEMORY_GIB},
        }

    def table(self, device: str | None = None) -> str:
        rows = [(i.name, i.bytes_per_device, i.total_bytes) for i in self.items]
        if self.temporaries is not None:
            rows.append(('step temporaries (XLA memory analysis)', self.temporaries, None))
        rows.append(('total per device', self.bytes_per_device, None))
        mesh = ' x '.join(f'{k}={v}' for k, v in self.mesh_shape.items())
        lines = [
            f'mode {self.mode}, mesh {mesh}',
            '| what | per device | whole mesh |',
            '|---|---|---|',
        ]
        for name, per, total in rows:
            lines.append(f'| {name} | {_fmt(per)} | {_fmt(total) if total is not None else ""} |')
        devices = [device] if device else list(DEVICE_MEMORY_GIB)
        for d in devices:
            verdict = 'fits' if self.fits(d) else 'does NOT fit'
            lines.append(f'{d} ({DEVICE_MEMORY_GIB[d]} GiB per device): {verdict}')
        return '\n'.join(lines)


def _fmt(n: int) -> str:
    for unit, size in (('GiB', GIB), ('MiB', 1024**2), ('KiB', 1024)):
        if n >= size:
            return f'{n / size:.2f} {unit}'
    return f'{n} B'


def device_bytes(device: str) -> int:
    if device not in DEVICE_MEMORY_GIB:
        raise ValueError(f'unknown device {device!r}; known: {sorted(DEVICE_MEMORY_GIB)}')
    return DEVICE_MEMORY_GIB[device] * GIB


def shard_bytes(abstract, shardings) -> tuple[int, int]:
    """(bytes on the most loaded device, bytes over the mesh) of a pytree of arrays/structs."""
    per, total = 0, 0
    leaves = jax.tree.leaves(abstract)
    shards = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    for leaf, sharding in zip(leaves, shards, strict=True):
        itemsize = jnp.dtype(leaf.dtype).itemsize
        per += math.prod(sharding.shard_shape(tuple(leaf.shape))) * itemsize
        total += math.prod(leaf.shape) * itemsize
    return per, total


def abstract_params(cfg: TransformerConfig):
    """(graphdef, abstract params) of a `cfg` Transformer; nothing allocated."""
    from specjax.models import abstract_model

    return abstract_model(cfg)


def abstract_cache(cfg: TransformerConfig, batch_size: int, capacity: int):
    return jax.eval_shape(lambda: init_cache(cfg, batch_size, capacity))


def params_item(name: str, cfg: TransformerConfig, mesh, rules) -> Item:
    _, params = abstract_params(cfg)
    return Item(f'{name} params', *shard_bytes(params, param_shardings(mesh, params, rules)))


def optimizer_item(name: str, cfg: TransformerConfig, tx, mesh, rules) -> Item:
    from specjax.train.state import state_shardings

    _, params = abstract_params(cfg)
    opt = jax.eval_shape(tx.init, params)
    shardings = state_shardings(tx, params, mesh, rules).opt_state
    return Item(f'{name} optimizer state', *shard_bytes(opt, shardings))


def cache_item(name: str, cfg: TransformerConfig, batch: int, capacity: int, mesh, rules) -> Item:
    cache = abstract_cache(cfg, batch, capacity)
    per, total = shard_bytes(cache, cache_shardings(mesh, rules, cache))
    return Item(f'{name} KV cache ({batch} x {capacity})', per, total)


def compiled_temporaries(lower: Callable[[], object]) -> int | None:
    """temp_size_in_bytes of the compiled `lower()`; None where the backend has no analysis."""
    analysis = lower().compile().memory_analysis()
    if analysis is None:
        return None
    return int(getattr(analysis, 'temp_size_in_bytes', 0) or 0)
