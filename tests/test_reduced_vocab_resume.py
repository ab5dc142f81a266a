"""The reduced-vocabulary draft trains through the shared loop (specjax.distill.reduced_task) as
every mode does: it resumes bit-identically after kill -9 and after SIGTERM (preempted, its
checkpoint committed), refuses a second writer at once naming the holder, and refuses a workdir
of another mode or a changed teacher cache. The tiny teacher cache of test_reduced_vocab_distill;
the helpers of test_checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_checkpoint import _snapshot, params_of, sigterm_at, steps_in
from test_quickstart_presets import _load_config
from test_reduced_vocab_distill import (  # noqa: F401 (setup: the fixture)
    _cache,
    _draft_config,
    _StubTokenizer,
    setup,
)

from specjax.distill import reduced_train as rt
from specjax.workdir import ConfigMismatch, WorkdirBusy

# The child trains _config() and kills itself (SIGKILL) once step 5 is done: checkpoints 2 and 4
# are on disk, step 5 is lost.
_CHILD = """
import os, signal, sys
from test_reduced_vocab_distill import _StubTokenizer
from test_reduced_vocab_resume import _config
from specjax.distill import reduced_train as rt

def kill_at_5(step, state):
    if step == 5:
        os.kill(os.getpid(), signal.SIGKILL)

rt.train_draft(_config(), sys.argv[1], _StubTokenizer(), sys.argv[2], on_step=kill_at_5)
"""


def _config():
    c = _draft_config(1.0, 0.0, steps=8)
    c.train.eval_every, c.train.checkpoint_every = 4, 2
    return c


def _child_env():
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or '',
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0.2',
    )


def _eval_rows(workdir):
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f]
    by_step = {r['step']: r for r in rows if r['split'] == 'eval'}  # reruns repeat a step
    return {s: {k: v for k, v in r.items() if k != 'time'} for s, r in by_step.items()}


def test_killed_then_preempted_draft_resumes_bit_identically(setup, tmp_path):  # noqa: F811
    cache, tok = _cache(setup, tmp_path), _StubTokenizer()
    full = rt.train_draft(_config(), cache, tok, str(tmp_path / 'full'))
    work = tmp_path / 'resumed'
    child = subprocess.run(
        [sys.executable, '-c', _CHILD, cache, str(work)],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert steps_in(work) == [2, 4] and not (work / rt.DRAFT_VOCAB_FILE).exists()

    handler = signal.getsignal(signal.SIGTERM)
    part = rt.train_draft(_config(), cache, tok, str(work), on_step=sigterm_at(7))
    assert part == dict(mode='distill_reduced', step=7, preempted=True,
                        checkpoint_dir=str(work / 'checkpoints'), checkpoint_step=7)  # fmt: skip
    assert signal.getsignal(signal.SIGTERM) is handler
    assert steps_in(work) == [6, 7]  # keep_checkpoints defaults to 2
    done = rt.train_draft(_config(), cache, tok, str(work))
    assert done.pop('train_seconds') >= 0 and full.pop('train_seconds') >= 0
    assert done == full and done['step'] == 8
    want, meta_full = params_of(tmp_path / 'full')
    got, meta = params_of(work)
    assert meta_full['step'] == meta['step'] == 8 and meta['mode'] == 'distill_reduced'
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _eval_rows(work).keys() == {4, 8}
    for step, row in _eval_rows(tmp_path / 'full').items():
        assert {k: row[k] for k in ('alpha_T1', 'alpha_T0', 'draft_val_loss')} == {
            k: _eval_rows(work)[step][k] for k in ('alpha_T1', 'alpha_T0', 'draft_val_loss')
        }
    vocab = [json.loads((d / rt.DRAFT_VOCAB_FILE).read_text()) for d in (tmp_path / 'full', work)]
    assert vocab[0] == vocab[1]

    # Another teacher cache (one token changed) is refused before anything is trained.
    _, arrays = rt.load_cache(cache)
    arrays['train_tokens'][0, 0] += 1
    other = str(tmp_path / 'other_cache')
    rt.save_cache(other, json.loads((tmp_path / 'cache' / rt.VOCAB_FILE).read_text()), arrays)
    before = _snapshot(work)
    with pytest.raises(ConfigMismatch, match='cache_sha256: '):
        rt.train_draft(_config(), other, tok, str(work))
    assert _snapshot(work) == before


def test_second_writer_and_other_modes_are_refused(setup, tmp_path):  # noqa: F811
    from specjax.checkpoint import write_workdir
    from specjax.quickstart.smollm2 import check_config

    cache, tok = _cache(setup, tmp_path), _StubTokenizer()
    held = tmp_path / 'held'
    holder = subprocess.Popen(
        [
            sys.executable,
            '-c',
            'import sys, time\nfrom specjax.workdir import hold\n'
            "with hold(sys.argv[1], 'distill_reduced'):\n    print('held', flush=True)\n"
            '    time.sleep(120)\n',
            str(held),
        ],
        env=_child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == 'held'
        before = _snapshot(held)
        with pytest.raises(WorkdirBusy, match=rf'in use by host .* pid {holder.pid} '):
            rt.train_draft(_config(), cache, tok, str(held))
        assert _snapshot(held) == before
    finally:
        holder.kill()
        holder.wait()

    pretrained = tmp_path / 'pretrain'
    pretrained.mkdir()
    (pretrained / 'results.json').write_text(json.dumps({'mode': 'pretrain', 'step': 3}))
    with pytest.raises(ValueError, match="written by mode 'pretrain', not 'distill_reduced'"):
        rt.train_draft(_config(), cache, tok, str(pretrained))
    imported = str(tmp_path / 'imported')
    write_workdir(setup['teacher'], tok, imported, source={}, mode='import')
    with pytest.raises(ConfigMismatch, match="no 'reduced_vocab' metadata.*mode='import'"):
        rt.train_draft(_config(), cache, tok, imported)
    c = _config()
    c.train.weight_decay = 0.1
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['config.train.weight_decay'"):
        rt.train_draft(c, cache, tok, str(tmp_path / 'bad'))
    assert not (tmp_path / 'bad').exists()
    c = _load_config('preset=smollm2')  # the preset checks its drafts' loop fields up front
    c.draft_ce.train.checkpoint_every = 0
    with pytest.raises(ValueError, match=r'config.draft_ce.train.checkpoint_every must be a pos'):
        check_config(c)
