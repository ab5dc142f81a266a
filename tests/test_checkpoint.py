"""Checkpoints: bit-identical resume (crash and SIGTERM), non-finite stop, identity checks, loading.

Uses the synthetic Markov corpus of test_train with the same model and batch shapes, so compiled
init / eval programs come from the persistent compilation cache.
"""

from __future__ import annotations

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train import markov_data, tiny_config

from specjax.checkpoint import Checkpoints, load_model
from specjax.train.loop import NonFiniteLossError
from specjax.train.pretrain import pretrain


class Crash(Exception):
    pass


def short_config(**train):
    args = dict(steps=12, checkpoint_every=4, keep_checkpoints=2, log_every=4, eval_batches=1)
    args.update(train)
    return tiny_config(**args)


def crash_at(step):
    def on_step(s, state):
        if s == step:
            raise Crash(s)

    return on_step


def sigterm_at(step):
    def on_step(s, state):
        if s == step:
            signal.raise_signal(signal.SIGTERM)

    return on_step


def params_of(workdir):
    model, meta = load_model(str(workdir))
    return jax.tree.leaves(nnx.state(model, nnx.Param)), meta


def steps_in(workdir) -> list[int]:
    ckpts = Checkpoints(str(workdir), read_only=True)
    try:
        return ckpts.all_steps()
    finally:
        ckpts.close()


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
    """(workdir, results) of one uninterrupted short_config() run, shared by the tests below."""
    workdir = tmp_path_factory.mktemp('full')
    config = short_config()
    return workdir, pretrain(config, str(workdir), data=markov_data(config))


def test_interrupted_runs_resume_bit_identical(tmp_path, finished_run):
    config = short_config()
    full_dir, full = finished_run
    assert not full['preempted'] and full['step'] == 12

    work = str(tmp_path / 'resumed')
    with pytest.raises(Crash):  # dies at step 6: the step-4 checkpoint survives
        pretrain(config, work, data=markov_data(config), on_step=crash_at(6))
    assert steps_in(work) == [4]
    handler = signal.getsignal(signal.SIGTERM)
    part = pretrain(config, work, data=markov_data(config), on_step=sigterm_at(9))
    assert part['preempted'] and part['step'] == 9 and part['checkpoint_step'] == 9
    assert signal.getsignal(signal.SIGTERM) is handler
    assert steps_in(work) == [8, 9]  # keep_checkpoints=2
    ckpts = Checkpoints(work, read_only=True)
    meta = ckpts.metadata(9)
    ckpts.close()
    assert meta['step'] == 9 and meta['model_config']['d_model'] == 64
    done = pretrain(config, work, data=markov_data(config))
    assert done['step'] == 12 and not done['preempted']

    want, meta_full = params_of(full_dir)
    got, meta_resumed = params_of(work)
    assert meta_full['step'] == meta_resumed['step'] == 12
    assert len(want) == len(got) > 0
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert done['eval'] == full['eval']

    # Rerunning a finished workdir trains nothing and loses nothing.
    before = sorted(p.name for p in (tmp_path / 'resumed' / 'checkpoints').iterdir())
    again = pretrain(config, work, data=markov_data(config))
    assert again['step'] == 12
    assert sorted(p.name for p in (tmp_path / 'resumed' / 'checkpoints').iterdir()) == before
    assert json.loads((tmp_path / 'resumed' / 'results.step12.json').read_text())['step'] == 12


class PoisonAt:
    """Wraps a batch iterator: batch number `step` (1-based) gets an out-of-vocab token -> NaN."""

    def __init__(self, inner, step):
        self.inner, self.step = inner, step

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        if self.inner.index == self.step:
            batch = dict(batch, tokens=np.where(batch['tokens'] > 0, 10**6, 0).astype(np.int32))
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def test_non_finite_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path):
    config = short_config()
    data = markov_data(config)
    data.train = PoisonAt(data.train, 7)
    with pytest.raises(NonFiniteLossError, match='at step 7') as err:
        pretrain(config, str(tmp_path), data=data)
    assert err.value.step == 7
    assert steps_in(tmp_path) == [4]
    params, meta = params_of(tmp_path)
    assert meta['step'] == 4 and all(np.isfinite(np.asarray(p)).all() for p in params)
    assert not (tmp_path / 'results.json').exists()


def test_save_refuses_non_finite_params(tmp_path):
    ckpts = Checkpoints(str(tmp_path), async_save=False)
    state = {'params': {'w': jnp.array([1.0, jnp.nan])}}
    with pytest.raises(FloatingPointError, match=r"params\['w'\]"):
        ckpts.save(1, state, data_state={}, metadata={}, finite=state['params'])
    ckpts.save(2, {'params': {'w': jnp.ones(2)}}, data_state={'i': 2}, metadata={'a': 1})
    with pytest.raises(ValueError, match='already exists'):
        ckpts.save(2, {'params': {'w': jnp.ones(2)}}, data_state={}, metadata={})
    assert ckpts.all_steps() == [2]
    ckpts.close()


@pytest.mark.parametrize(
    'change, field',
    [
        (lambda c, d: c.model.update(d_ff=96), 'model_config.d_ff'),
        (lambda c, d: setattr(d, 'tokenizer', {'name': 'bpe', 'vocab_size': 9}), 'tokenizer.name'),
        (lambda c, d: setattr(d, 'corpus', {'name': 'markov2', 'seed': 5}), 'corpus.seed'),
    ],
)
def test_resume_with_other_model_tokenizer_or_corpus_raises(finished_run, change, field):
    workdir, _ = finished_run
    config = short_config()
    data = markov_data(config)
    change(config, data)
    data.train = iter(())  # the check must come before any batch is read or anything compiles
    before = sorted(p.name for p in workdir.rglob('*'))
    with pytest.raises(ValueError, match=rf'{field}: .* in the checkpoint, .* in this run'):
        pretrain(config, str(workdir), data=data)
    assert sorted(p.name for p in workdir.rglob('*')) == before


def _snapshot(workdir) -> dict:
    return {str(p): p.read_bytes() for p in sorted(workdir.rglob('*')) if p.is_file()}


def test_second_run_on_a_locked_workdir_fails_naming_the_first(tmp_path, finished_run, caplog):
    import subprocess
    import sys

    from specjax.workdir import WorkdirBusy, hold

    workdir, _ = finished_run
    holder = subprocess.Popen(
        [
            sys.executable,
            '-c',
            'import sys, time\nfrom specjax.workdir import hold\n'
            "with hold(sys.argv[1], 'pretrain'):\n    print('held', flush=True)\n"
            '    time.sleep(120)\n',
            str(workdir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == 'held'
        before = _snapshot(workdir)
        config = short_config()
        with pytest.raises(WorkdirBusy, match=rf'in use by host .* pid {holder.pid} '):
            pretrain(config, str(workdir), data=markov_data(config))
        assert _snapshot(workdir) == before
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's flock: the next run takes over and says so.
    with caplog.at_level('WARNING'), hold(str(workdir), 'pretrain'):
        pass
    assert f'pid {holder.pid}' in caplog.text and 'took over' in caplog.text


def _truncate_arrays(step_dir):
    files = [p for p in step_dir.glob('state/**/d/*') if p.is_file()]
    assert files
    for p in files:
        p.write_bytes(p.read_bytes()[:10])


def _empty(step_dir):
    import shutil

    for p in step_dir.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


@pytest.mark.parametrize(
    'corrupt',
    [_truncate_arrays, lambda d: (d / 'meta' / 'metadata').unlink(), _empty],
    ids=['truncated', 'no_metadata', 'emptied'],
)
def test_corrupt_latest_step_falls_back_to_the_previous_one(
    tmp_path, finished_run, corrupt, caplog
):
    import shutil

    full_dir, full = finished_run
    work = tmp_path / 'w'
    shutil.copytree(full_dir, work)
    assert steps_in(work) == [8, 12]
    corrupt(work / 'checkpoints' / '12')
    config = short_config()
    with caplog.at_level('WARNING'):
        again = pretrain(config, str(work), data=markov_data(config))
    assert 'checkpoint step 12' in caplog.text and 'cannot be read' in caplog.text
    assert again['step'] == 12 and again['eval'] == full['eval']
    want, _ = params_of(full_dir)
    got, _ = params_of(work)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = list((work / 'checkpoints_broken').iterdir())  # kept, never deleted
    assert [p.name.split('.')[0] for p in moved] == ['12']


def test_resume_with_changed_result_fields_fails_naming_them(tmp_path, finished_run):
    import shutil

    from specjax.workdir import ConfigMismatch, config_hash

    workdir, _ = finished_run
    recorded = json.loads((workdir / 'results.json').read_text())
    assert recorded['config']['seed'] == 0 and recorded['config_hash'] == config_hash(
        short_config()
    )
    before = _snapshot(workdir)
    for change, field in (({'seed': 1}, 'seed'), ({'train.steps': 10}, 'train.steps')):
        config = short_config()
        config.update_from_flattened_dict(change)
        with pytest.raises(ConfigMismatch, match=rf"\['{field}'\].*allow_config_change"):
            pretrain(config, str(workdir), data=markov_data(config))
    assert _snapshot(workdir) == before
    # Intervals that do not change the result are not checked.
    config = short_config(log_every=3, eval_every=5, keep_checkpoints=3)
    assert config_hash(config) == recorded['config_hash']
    # A deliberate extension: more steps with the override.
    work = tmp_path / 'extended'
    shutil.copytree(workdir, work)
    config = short_config(steps=14, allow_config_change=True)
    assert pretrain(config, str(work), data=markov_data(config))['step'] == 14
    # results.json records the config it ended with and what the earlier steps ran under
    extended = json.loads((work / 'results.json').read_text())
    steps = recorded['config']['train']['steps']
    assert extended['config']['train']['steps'] == 14
    assert extended['config_history'] == [
        {'resumed_at_step': steps, 'changes': [['train.steps', steps, 14]]}
    ]
    assert 'config_history' not in recorded
