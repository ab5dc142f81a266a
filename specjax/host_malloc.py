"""glibc malloc settings that keep XLA:CPU's step buffers in the process between steps.

XLA:CPU allocates a step's buffers with malloc. glibc serves large blocks with mmap (always
above 32 MiB, and from a per-thread arena whenever that arena's 64 MiB heap cannot hold them)
and returns them to the kernel on free, so every step faults its large buffers back in page by
page: the quickstart's draft stage (logits of 16 x 128 x 4096 float32 = 33.5 MB) took 11.3M minor
page faults and 30 s of system time beside 76 s of user time on the 2-core CPU. One arena, no
mmap and no trimming: 0.36M faults, 1.7 s of system time, the same user time.
The usual cure is LD_PRELOAD of tcmalloc, which a pip install cannot provide; mallopt(3) does it
in-process, provided it runs before XLA's thread pools start.

It is not for every process: with one arena, multi-threaded work contends for the heap lock.
spec_ce (mostly compiling) took 151 s instead of 115 s of wall time with it, and a 2-core
pretraining run gained nothing. So only the quickstart's side-by-side training processes
(specjax.quickstart.stage_runner), each a small model's step on about one core, apply it.
Freed memory then stays with the process until it exits. `SPECJAX_MALLOC=system` keeps glibc's
defaults there too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV = 'SPECJAX_MALLOC'

# mallopt(3) parameters (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = (
    (_M_ARENA_MAX, 1),  # one heap: large blocks are not pushed to mmap by 64 MiB thread heaps
    (_M_MMAP_MAX, 0),  # no mmap-backed blocks: freed buffers are reused, not unmapped
    (_M_TRIM_THRESHOLD, 1 << 30),  # shrink the heap only when 1 GiB at its top is free
)

_applied: bool | None = None


def configure() -> bool:
    """Applies the settings once per process; True if they are in effect.

    A no-op (False) off glibc (macOS, musl), with SPECJAX_MALLOC=system, or if mallopt refuses.
    """
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    mode = os.environ.get(ENV, 'specjax')
    if mode not in ('specjax', 'system'):
        raise ValueError(f'{ENV}={mode!r}: expected specjax (the default) or system')
    if mode == 'system' or platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    except OSError:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in _SETTINGS)
