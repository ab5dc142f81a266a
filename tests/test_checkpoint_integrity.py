"""Nothing wrong passes silently: verified checkpoints, metrics and results kept consistent,
SIGTERM before the loop and during the final evaluation, a full disk.

The tiny Markov pretraining of test_checkpoint (its shapes hit the persistent compilation
cache); subprocess cases run `DRIVER`, which trains that config the way specjax.main would
(absl app, exit 42 when preempted, a refusal as one `FATAL` line).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_checkpoint import Crash, crash_at, params_of, short_config, steps_in
from test_train import markov_data

from specjax import checkpoint_integrity as integrity
from specjax import workdir as workdir_lib
from specjax.checkpoint import CorruptCheckpoint, load_model
from specjax.train.pretrain import pretrain
from specjax.workdir import PREEMPTED_EXIT_CODE

TESTS = pathlib.Path(__file__).parent

DRIVER = """
import json, os, signal, sys
from absl import app
from test_train import markov_data, tiny_config
from specjax.errors import SpecjaxError
from specjax.train import pretrain as pretrain_lib
from specjax.train.metrics import quiet_libraries
from specjax.workdir import PREEMPTED_EXIT_CODE, was_preempted

def main(argv):
    workdir, when, train = argv[1], argv[2], json.loads(argv[3])
    config = tiny_config(**train)
    quiet_libraries()
    build = pretrain_lib.build_task

    def build_task(config, data):  # SIGTERM from the kernel at a chosen point of the run
        task, model_cfg = build(config, data)
        init, evaluate = task.init_state, task.evaluate
        if when == 'setup':  # inside the loop's set-up, before any step
            task.init_state = lambda: (os.kill(os.getpid(), signal.SIGTERM), init())[1]
        if when == 'final_eval':
            def ev(state):
                if int(state.step) == config.train.steps:
                    os.kill(os.getpid(), signal.SIGTERM)
                return evaluate(state)
            task.evaluate = ev
        return task, model_cfg

    pretrain_lib.build_task = build_task
    try:
        result = pretrain_lib.pretrain(config, workdir, data=markov_data(config))
    except SpecjaxError as e:
        sys.stderr.write(f'FATAL {e}\\n')
        sys.exit(2)
    if was_preempted(result):
        sys.exit(PREEMPTED_EXIT_CODE)

app.run(main)
"""


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp('full')
    config = short_config()
    return workdir, pretrain(config, str(workdir), data=markov_data(config))


def _run(cmd: list[str]) -> tuple[int, str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]),
        JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,  # conftest's cache
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0.2',
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def _driver(tmp_path, workdir, when: str, **train) -> list[str]:
    script = tmp_path / 'driver.py'
    script.write_text(DRIVER)
    args = dict(steps=12, checkpoint_every=4, keep_checkpoints=2, log_every=4, eval_batches=1)
    args.update(train)
    return [sys.executable, str(script), str(workdir), when, json.dumps(args)]


def _flip_until_it_parses(step_dir: pathlib.Path, workdir, want, monkeypatch) -> None:
    """Flips one byte of an array file of step_dir where the step still loads (verification
    off) and gives other parameters: corruption that orbax cannot notice."""
    files = sorted((p for p in step_dir.glob('state/**/d/*') if p.is_file()), key=os.path.getsize)
    monkeypatch.setenv(integrity.VERIFY_ENV, '0')
    for file in reversed(files):  # OCDBT packs arrays into files: find one holding params
        original = file.read_bytes()
        for offset in range(len(original) // 2, len(original), max(len(original) // 8, 1)):
            data = bytearray(original)
            data[offset] ^= 0x5A
            file.write_bytes(bytes(data))
            try:
                got, _ = params_of(workdir)
            except Exception:  # this byte broke the encoding: orbax notices; try another
                continue
            if any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got)):
                monkeypatch.delenv(integrity.VERIFY_ENV)
                return
        file.write_bytes(original)
    pytest.fail(f'no byte of the array files in {step_dir} gives a loadable step')


def test_bit_flip_is_refused_by_readers_and_fallen_back_from(tmp_path, finished_run, monkeypatch):
    from specjax.distill.teacher import load_teacher
    from specjax.interop.workdir import export_workdir

    full_dir, full = finished_run
    work = tmp_path / 'w'
    shutil.copytree(full_dir, work)
    step_dir = work / 'checkpoints' / '12'
    assert (step_dir / integrity.DIGEST_FILE).exists()
    want, _ = params_of(full_dir)
    # Negative control: unverified, the flipped step loads and its parameters differ.
    _flip_until_it_parses(step_dir, work, want, monkeypatch)

    # Load-only readers refuse it, naming the step folder.
    for load in (
        lambda: load_model(str(work)),
        lambda: load_teacher(str(work), -1, mesh=None, rules=None),
        lambda: export_workdir(str(work), str(tmp_path / 'hf')),
    ):
        with pytest.raises(CorruptCheckpoint, match=re.escape(str(step_dir)) + ' is corrupt'):
            load()
    assert not (tmp_path / 'hf').exists()

    # Training falls back to step 8, moves step 12 aside and retrains it bit-identically.
    config = short_config()
    again = pretrain(config, str(work), data=markov_data(config))
    assert again['step'] == 12 and again['eval'] == full['eval']
    assert [p.name.split('.')[0] for p in (work / 'checkpoints_broken').iterdir()] == ['12']
    got, _ = params_of(work)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_steps_without_a_digest_load_with_a_warning(tmp_path, finished_run, caplog):
    work = tmp_path / 'w'
    shutil.copytree(finished_run[0] / 'checkpoints', work / 'checkpoints')
    (work / 'checkpoints' / '12' / integrity.DIGEST_FILE).unlink()  # as saved before digests
    with caplog.at_level('WARNING'):
        _, meta = params_of(work)
    assert meta['step'] == 12 and 'no content digest' in caplog.text


def test_metrics_rows_after_the_resumed_step_are_written_once(tmp_path):
    config = short_config(log_every=1)
    with pytest.raises(Crash):  # rows 1..6 written, checkpoint at 4
        pretrain(config, str(tmp_path), data=markov_data(config), on_step=crash_at(6))
    assert steps_in(tmp_path) == [4]
    pretrain(config, str(tmp_path), data=markov_data(config))
    rows = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in rows if r['split'] == 'train'] == list(range(1, 13))


def test_results_are_never_replaced_without_keeping_the_previous(tmp_path):
    config = short_config()
    write = lambda mode, results: workdir_lib.write_results(str(tmp_path), mode, results, config)
    write('pretrain', {'step': 3, 'x': 1})
    write('pretrain', {'step': 3, 'x': 2})  # same step, other content: numbered copy
    write('pretrain', {'step': 3, 'x': 2})
    write('pretrain', {'step': 3, 'x': 3})
    kept = {p.name: json.loads(p.read_text())['x'] for p in tmp_path.glob('results*.json')}
    assert kept == {'results.json': 3, 'results.step3.json': 1, 'results.step3-2.json': 2}
    other = tmp_path / 'eval'
    for ks in ((4,), (2,)):  # spec_eval's files carry no step
        workdir_lib.write_kept(other, 'spec_eval.json', json.dumps({'ks': ks}))
    assert json.loads((other / 'spec_eval.prev.json').read_text()) == {'ks': [4]}
    assert json.loads((other / 'spec_eval.json').read_text()) == {'ks': [2]}


def test_sigterm_before_any_step_exits_42_with_nothing_saved(tmp_path):
    work = tmp_path / 'w'
    rc, out = _run(_driver(tmp_path, work, 'setup'))
    assert rc == PREEMPTED_EXIT_CODE, out[-3000:]
    assert 'stopped before any step; nothing saved' in out
    assert steps_in(work) == [] and not (work / 'results.json').exists()


def test_sigterm_during_the_final_evaluation_exits_42_then_resumes(tmp_path, finished_run):
    work = tmp_path / 'w'
    rc, out = _run(_driver(tmp_path, work, 'final_eval'))
    assert rc == PREEMPTED_EXIT_CODE, out[-3000:]
    assert f'stopped at step 12; checkpoint step 12 is in {work / "checkpoints"}' in out
    assert steps_in(work) == [8, 12] and not (work / 'results.json').exists()
    config = short_config()
    done = pretrain(config, str(work), data=markov_data(config))  # evaluates step 12 again
    assert not done['preempted'] and done['eval'] == finished_run[1]['eval']
    assert json.loads((work / 'results.json').read_text())['step'] == 12


def _with_tmpfs(where: pathlib.Path, size: int) -> list[str]:
    """The command prefix that runs a command in a private mount namespace with a `size`-byte
    tmpfs at `where` (gone with the command); skips where none can be made (neither root nor
    user namespaces)."""
    where.mkdir()
    mount = f'mount -t tmpfs -o size={size} tmpfs {where}'
    if shutil.which('unshare') and shutil.which('sh'):
        for ns in (['--mount'], ['--user', '--map-root-user', '--mount']):
            probe = subprocess.run(['unshare', *ns, 'sh', '-c', mount], capture_output=True)
            if probe.returncode == 0:
                return ['unshare', *ns, 'sh', '-c', f'{mount} && exec "$@"', 'sh']
    pytest.skip('cannot mount a small tmpfs here (needs root or user namespaces)')


def test_a_full_disk_stops_training_at_once_with_one_clear_line(tmp_path, finished_run):
    step_dir = finished_run[0] / 'checkpoints' / '12'
    step_bytes = sum(p.stat().st_size for p in step_dir.rglob('*') if p.is_file())
    disk = tmp_path / 'disk'
    prefix = _with_tmpfs(disk, int(2.6 * step_bytes) // 4096 * 4096)  # room for two steps
    train = dict(steps=40, keep_checkpoints=100, log_every=1)
    keep = tmp_path / 'kept'  # what the tmpfs held, copied out before it goes away
    run = shlex.join(_driver(tmp_path, disk / 'w', 'none', **train))
    rc, out = _run([*prefix, 'sh', '-c', f'{run}; rc=$?; cp -r {disk}/w {keep}; exit $rc'])
    assert rc not in (0, PREEMPTED_EXIT_CODE), out[-3000:]
    line = re.search(r'FATAL checkpoint step (\d+) could not be written to (\S+): (.*)', out)
    assert line, out[-3000:]
    failed = int(line.group(1))
    assert line.group(2) == f'{disk}/w/checkpoints' and line.group(3) == 'no space left on device'
    logged = [int(s) for s in re.findall(r'step (\d+)/40', out)]
    assert max(logged) < failed + 4, 'trained on past the next checkpoint'
    for noise in ('Traceback', 'Event loop is closed', 'sys.meta_path is None'):
        assert noise not in out, out[-3000:]
    intact = steps_in(keep)
    assert intact == list(range(4, failed, 4)) and intact
    for step in intact:
        integrity.verify_step(keep / 'checkpoints' / str(step))


def test_closing_on_a_full_disk_keeps_the_error_that_stopped_training():
    """The metrics writer's close flushes too: on the same full disk it fails again, and must
    not replace the checkpoint error on its way out (seen under load in a fresh-clone suite)."""
    from specjax.train import loop

    class Failing:
        closed = False

        def close(self):
            self.closed = True
            raise OSError(28, 'No space left on device')

    writer, ckpts = Failing(), Failing()
    loop._close(writer, ckpts, failing=True)  # the error in flight stays the one raised
    assert writer.closed and ckpts.closed
    with pytest.raises(OSError):  # nothing in flight: a failing close is the error
        loop._close(writer, ckpts, failing=False)
