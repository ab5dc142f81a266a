"""Timing and memory for experiment modes: ahead-of-time compiled samplers, peak memory.

`compile_sampler` lowers and compiles a sampler from `make_speculative_fn` /
`make_autoregressive_fn` ahead of time (same core, mesh, rules and shardings as its own jit), so
compile time is separate from run time and the executable's `memory_analysis()` is at hand;
`compile_samplers` compiles several side by side.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
import time

import jax
import numpy as np
import psutil

from specjax.parallel.distributed import agreed_max, barrier
from specjax.sampling import aot, common
from specjax.sampling.calibrate import interleaved_times


@dataclasses.dataclass
class CompiledSampler:
    """An AOT-compiled sampler: call(*params, prompts, prompt_lengths, rng) -> SampleOutput."""

    compiled: object
    sampler: common.ShardedSampler  # checks and places arguments like the jitted path
    compile_s: float

    def __call__(self, *args):
        return self.sampler.checked(self.compiled(*self.sampler.place(args)))

    def host_rows(self, global_rows):
        return self.sampler.host_rows(global_rows)

    def memory(self) -> dict:
        return compiled_memory(self.compiled)


def compile_sampler(sampler, params: list, prompts, prompt_lengths, rng) -> CompiledSampler:
    """Lowers and compiles `sampler` (a ShardedSampler) for these argument shapes (this
    process's prompt rows): compile_samplers with one job."""
    return compile_samplers([(sampler, params, prompts, prompt_lengths, rng)])[0]


def compile_samplers(jobs: list) -> list[CompiledSampler]:
    """Ahead-of-time compiles of several samplers, each job (sampler, params, prompts,
    prompt_lengths, rng), in job order.

    Lowering (Python tracing) runs here one job after another; XLA then compiles them side by
    side (specjax.sampling.aot). Each result's compile_s is its lowering seconds plus its share
    of the group's compile wall seconds (aot.shares), so a group's compile_s sum to the time it
    took. Every process then waits for the others to have compiled too: CPU (gloo) collectives
    give up when one process runs a program 30 s before another can.
    """
    lowered, lower_s = [], []
    for sampler, params, prompts, prompt_lengths, rng in jobs:
        t0 = time.perf_counter()
        lowered.append(sampler.lower(*params, prompts, prompt_lengths, rng))
        lower_s.append(time.perf_counter() - t0)
    compiled, own, wall = aot.compile_lowered(lowered)
    barrier('compile_sampler')
    seconds = [a + b for a, b in zip(lower_s, aot.shares(own, wall), strict=True)]
    return [CompiledSampler(c, job[0], t) for c, job, t in zip(compiled, jobs, seconds)]


def compiled_memory(compiled) -> dict:
    """Bytes from XLA's memory_analysis(): arguments, outputs, temporaries, code, and their peak
    estimate (arguments + outputs + temporaries - aliased); {} where the backend gives none."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (backends without the analysis raise various errors)
        m = None
    if m is None:
        return {}
    fields = (
        'argument_size_in_bytes',
        'output_size_in_bytes',
        'temp_size_in_bytes',
        'alias_size_in_bytes',
        'generated_code_size_in_bytes',
    )
    out = {f: int(getattr(m, f, 0) or 0) for f in fields}
    out['peak_estimate_bytes'] = (
        out['argument_size_in_bytes']
        + out['output_size_in_bytes']
        + out['temp_size_in_bytes']
        - out['alias_size_in_bytes']
    )
    return out


def process_memory() -> dict:
    """Process RSS now and its peak (psutil / getrusage), plus device memory_stats() if any."""
    out = {
        'rss_bytes': int(psutil.Process(os.getpid()).memory_info().rss),
        'peak_rss_bytes': int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
    }
    stats = jax.local_devices()[0].memory_stats()
    if stats:  # None on CPU
        out['device_peak_bytes_in_use'] = int(stats.get('peak_bytes_in_use', 0))
        out['device_bytes_in_use'] = int(stats.get('bytes_in_use', 0))
        out['device_bytes_limit'] = int(stats.get('bytes_limit', 0))
    return out


def environment() -> dict:
    """Backend, devices, versions and XLA flags: what a timing depends on."""
    return {
        'backend': jax.default_backend(),
        'devices': [str(d) for d in jax.devices()],
        'device_kind': jax.devices()[0].device_kind,
        'jax_version': jax.__version__,
        'xla_flags': os.environ.get('XLA_FLAGS', ''),
        'cpu_count': os.cpu_count(),
    }


def floored_times(
    calls: dict, repeats: int, floor_s: float, probes: dict | None = None
) -> tuple[dict, dict]:
    """Interleaved timings whose timed regions last at least `floor_s` seconds.

    Each call's probe time (`probes[name]`: seconds of an untimed call already made, such as
    its warm-up; else the call is timed once here, untimed) sets how often it is repeated
    inside every timed region, `passes` = ceil(floor_s / probe), so regions of a few
    milliseconds do not decide a ranking. With several processes every one runs each call the
    same number of times (the largest `passes` any process found: agreed_max), or their
    collectives would stop matching (gloo aborts with 'Received data size doesn't match
    expected size'). The seconds are this process's own. Returns (name -> list of `repeats`
    seconds per single call, name -> passes).
    """
    passes = {}
    for name, fn in calls.items():
        if probes is not None and name in probes:
            probe = probes[name]
        else:
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            probe = time.perf_counter() - t0
        passes[name] = max(1, math.ceil(floor_s / probe)) if probe > 0 and floor_s > 0 else 1
    if floor_s > 0:  # else 1 everywhere
        passes = dict(zip(passes, agreed_max(list(passes.values()))))
    logging.info('timing passes per region: %s', passes)

    def repeated(fn, n):
        return lambda: [fn() for _ in range(n)]

    wrapped = {name: repeated(fn, passes[name]) for name, fn in calls.items()}
    times = interleaved_times(wrapped, repeats=repeats, warmup=0)
    return {name: [t / passes[name] for t in ts] for name, ts in times.items()}, passes


def per_prompt_times(call, names: list, n: int, repeats: int):
    """Times call(name, i) -> sampler output for every name on each of n prompts at batch 1:
    one untimed warm-up call per name, then `repeats` passes, the names interleaved per prompt
    (the order rotated by prompt). Returns ({name: np.ndarray [repeats, n] seconds},
    {name: [n] host outputs of the first pass})."""
    for name in names:
        jax.block_until_ready(call(name, 0))
    seconds = {name: np.zeros((repeats, n)) for name in names}
    outs = {name: [None] * n for name in names}
    for r in range(repeats):
        for i in range(n):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                out = jax.block_until_ready(call(name, i))
                seconds[name][r, i] = time.perf_counter() - t0
                if r == 0:
                    outs[name][i] = jax.device_get(out)
    return seconds, outs
