"""Ahead-of-time compiles side by side.

XLA releases the GIL while it compiles, and no single compile keeps every core busy, so several
lowered programs compiled in threads take less wall time than one after another
(docs/performance.md, "Compiling side by side"). A program jit has compiled already comes back
from its cache.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence

COMPILE_THREADS = 4  # XLA compiles at once


def compile_lowered(lowered: Sequence) -> tuple[list, list[float], float]:
    """Compiles jax `Lowered` programs, at most COMPILE_THREADS at once.

    Returns (the compiled programs in order, each one's own compile seconds, the wall seconds
    of the whole group).
    """
    own = [0.0] * len(lowered)

    def compile_one(i):
        t0 = time.perf_counter()
        out = lowered[i].compile()
        own[i] = time.perf_counter() - t0
        return out

    t0 = time.perf_counter()
    workers = min(len(lowered), COMPILE_THREADS)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled = list(pool.map(compile_one, range(len(lowered))))
    else:
        compiled = [compile_one(i) for i in range(len(lowered))]
    return compiled, own, time.perf_counter() - t0


def shares(own: Sequence[float], wall: float) -> list[float]:
    """`wall` apportioned by `own` (each program's share of a group's compile wall seconds, so
    the shares sum to the time the group took)."""
    total = sum(own)
    return [wall * s / total if total > 0 else 0.0 for s in own]
