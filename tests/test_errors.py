"""Errors a user can act on: drift refusals name every changed field (and, in the quickstart,
only fields the user set), the quickstart takes --config.seed, refusals print one line without a
traceback unless asked, and SIGTERM to the quickstart exits 42 saying what was saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import prepared_stdlib_dir

from specjax import errors
from specjax.config_diff import ABSENT, differences
from specjax.config_files import load_config
from specjax.quickstart import pipeline

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / 'configs' / 'quickstart.py'
PACKAGE = str(ROOT / 'specjax')


def _parse(*argv):
    """The config specjax.main would build from these flags (ml_collections config_flags)."""
    from absl import flags
    from ml_collections import config_flags

    fv, argv = flags.FlagValues(), ['specjax', *argv]
    config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, sys_argv=argv)
    fv(argv)
    return fv.config


def test_differences_names_every_field_with_both_values():
    saved = {'a': 1, 'b': {'c': (1, 2), 'd': 'x'}, 'e': True, 'g': 2}
    current = {'a': 2, 'b': {'c': [1, 3], 'd': 'x', 'f': 0}, 'e': 1, 'g': 2.0}
    assert differences(saved, current) == [
        ('a', 1, 2),
        ('b.c', (1, 2), [1, 3]),
        ('b.f', ABSENT, 0),
        ('e', True, 1),  # a bool is not the int 1; 2 and 2.0 are the same number
    ]


def test_workdir_drift_refusal_names_every_changed_field():
    from specjax.workdir import ConfigMismatch, check_config_change

    saved = load_config(str(ROOT / 'configs' / 'pretrain.py:size=tiny'))
    current = load_config(str(ROOT / 'configs' / 'pretrain.py:size=tiny'))
    current.seed, current.train.steps, current.train.lr = 7, current.train.steps + 1, 0.5
    current.train.log_every = 3  # does not change a result: not named
    with pytest.raises(ConfigMismatch) as refused:
        check_config_change(saved, current, allow=False, where='W')
    for field in ('seed', 'train.steps', 'train.lr'):
        assert f"'{field}'" in str(refused.value)
    assert 'log_every' not in str(refused.value)


def _record_every_stage(config, workdir: Path) -> None:
    """quickstart_stage.json of every stage, as pipeline.run writes them before each stage."""
    for stage in pipeline.stages_of(config):
        if stage.name != 'report':
            cfg = pipeline.stage_config(config, stage)
            record = {'stage': stage.name, 'config': pipeline._identity(cfg)}
            wd = workdir / stage.name
            wd.mkdir(parents=True)
            (wd / pipeline.STAGE_FILE).write_text(json.dumps(record))


def test_quickstart_refusal_names_only_the_fields_the_user_changed(tmp_path):
    workdir = tmp_path / 'w'
    _record_every_stage(_parse(f'--config={QUICKSTART}:preset=embedded,size=tiny'), workdir)

    def refusal(*overrides) -> str:
        config = _parse(f'--config={QUICKSTART}:preset=embedded,size=tiny', *overrides)
        with pytest.raises(pipeline.StageError) as refused:
            pipeline.check_workdir(config, str(workdir), pipeline.selected(config))
        return str(refused.value)

    # target.train.steps also moves the fields computed from it (the target's checkpoint_every,
    # co-training's branch step) and co-training's steps (the same field): named once, as set.
    text = refusal('--config.target.train.steps=80')
    assert "stage 'target' of a different config" in text
    assert 'target.train.steps: 60 in the workdir, 80 now [stages target, cotrain]' in text
    assert 'and 1 field computed from it' in text
    for other in ('checkpoint_every', 'target_step', 'cotrain.train.steps'):
        assert other not in text, text
    # Two changes: both named, each once; the seed by its own name, for every stage.
    text = refusal('--config.seed=3', '--config.spec_eval.eval.max_new_tokens=9')
    assert 'seed: 0 in the workdir, 3 now [stages target, draft_ce' in text
    assert 'spec_eval.eval.max_new_tokens: 16 in the workdir, 9 now' in text
    assert 'target.seed' not in text and 'serve.' not in text, text
    assert len(text.splitlines()) == 1


def test_quickstart_accepts_a_workdir_older_than_a_default_valued_field(tmp_path):
    """A stage recorded before a DEFAULT_VALUED_FIELDS field existed matches while the field is
    at its default, and is refused naming it once set otherwise."""
    workdir = tmp_path / 'w'
    config = _parse(f'--config={QUICKSTART}:preset=embedded,size=tiny')
    _record_every_stage(config, workdir)
    record_file = workdir / 'spec_ce' / pipeline.STAGE_FILE
    record = json.loads(record_file.read_text())
    del record['config']['eval']['dynamic_greedy']  # as written before the field was added
    record_file.write_text(json.dumps(record))
    pipeline.check_workdir(config, str(workdir), pipeline.selected(config))
    config = _parse(
        f'--config={QUICKSTART}:preset=embedded,size=tiny',
        '--config.spec_eval.eval.dynamic_greedy=True',
    )
    named = r'spec_eval.eval.dynamic_greedy: \(absent\) in the workdir, True now'
    with pytest.raises(pipeline.StageError, match=named):
        pipeline.check_workdir(config, str(workdir), pipeline.selected(config))


@pytest.mark.parametrize('arg', ['preset=embedded,size=tiny', 'preset=smollm2,size=tiny'])
def test_quickstart_seed_sets_every_stage_seed(arg):
    config = _parse(f'--config={QUICKSTART}:{arg}', '--config.seed=11')
    seeds = {}
    for stage in pipeline.stages_of(config):
        cfg = pipeline.stage_config(config, stage)
        if 'seed' in cfg:
            seeds[stage.name] = cfg.seed
    assert len(seeds) >= 5 and set(seeds.values()) == {11}, seeds


def test_user_errors_are_told_from_library_errors():
    config = load_config(f'{QUICKSTART}:preset=embedded,size=tiny')
    config.stages = 'target,nonsense'
    with pytest.raises(ValueError) as ours:  # raised by specjax's own check: a refusal
        pipeline.selected(config)
    assert errors.is_user_error(ours.value, PACKAGE)
    with pytest.raises(ValueError) as numpy_error:
        np.zeros(3).reshape(2)
    assert not errors.is_user_error(numpy_error.value, PACKAGE)  # keeps its traceback
    assert not errors.is_user_error(KeyError('x'), PACKAGE)
    assert errors.is_user_error(errors.ConfigDriftError('a: 1 -> 2'), PACKAGE)
    assert errors.one_line(ValueError('two\n  lines')) == 'two lines'


def _main(*args, env=None, **popen):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
    return subprocess.Popen(
        [sys.executable, '-m', 'specjax.main', *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


@pytest.mark.parametrize('traceback', [False, True], ids=['one_line', 'traceback_asked'])
def test_refusal_is_one_line_and_leaves_nothing_behind(tmp_path, traceback):
    workdir = tmp_path / 'new'
    env = {errors.TRACEBACK_ENV: '1'} if traceback else {}
    args = (f'--config={ROOT}/configs/pretrain.py:size=tiny', f'--workdir={workdir}')
    proc = _main(*args, '--config.train.lr=-1.0', env=env)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == errors.USER_ERROR_EXIT_CODE, out
    assert 'FATAL config.train.lr must be > 0, got -1.0\n' in out
    assert ('Traceback (most recent call last)' in out) == traceback, out
    assert max(len(line) for line in out.splitlines()) < 400  # no config dump in the log
    assert not workdir.exists()  # the invocation record is withdrawn with its folders


def test_sigterm_to_the_quickstart_exits_42_saying_what_was_saved(tmp_path):
    workdir = tmp_path / 'q'
    proc = _main(
        f'--config={QUICKSTART}:preset=embedded,size=tiny',
        f'--workdir={workdir}',
        f'--config.data.data_dir={prepared_stdlib_dir()}',
        '--config.compilation_cache=',
        '--config.parallel_stages=1',
        '--config.stages=target',
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if '[quickstart] stage 1/1 target' in line:  # the stage runs in this process
            proc.send_signal(signal.SIGTERM)
            break
    out = ''.join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 42, out
    said = [line for line in out.splitlines() if 'rerun the same command to resume' in line]
    assert said and str(workdir / 'target') in said[0], out
    assert 'nothing of it was saved' in said[0] or 'is committed in' in said[0], out
    invocations = list((workdir / 'invocations').iterdir())
    assert len(invocations) == 1
    assert json.loads(invocations[0].read_text())['config']['target']['train']['steps'] == 60
