"""How long a sweep point's process may live: never longer than the runner that started it.

The runner (specjax.sweeps.runner) starts every point in its own process group with
RUNNER_PID_ENV = its pid in the environment; the point calls `die_with_runner()` first thing
(specjax.main does). Linux then delivers PARENT_DEATH_SIGNAL (SIGKILL) to the point the moment
its parent dies — including `kill -9` of the runner, which gives the runner no chance to pass
anything on. SIGKILL rather than SIGTERM: a point's SIGTERM handler defers the stop to a step
boundary or ignores it in some phases (a final evaluation), and a point that outlives its runner
writes results that nobody records; orbax commits checkpoints atomically, so the rerun resumes
from the newest committed step (what a kill -9 of the point itself gives). A graceful stop is
what SIGTERM to the runner is for: it is forwarded to every point's group and waited for.

Linux sends the parent-death signal when the parent *thread* that forked the child exits, so
the runner starts points from its main thread (one that lives as long as the runner). The
runner may die before the child asks (between fork and prctl): after asking, the child checks
that its parent is still the runner and exits at once otherwise (it has been re-parented).

`runner_identity()` / `runner_alive(identity)`: the runner's host, pid and process start time
(so a reused pid is not taken for the runner), recorded in every point's sweep_status.json.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

from specjax.workdir import RUNNER_PID_ENV, pid_alive

PARENT_DEATH_SIGNAL = signal.SIGKILL
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_GET_PDEATHSIG = 2


def die_with_runner() -> None:
    """If $SPECJAX_RUNNER_PID is set: have Linux kill this process when its parent dies.

    Exits at once (status 1, a line naming the runner) if the parent is already not the runner;
    OSError if the kernel refuses the request. No-op outside a sweep and off Linux.
    """
    runner = os.environ.get(RUNNER_PID_ENV)
    if not runner or not sys.platform.startswith('linux'):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f'prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}')
    if os.getppid() != int(runner):  # the runner died before the request took effect
        sys.stderr.write(f'sweep runner pid {runner} is gone; this point does not start\n')
        sys.stderr.flush()
        os._exit(1)


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (0: none; Linux only)."""
    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            fields = f.read().rpartition(')')[2].split()
        state, ticks = fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None
    return None if state in ('Z', 'X') else ticks  # a zombie has ended


def runner_identity() -> dict:
    """{'host', 'pid', 'start_ticks'} of this process (the runner)."""
    return {
        'host': socket.gethostname(),
        'pid': os.getpid(),
        'start_ticks': _start_ticks(os.getpid()),
    }


def runner_alive(identity: dict) -> bool | None:
    """Whether the recorded runner still runs: None when it ran on another host (unknown)."""
    if identity.get('host') != socket.gethostname():
        return None
    pid = identity.get('pid')
    if not isinstance(pid, int) or pid <= 0:
        return False
    ticks = _start_ticks(pid)
    if ticks is not None:
        recorded = identity.get('start_ticks')
        return recorded is None or recorded == ticks  # another start time: a reused pid
    if os.path.isdir('/proc'):
        return False  # no such process, or a zombie
    return pid_alive(pid)  # no /proc: a live pid is all there is to know


def without_dead_runner(status):
    """A point's status record, with 'running' turned into 'interrupted' when the runner that
    wrote it (on this host) has ended: no reader is told a point runs whose runner is dead."""
    if not isinstance(status, dict) or status.get('status') != 'running':
        return status
    runner = status.get('runner') or {}
    if runner_alive(runner) is not False:
        return status
    error = (
        f'its runner (pid {runner.get("pid")} on {runner.get("host")!r}) ended while it ran, '
        'without notice (kill -9 or a crash); rerun the sweep to run it again (it resumes from '
        'its checkpoints)'
    )
    return dict(status, status='interrupted', error=error, abandoned=True)
