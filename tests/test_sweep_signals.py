"""Sweep runner processes: killing the runner (kill -9 or SIGTERM) leaves no point alive, and a
rerun completes every point exactly once. Points are a fake absl script (no JAX)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

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
import json, os, time
from absl import app, flags
from ml_collections import config_flags
from specjax.workdir import die_with_runner

_CONFIG = config_flags.DEFINE_config_file('config')
_WORKDIR = flags.DEFINE_string('workdir', None, 'workdir')

def main(argv):
    die_with_runner()  # what specjax.main does first
    wd = _WORKDIR.value
    with open(os.path.join(wd, 'attempts'), 'a') as f:
        f.write(f'start {os.getpid()}\\n')
    with open(os.path.join(wd, 'pid'), 'w') as f:
        f.write(str(os.getpid()))
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


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='PR_SET_PDEATHSIG is Linux')
@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM], ids=['kill9', 'sigterm'])
def test_killed_runner_leaves_no_point_and_rerun_finishes_each_once(tmp_path, sig):
    for name, text in (('base.py', BASE), ('entry.py', ENTRY), ('driver.py', DRIVER)):
        (tmp_path / name).write_text(textwrap.dedent(text))
    workdir = tmp_path / 'sweep'
    point = workdir / 'points' / 'x-1__seed-0'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def driver(sleep):
        args = [str(tmp_path / n) for n in ('base.py', 'entry.py')] + [str(workdir)]
        return subprocess.Popen(
            [sys.executable, str(tmp_path / 'driver.py'), *args],
            env=dict(env, FAKE_POINT_SLEEP=str(sleep)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    runner = driver(60)
    assert _wait_for(lambda: (point / 'pid').exists()), runner.communicate()[0]
    child = int((point / 'pid').read_text())
    os.kill(runner.pid, sig)
    runner.wait(timeout=30)
    if sig == signal.SIGTERM:
        assert runner.returncode == 42  # stopped on request: the preemption status
        status = (point / 'sweep_status.json').read_text()
        assert '"interrupted"' in status
    assert _wait_for(lambda: _gone(child), timeout=15), f'point pid {child} survived'

    rerun = driver(0.2)
    out = rerun.communicate(timeout=120)[0]
    assert rerun.returncode == 0, out
    if sig == signal.SIGKILL:
        assert 'left running by runner pid' in out
    for x in (1, 2):
        attempts = (workdir / 'points' / f'x-{x}__seed-0' / 'attempts').read_text().split('\n')
        assert attempts.count('done') == 1, attempts
    assert not (workdir / 'points' / 'x-2__seed-0' / 'attempts').read_text().count('start') > 1
