"""Multi-process start-up: one call at the top of main, a no-op on a single machine.

Cloud TPU VMs and GKE TPU slices are detected by JAX itself (`jax.distributed.initialize()` with
no arguments). Elsewhere (GPU clusters, several CPU processes on one machine) the launcher sets
SPECJAX_COORDINATOR=host:port, SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID (see launch/).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV_COORDINATOR = 'SPECJAX_COORDINATOR'
ENV_NUM_PROCESSES = 'SPECJAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'SPECJAX_PROCESS_ID'
ENV_LOCAL_DEVICES = 'SPECJAX_CPU_DEVICES_PER_PROCESS'


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f'environment variable {name}={value!r} is not an integer') from None


def initialize_from_env(force_tpu: bool = False) -> bool:
    """Initialises jax.distributed when the environment asks for it; returns whether it did."""
    if ENV_COORDINATOR in os.environ:
        num, pid = _int_env(ENV_NUM_PROCESSES), _int_env(ENV_PROCESS_ID)
        if not 0 <= pid < num:
            raise ValueError(f'{ENV_PROCESS_ID}={pid} is outside [0, {ENV_NUM_PROCESSES}={num})')
        if ENV_LOCAL_DEVICES in os.environ:  # CPU-only clusters: gloo collectives, N devices each
            jax.config.update('jax_num_cpu_devices', _int_env(ENV_LOCAL_DEVICES))
            jax.config.update('jax_cpu_collectives_implementation', 'gloo')
        jax.distributed.initialize(
            coordinator_address=os.environ[ENV_COORDINATOR], num_processes=num, process_id=pid
        )
        return True
    if (
        force_tpu
        or os.environ.get('TPU_WORKER_HOSTNAMES')
        or os.environ.get('MEGASCALE_COORDINATOR_ADDRESS')
    ):
        jax.distributed.initialize()
        return True
    return False


def is_main_process() -> bool:
    """Process 0 writes summaries, prints and owns workdir-level files."""
    return jax.process_index() == 0


_barriers = [0]


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Waits until every process reaches this point (a no-op with one process).

    A coordination-service barrier, not a device collective: gloo (CPU) gives up on a new
    device group after 30 s, so processes whose compiles finish far apart meet here first.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client jax.distributed.initialize created

    _barriers[0] += 1
    client = distributed.global_state.client
    client.wait_at_barrier(f'specjax:{name}:{_barriers[0]}', int(timeout_s * 1000))


def host_rows(sharding, global_array):
    """This process's rows of a host-global [B, ...] array (the same on every process), as
    `sharding`'s devices here hold them: what it passes to make_array_from_process_local_data.
    With one process, or a batch axis replicated across processes, every row."""
    x = np.asarray(global_array)
    index = sharding.addressable_devices_indices_map(x.shape).values()
    rows = sorted(
        {(i[0].start or 0, x.shape[0] if i[0].stop is None else i[0].stop) for i in index}
    )
    return np.concatenate([x[a:b] for a, b in rows]) if rows else x[:0]


def agreed_max(values: list[int]) -> list[int]:
    """Per position, the largest of every process's `values` (ints, the same length on each):
    a count of device calls that every process must run alike. A collective (process_allgather)
    with several processes; `values` itself with one."""
    if jax.process_count() == 1:
        return [int(v) for v in values]
    gathered_PN = multihost_utils.process_allgather(np.asarray(values, np.int32).reshape(1, -1))
    return [int(v) for v in np.asarray(gathered_PN).reshape(jax.process_count(), -1).max(0)]


def to_host(tree):
    """Every leaf as a numpy array of its global value, on every process.

    A jax.Array spanning other processes' devices (rows sharded over processes) is gathered
    (process_allgather: a collective, so every process must call this with the same tree);
    anything else is fetched as it is (numpy leaves are not concatenated over processes).
    """

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)
