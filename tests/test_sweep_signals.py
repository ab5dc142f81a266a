"""Sweep runner processes: killing the runner (kill -9 or SIGTERM) leaves no point alive, the
status never says 'running' for a point whose runner is dead, and a rerun completes every point
exactly once. Points are a fake absl script (no JAX) whose SIGTERM handler, like a training
loop's, defers the stop (FAKE_TERM_DELAY seconds), so only the parent-death signal itself can end
it at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from specjax.sweeps import lifetime
from specjax.sweeps import runner as sweep

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith('linux'), reason='PR_SET_PDEATHSIG and /proc are Linux'
)

BASE = """
import ml_collections

def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.mode = 'fake'
    c.seed = 0
    c.x = 1
    return c
"""

ENTRY = """
import json, os, signal, sys, time
from absl import app, flags
from ml_collections import config_flags
from specjax.sweeps.lifetime import die_with_runner, parent_death_signal

_CONFIG = config_flags.DEFINE_config_file('config')
_WORKDIR = flags.DEFINE_string('workdir', None, 'workdir')

def on_term(signum, frame):  # a training loop: stop at the next step boundary, not now
    time.sleep(float(os.environ['FAKE_TERM_DELAY']))
    sys.exit(42)

def main(argv):
    die_with_runner()  # what specjax.main does first
    signal.signal(signal.SIGTERM, on_term)
    wd = _WORKDIR.value
    with open(os.path.join(wd, 'attempts'), 'a') as f:
        f.write(f'start {os.getpid()}\\n')
    with open(os.path.join(wd, 'pid'), 'w') as f:
        f.write(f'{os.getpid()} {parent_death_signal()}')
    time.sleep(float(os.environ['FAKE_POINT_SLEEP']))  # not a config field: same identity
    with open(os.path.join(wd, 'results.json'), 'w') as f:
        json.dump({'score': _CONFIG.value.x}, f)
    with open(os.path.join(wd, 'attempts'), 'a') as f:
        f.write('done\\n')

app.run(main)
"""

DRIVER = """
import sys
import ml_collections
from specjax.sweeps import runner as sweep
base, entry, workdir = sys.argv[1:]
c = ml_collections.ConfigDict()
c.mode = 'sweep'
c.sweep = sweep.default_sweep_config()
c.sweep.base = base
c.sweep.grid = (('x', (1, 2)),)
c.sweep.seeds = 1
c.sweep.bootstrap_resamples = 10
c.sweep.plot_metrics = ('score',)
c.sweep.metrics = ('score',)
result = sweep.run(c, workdir, entry=(entry,))
sys.exit(42 if result.get('preempted') else 0)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().split(')')[-1].split()[0] in ('Z', 'X')  # zombie: dead, unreaped
    except FileNotFoundError:
        return True


def _points_of(runner_pid: int) -> list[int]:
    """Live processes started by that runner (its pid in their environment), found in /proc."""
    marker = f'{lifetime.RUNNER_PID_ENV}={runner_pid}'.encode()
    found = []
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open(f'/proc/{name}/environ', 'rb') as f:
                env = f.read().split(b'\0')
        except OSError:
            continue
        if marker in env and not _gone(int(name)):
            found.append(int(name))
    return found


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _launches(point) -> int:
    """How many times the runner has launched this point (its command lines in sweep.log)."""
    log = point / 'sweep.log'
    return log.read_text().count('entry.py') if log.exists() else 0


@pytest.fixture
def sweep_dir(tmp_path):
    for name, text in (('base.py', BASE), ('entry.py', ENTRY), ('driver.py', DRIVER)):
        (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path


def _driver(tmp_path, sleep, term_delay=0.2):
    args = [str(tmp_path / n) for n in ('base.py', 'entry.py')] + [str(tmp_path / 'sweep')]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        FAKE_POINT_SLEEP=str(sleep),
        FAKE_TERM_DELAY=str(term_delay),
    )
    return subprocess.Popen(
        [sys.executable, str(tmp_path / 'driver.py'), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _rerun_finishes_each_point_once(tmp_path, expect_reclaimed: bool):
    rerun = _driver(tmp_path, 0.1)
    out = rerun.communicate(timeout=120)[0]
    assert rerun.returncode == 0, out
    assert ('left running by runner pid' in out) == expect_reclaimed, out
    points = tmp_path / 'sweep' / 'points'
    for x in (1, 2):
        attempts = (points / f'x-{x}__seed-0' / 'attempts').read_text().split('\n')
        assert attempts.count('done') == 1, attempts
        assert sweep.read_status(str(points / f'x-{x}__seed-0'))['status'] == 'complete'
    assert (points / 'x-2__seed-0' / 'attempts').read_text().count('start') == 1


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM], ids=['kill9', 'sigterm'])
def test_killed_runner_leaves_no_point_and_rerun_finishes_each_once(sweep_dir, sig):
    point = sweep_dir / 'sweep' / 'points' / 'x-1__seed-0'
    runner = _driver(sweep_dir, 60, term_delay=0.3 if sig == signal.SIGTERM else 60)
    assert _wait_for(lambda: (point / 'pid').exists()), runner.communicate()[0]
    child, death_signal = map(int, (point / 'pid').read_text().split())
    assert death_signal == lifetime.PARENT_DEATH_SIGNAL
    os.kill(runner.pid, sig)
    out = runner.communicate(timeout=30)[0]
    if sig == signal.SIGTERM:  # forwarded; the point stopped on its own; the runner followed
        assert runner.returncode == 42, out
        assert sweep.read_status(str(point))['status'] == 'interrupted'
        assert sweep.read_status(str(point))['returncode'] == 42
    # SIGKILL: the point's SIGTERM handler would have kept it alive 60 s more
    assert _wait_for(lambda: _gone(child), timeout=5), f'point pid {child} survived'
    _rerun_finishes_each_point_once(sweep_dir, expect_reclaimed=sig == signal.SIGKILL)


def test_kill9_of_the_runner_at_any_moment_leaves_no_point_ten_times(sweep_dir):
    """Killed while the point starts up (before or after its prctl) or while it runs; the status
    reads 'interrupted', never 'running', once the runner is dead."""
    point = sweep_dir / 'sweep' / 'points' / 'x-1__seed-0'
    for attempt in range(10):
        runner = _driver(sweep_dir, 60, term_delay=60)
        assert _wait_for(lambda n=attempt: _launches(point) > n), runner.communicate()[0]
        time.sleep(0.08 * attempt)  # 0 .. 0.72 s: from before the point's imports to running
        os.kill(runner.pid, signal.SIGKILL)
        runner.communicate(timeout=30)
        assert _wait_for(lambda pid=runner.pid: not _points_of(pid), timeout=20), (
            f'attempt {attempt}: point(s) {_points_of(runner.pid)} outlived runner {runner.pid}'
        )
        status = sweep.read_status(str(point))
        assert status is not None and status['status'] == 'interrupted', (attempt, status)
    _rerun_finishes_each_point_once(sweep_dir, expect_reclaimed=True)
