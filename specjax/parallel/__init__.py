"""Meshes, logical-axis sharding rules and multi-host helpers."""

from specjax.parallel.distributed import host_rows, initialize_from_env, is_main_process, to_host
from specjax.parallel.mesh import DEFAULT_RULES, default_mesh_config, make_mesh
from specjax.parallel.sharding import (
    batch_sharding,
    check_divisible,
    logical_to_spec,
    param_shardings,
    replicated,
)

__all__ = [
    'DEFAULT_RULES',
    'batch_sharding',
    'check_divisible',
    'default_mesh_config',
    'host_rows',
    'initialize_from_env',
    'is_main_process',
    'logical_to_spec',
    'make_mesh',
    'param_shardings',
    'replicated',
    'to_host',
]
