"""A sweep runner's child processes: how a point is started, waited for and stopped.

`subprocess_launcher(launch)` runs one point in its own process group (start_new_session), from
the calling thread, which must be the runner's main thread (the point's parent-death signal is
tied to the thread that forks it: specjax.sweeps.lifetime). While `Forwarding()` is entered,
SIGTERM and SIGINT to the runner are passed to the running point's group; the point gets
STOP_GRACE_S to stop on its own (training checkpoints and exits 42), then its group is killed
(SIGKILL) — as at once on a second signal. `Children.stop_signal` tells the runner a stop was
asked for. A point that outlives point_timeout_s is killed with its group.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from specjax.sweeps.spec import Run

STOP_GRACE_S = 300.0  # after a forwarded stop: seconds before the point's group is killed
_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Launch:
    """Everything a launcher needs for one run."""

    run: Run
    workdir: str  # the run's own workdir
    argv: tuple[str, ...]
    log_path: str
    env: dict
    timeout_s: float | None


Launcher = Callable[[Launch], int]


class Children:
    """The running point's process, for signal forwarding; what the runner was asked to do."""

    process: subprocess.Popen | None = None
    stop_signal: int | None = None
    stop_time: float | None = None  # time.monotonic() of the first forwarded signal
    signalled: subprocess.Popen | None = None  # the process the stop was passed to


def kill_group(process: subprocess.Popen, sig: int) -> None:
    """Sends `sig` to the process group led by `process` (gone already: nothing)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(process: subprocess.Popen, timeout_s: float | None, log) -> int:
    """The exit status, killing the group past timeout_s or STOP_GRACE_S after a stop."""
    start = time.monotonic()
    while True:
        try:
            return process.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if Children.stop_signal is not None and Children.signalled is not process:
            Children.signalled = process  # started as the signal came: pass it on now
            kill_group(process, Children.stop_signal)
        now = time.monotonic()
        if timeout_s and now - start > timeout_s:
            kill_group(process, signal.SIGKILL)
            process.wait()
            log.write(f'\n[sweep] killed after {timeout_s} s (point_timeout_s)\n')
            return -9
        if Children.stop_time is not None and now - Children.stop_time > STOP_GRACE_S:
            kill_group(process, signal.SIGKILL)
            log.write(f'\n[sweep] killed: not stopped {STOP_GRACE_S:.0f} s after the signal\n')
            log.flush()


def subprocess_launcher(launch: Launch) -> int:
    """Runs launch.argv in its own process group, output appended to launch.log_path.

    Returns the exit status (negative: killed by that signal). On timeout the whole group is
    killed; so it is when the runner unwinds with an exception while the point runs.
    """
    with open(launch.log_path, 'a') as log:
        process = subprocess.Popen(
            launch.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=launch.env,
            start_new_session=True,
        )
        Children.process = process
        try:
            return _wait(process, launch.timeout_s, log)
        finally:
            if process.poll() is None:  # the runner is unwinding (an exception): take it along
                kill_group(process, signal.SIGKILL)
                process.wait()
            Children.process = None


def _forward(signum, frame):
    """SIGTERM / SIGINT handler of the runner: pass it to the point's group (twice: SIGKILL)."""
    again = Children.stop_signal is not None
    Children.stop_signal = Children.stop_signal or signum
    Children.stop_time = Children.stop_time or time.monotonic()
    process = Children.process
    if process is not None:
        Children.signalled = process
        kill_group(process, signal.SIGKILL if again else signum)
    os.write(2, f'[sweep] got signal {signum}: stopping after the running point\n'.encode())


class Forwarding:
    """Installs _forward for SIGTERM and SIGINT while the sweep runs (main thread only)."""

    def __enter__(self):
        Children.stop_signal = Children.stop_time = Children.signalled = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, _forward)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
