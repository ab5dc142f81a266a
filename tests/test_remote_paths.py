"""Workdirs given as path objects or unusual strings; writers that go through etils.epath.

A short tiny pretrain is crashed and resumed with the workdir spelt three ways (epath.Path, a
str with a trailing '/', a '~' path) and must equal an uninterrupted run given a pathlib.Path,
recording the same absolute paths as a plain string would. `gs://` itself cannot be reached
offline (no gcsfs / tensorflow here), so it is checked through epath's API only: its spelling is
kept, it is never locked, and the object-store branch of MetricsWriter (rewrite instead of
append) runs on a local folder treated as remote.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import pytest
from etils import epath
from flax import nnx
from test_checkpoint import Crash, crash_at
from test_train import markov_data, tiny_config

from specjax import workdir as workdir_lib
from specjax.checkpoint import checkpoint_dir, load_model
from specjax.train import metrics
from specjax.train.pretrain import pretrain


def short_config():
    return tiny_config(steps=8, checkpoint_every=4, keep_checkpoints=2, log_every=4, eval_batches=1)


def params_of(workdir):
    model, meta = load_model(workdir)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))], meta


def test_resume_with_path_objects_and_odd_spellings(tmp_path, monkeypatch):
    config = short_config()
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    full = pretrain(config, pathlib.Path(tmp_path / 'full'), data=markov_data(config))
    assert full['checkpoint_dir'] == os.path.join(str(tmp_path / 'full'), 'checkpoints')

    # Crash with an epath.Path, resume with '<dir>/' (a str), finish: equals the full run.
    work = tmp_path / 'resumed'
    with pytest.raises(Crash):
        pretrain(config, epath.Path(work), data=markov_data(config), on_step=crash_at(6))
    done = pretrain(config, f'{work}/', data=markov_data(config))
    assert done['step'] == 8 and not done['preempted']
    assert done['checkpoint_dir'] == os.path.join(str(work), 'checkpoints')
    recorded = json.loads((work / 'results.json').read_text())
    assert recorded['mode'] == 'pretrain' and recorded['step'] == 8
    rows = [json.loads(line) for line in (work / 'metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in rows if r['split'] == 'train'] == [4, 8]  # appended on resume

    # '~' is expanded (before, checkpoint_dir made '~' a folder under the cwd).
    tilde = pretrain(config, '~/tilde', data=markov_data(config))
    assert tilde['checkpoint_dir'] == str(tmp_path / 'home' / 'tilde' / 'checkpoints')

    want, _ = params_of(str(tmp_path / 'full'))
    for other in (epath.Path(work), pathlib.Path(tmp_path / 'home' / 'tilde')):
        got, meta = params_of(other)
        assert meta['step'] == 8
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
    assert done['eval'] == full['eval'] == tilde['eval']


def test_workdir_spellings_resolve_to_one_identity(tmp_path, monkeypatch):
    monkeypatch.setenv('HOME', str(tmp_path))
    plain = str(tmp_path / 'w')
    for spelling in (plain, plain + '/', pathlib.Path(plain), epath.Path(plain), '~/w', '~/w/.'):
        assert workdir_lib.resolve(spelling) == plain
        assert checkpoint_dir(spelling) == os.path.join(plain, 'checkpoints')
    rel = os.path.relpath(plain)
    assert workdir_lib.resolve(rel) == plain
    # Remote URIs keep their scheme (os.path.abspath would make 'gs:/b/x' under the cwd).
    for spelling in ('gs://bucket/run/', epath.Path('gs://bucket/run')):
        assert workdir_lib.resolve(spelling) == 'gs://bucket/run'
        assert checkpoint_dir(spelling) == 'gs://bucket/run/checkpoints'
        assert isinstance(workdir_lib.path(spelling), epath.Path)
        with workdir_lib.hold(spelling, 'pretrain'):  # object stores are not locked: no I/O
            pass


def test_results_written_through_epath_by_process_zero_only(tmp_path, monkeypatch):
    config = short_config()
    out = workdir_lib.write_results(epath.Path(tmp_path), 'pretrain', {'step': 3}, config)
    assert out == str(tmp_path / 'results.json')
    path = workdir_lib.write_results(pathlib.Path(tmp_path), 'pretrain', {'step': 5}, config)
    assert json.loads(pathlib.Path(path).read_text())['step'] == 5
    assert json.loads((tmp_path / 'results.step3.json').read_text())['step'] == 3
    with pytest.raises(ValueError, match="mode 'pretrain', not 'distill'"):
        workdir_lib.write_results(epath.Path(tmp_path), 'distill', {'step': 1}, config)

    monkeypatch.setattr(workdir_lib, '_process_index', lambda: 1)
    other = tmp_path / 'other'
    assert workdir_lib.write_results(other, 'pretrain', {'step': 1}, config) == str(
        other / 'results.json'
    )
    assert not other.exists()  # process 1 writes nothing


def test_metrics_on_an_object_store_rewrite_instead_of_append(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir_lib, '_is_local', lambda workdir: False)
    for run in range(2):  # a run, then a resumed run: rows accumulate
        writer = metrics.MetricsWriter(epath.Path(tmp_path))
        assert writer._file is None  # the object-store branch
        writer.write(run * 10 + 1, 'train', {'loss': 1.0})
        writer.write(run * 10 + 2, 'eval', {'loss': float('nan')})
        writer.close()
    rows = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    assert [(r['step'], r['split']) for r in rows] == [
        (1, 'train'),
        (2, 'eval'),
        (11, 'train'),
        (12, 'eval'),
    ]
    assert rows[1]['loss'] == 'nan'
