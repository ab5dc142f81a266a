"""Sweep runner: validation, restart/skip, failures, aggregation with bootstrap CIs, verdicts.

Points here do no training: the base config is a tiny file written per test, and points run
either through an in-process fake launcher (counts calls, writes results.json from the config)
or, once, through the real subprocess launcher with a fake absl entry script.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import ml_collections
import numpy as np
import pytest

from specjax.sweeps import aggregate
from specjax.sweeps import runner as sweep
from specjax.sweeps.spec import ConfigRef, format_override, plan_sweep

BASE = """
import ml_collections

def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.mode = 'fake'
    c.seed = 0
    c.x = 1.0            # grid field
    c.name = 'a'
    c.flag = False
    c.tup = (1, 2)
    c.teacher = ''       # set to a prerequisite's workdir
    c.fail = False       # the fake point exits 1 when set
    c.section = ml_collections.ConfigDict({'y': 2})
    if arg == 'size=big':
        c.section.y = 20
    return c
"""

ENTRY = """
import json, os, sys
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config')
_WORKDIR = flags.DEFINE_string('workdir', None, 'workdir')

def main(argv):
    c = _CONFIG.value
    print('fake point running', flush=True)
    if c.fail:
        sys.exit(3)
    out = {'score': c.x + c.seed, 'echo': {'name': c.name, 'flag': c.flag, 'tup': list(c.tup),
           'y': c.section.y, 'teacher': c.teacher}}
    with open(os.path.join(_WORKDIR.value, 'results.json'), 'w') as f:
        json.dump(out, f)

app.run(main)
"""


def load_point_config(launch: sweep.Launch) -> ml_collections.ConfigDict:
    config = launch.run.config.load()
    config.update_from_flattened_dict(dict(launch.run.resolved))
    return config


class FakeLauncher:
    """In-process point: results.json holds score = values[x][seed] (or x + seed)."""

    def __init__(self, values=None, honour_fail=True):
        self.values = values or {}
        self.honour_fail = honour_fail
        self.calls = []

    def __call__(self, launch: sweep.Launch) -> int:
        self.calls.append(launch.run.name)
        c = load_point_config(launch)
        if c.fail and self.honour_fail:
            return 1
        if launch.run.kind == 'prereq':
            with open(os.path.join(launch.workdir, 'model.txt'), 'w') as f:
                f.write('pretrained')
            return 0
        score = self.values.get(c.x, {}).get(c.seed, c.x + c.seed) + (100 if c.name == 'ce' else 0)
        margin = 0.0 if c.x == 3.0 else score  # x=3.0 drops out: a clear winner
        results = {
            'score': score,
            'loss': -score,
            'nested': {'v': 2 * score},
            'ok': True,
            'margin': margin,
        }
        with open(os.path.join(launch.workdir, 'results.json'), 'w') as f:
            json.dump(results, f)
        return 0


@pytest.fixture
def base_file(tmp_path):
    path = tmp_path / 'base.py'
    path.write_text(BASE)
    return str(path)


def make_config(base_file, **sweep_fields):
    config = ml_collections.ConfigDict()
    config.mode = 'sweep'
    config.sweep = sweep.default_sweep_config()
    config.sweep.base = base_file
    config.sweep.bootstrap_resamples = 500
    config.sweep.plot_metrics = ('score',)
    for k, v in sweep_fields.items():
        config.sweep[k] = v
    return config


def test_unknown_field_is_rejected_before_running(base_file, tmp_path):
    launcher = FakeLauncher()
    bad = {
        'grid': (('x', (1.0, 2.0)), ('section.z', (1, 2))),
        'variants': (('v', {'nope.x': 1}),),
        'overrides': (('nme', 'b'),),
    }
    for key, value in bad.items():
        config = make_config(base_file, **{key: value})
        with pytest.raises(ValueError, match=r"section\.z|nope\.x|'nme'"):
            sweep.run(config, str(tmp_path / 'w'), launcher=launcher)
    config = make_config(base_file, grid=(('x', ('high', 'low')),))
    with pytest.raises(ValueError, match="'high' does not fit field 'x'"):
        sweep.run(config, str(tmp_path / 'w'), launcher=launcher)
    config = make_config(base_file, overrides=(('teacher', '${prereq.missing}'),))
    with pytest.raises(ValueError, match='prereq.missing'):
        sweep.run(config, str(tmp_path / 'w'), launcher=launcher)
    assert launcher.calls == []
    assert not os.path.exists(tmp_path / 'w')


def test_restart_skips_finished_and_never_overwrites(base_file, tmp_path):
    workdir = str(tmp_path / 'w')
    config = make_config(
        base_file,
        grid=(('x', (1.0, 2.0, 3.0)), ('fail', (False, True))),
        variants=(('baseline', {'x': 1.0, 'fail': False, 'name': 'ce'}),),  # on a grid cell
        seeds=2,
    )
    first = FakeLauncher()
    with pytest.raises(sweep.SweepFailed, match='6 point'):
        sweep.run(config, workdir, launcher=first)
    assert len(first.calls) == (3 * 2 + 1) * 2
    done = {
        n: os.path.join(workdir, 'points', n) for n in os.listdir(os.path.join(workdir, 'points'))
    }
    finished = {n: d for n, d in done.items() if 'fail-True' not in n}
    assert len(finished) == 8 and all(
        sweep.read_status(d)['status'] == 'complete' for d in finished.values()
    )
    failed = [n for n in done if n not in finished]
    assert all(sweep.read_status(done[n])['status'] == 'failed' for n in failed)
    snapshot = {n: open(os.path.join(d, 'results.json')).read() for n, d in finished.items()}
    summary = json.load(open(os.path.join(workdir, 'summary.json')))
    assert {p['status'] for p in summary['points']} == {'complete', 'failed'}

    second = FakeLauncher()  # restart: only the failed points run again (and fail again)
    with pytest.raises(sweep.SweepFailed):
        sweep.run(config, workdir, launcher=second)
    assert sorted(second.calls) == sorted(failed)
    for n, d in finished.items():
        assert open(os.path.join(d, 'results.json')).read() == snapshot[n]

    fixed = FakeLauncher(honour_fail=False)  # the bug is fixed: failed points now finish
    sweep.run(config, workdir, launcher=fixed)
    assert sorted(fixed.calls) == sorted(failed)
    third = FakeLauncher()
    summary = sweep.run(config, workdir, launcher=third)
    assert third.calls == []
    assert os.path.isfile(os.path.join(workdir, 'plots', 'score.png'))
    assert len(summary['configurations']) == 7
    assert all(c['n_complete'] == 2 for c in summary['configurations'])
    md = open(os.path.join(workdir, 'summary.md')).read()
    assert '| 1.0 | 1.5 [1, 2] | 1.5 [1, 2] |' in md  # the variant stays out of the grid table
    assert '- baseline: **101.5 [101, 102]**' in md

    config.sweep.overrides = (('name', 'changed'),)  # finished points with other settings
    with pytest.raises(ValueError, match='never overwritten'):
        sweep.run(config, workdir, launcher=third)
    assert third.calls == []


def test_aggregation_matches_numpy_and_verdicts(base_file, tmp_path):
    values = {
        1.0: {0: 1.0, 1: 1.2, 2: 1.1},
        2.0: {0: 5.0, 1: 5.3, 2: 5.1},
        3.0: {0: 4.0, 1: 5.2, 2: 6.1},
    }
    config = make_config(
        base_file,
        grid=(('x', (1.0, 2.0, 3.0)),),
        seeds=3,
        metrics=('score', 'loss', 'nested.v', 'margin'),
        minimize=('loss',),
    )
    summary = sweep.run(config, str(tmp_path / 'w'), launcher=FakeLauncher(values))
    by_label = {c['label']: c for c in summary['configurations']}
    for x, seeds in values.items():
        v = np.array([seeds[s] for s in range(3)])
        idx = np.random.default_rng(0).integers(0, 3, size=(500, 3))
        lo, hi = np.percentile(v[idx].mean(axis=1), [2.5, 97.5])
        stats = by_label[f'x-{x}']['metrics']['score']
        np.testing.assert_allclose([stats['mean'], stats['lo'], stats['hi']], [v.mean(), lo, hi])
        assert by_label[f'x-{x}']['metrics']['nested.v']['mean'] == pytest.approx(2 * v.mean())
        assert by_label[f'x-{x}']['sources'] == [
            f'points/x-{x}__seed-{s}/results.json' for s in range(3)
        ]
    verdicts = {m['metric']: m for m in summary['metrics']}
    # x=3 spans [4.0, 6.1]: it overlaps the best mean (x=2) -> no clear winner, for both directions
    assert verdicts['score']['best'] == 'x-2.0' and verdicts['score']['kind'] == 'no clear winner'
    assert verdicts['score']['overlaps'] == ['x-3.0']
    assert verdicts['loss']['better'] == 'lower' and verdicts['loss']['best'] == 'x-2.0'
    assert verdicts['margin']['kind'] == 'winner' and verdicts['margin']['best'] == 'x-2.0'
    md = open(tmp_path / 'w' / 'summary.md').read()
    assert 'no clear winner (best mean x-2.0 overlaps x-3.0)' in md
    assert '| margin | higher | x-2.0 | winner: x-2.0 |' in md
    assert '**5.133 [' in md and 'points/x-1.0__seed-0/results.json' in md
    csv_rows = open(tmp_path / 'w' / 'summary.csv').read().splitlines()
    assert csv_rows[0].startswith(
        'point,x,n_complete,n_points,score_mean,score_lo,score_hi,score_n'
    )
    assert len(csv_rows) == 4


def test_verdict_definitions():
    def s(mean, lo, hi, n=3):
        return {'mean': mean, 'lo': lo, 'hi': hi, 'n': n}

    clear = aggregate.verdict({'a': s(1, 0.9, 1.1), 'b': s(2, 1.8, 2.2), 'c': s(0, -1, 0.5)}, True)
    assert clear['kind'] == 'winner' and clear['best'] == 'b' and clear['text'] == 'winner: b'
    low = aggregate.verdict({'a': s(1, 0.9, 1.1), 'b': s(2, 1.8, 2.2)}, False)
    assert low['kind'] == 'winner' and low['best'] == 'a'
    # runner-up separated, but a wide third interval reaches the best one
    wide = aggregate.verdict({'a': s(2, 1.9, 2.1), 'b': s(1.5, 1.4, 1.6), 'c': s(1, 0, 2)}, True)
    assert wide['kind'] == 'no clear winner' and wide['overlaps'] == ['c']
    touching = aggregate.verdict({'a': s(2, 1.5, 2.5), 'b': s(1, 0.5, 1.5)}, True)
    assert touching['kind'] == 'no clear winner'
    one_seed = aggregate.verdict({'a': s(2, np.nan, np.nan, 1), 'b': s(1, 0.5, 1.5)}, True)
    assert one_seed['kind'] == 'no interval' and one_seed['best'] == 'a'
    assert np.isnan(aggregate.bootstrap_ci([3.0])).all()
    assert aggregate.bootstrap_ci([1.0, 2.0, 3.0]) == aggregate.bootstrap_ci([1.0, 2.0, 3.0])


def test_prereq_runs_once_first_and_is_referenced(base_file, tmp_path):
    workdir = str(tmp_path / 'w')
    config = make_config(
        base_file,
        prereqs=({'name': 'target', 'config': f'{base_file}:size=big', 'overrides': {'x': 9.0}},),
        overrides=(('teacher', '${prereq.target}/ckpt'),),
        grid=(('x', (1.0, 2.0)),),
        seeds=1,
    )
    launcher = FakeLauncher()
    sweep.run(config, workdir, launcher=launcher)
    assert launcher.calls == ['target', 'x-1.0__seed-0', 'x-2.0__seed-0']
    status = sweep.read_status(os.path.join(workdir, 'points', 'x-1.0__seed-0'))
    assert f'--config.teacher={workdir}/prereq/target/ckpt' in status['command']
    assert '${prereq.target}' in json.dumps(status['identity'])  # identity survives a moved workdir
    launcher.calls.clear()
    sweep.run(config, workdir, launcher=launcher)
    assert launcher.calls == []


def test_subprocess_launcher_round_trips_overrides(base_file, tmp_path, capsys):
    entry = tmp_path / 'fake_main.py'
    entry.write_text(textwrap.dedent(ENTRY))
    workdir = str(tmp_path / 'w')
    config = make_config(
        f'{base_file}:size=big',
        overrides=(('name', 'with space'), ('flag', True), ('tup', (3, 4, 5))),
        grid=(('x', (0.5,)), ('fail', (False, True))),
        seeds=1,
        first_seed=7,
    )
    with pytest.raises(sweep.SweepFailed, match='1 point'):
        sweep.run(config, workdir, entry=(str(entry),))
    ok = os.path.join(workdir, 'points', 'x-0.5__fail-False__seed-7')
    results = json.load(open(os.path.join(ok, 'results.json')))
    assert results == {
        'score': 7.5,
        'echo': {'name': 'with space', 'flag': True, 'tup': [3, 4, 5], 'y': 20, 'teacher': ''},
    }
    bad = os.path.join(workdir, 'points', 'x-0.5__fail-True__seed-7')
    assert 'fake point running' in open(os.path.join(bad, 'sweep.log')).read()
    assert sweep.read_status(bad)['error'] == 'exit status 3'
    assert 'FAILED' in capsys.readouterr().out
    assert 'fail-True' in open(os.path.join(workdir, 'summary.md')).read()


def test_dry_run_and_override_format(base_file, tmp_path, capsys):
    config = make_config(base_file, grid=(('x', (1.0, 2.0)),), seeds=2, dry_run=True)
    assert sweep.run(config, str(tmp_path / 'w'), launcher=FakeLauncher()) == {}
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all('-m specjax.main' in line for line in lines)
    assert '--config.x=2.0' in lines[-1] and '--config.seed=1' in lines[-1]
    assert format_override('tup', [1, 2]) == '--config.tup=(1, 2)'
    assert format_override('flag', False) == '--config.flag=false'
    assert ConfigRef.parse('a/b.py:size=tiny,x=1', 'w') == ConfigRef('a/b.py', 'size=tiny,x=1')
    assert sys.executable in lines[0]


def test_distillspec_config_plans_21_configurations(tmp_path):
    from specjax.main import resolve_mode

    assert resolve_mode('sweep') is sweep.run
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = ConfigRef(os.path.join(root, 'configs/ablations/distillspec.py'), 'size=tiny').load()
    plan = plan_sweep(config.sweep, str(tmp_path))  # every field checked against the real configs
    assert len(plan.labels) == 21 and len(plan.points) == 63 and plan.variants == ('ce_baseline',)
    assert [p.name for p in plan.prereqs] == ['target']
    resolved = dict(plan.points[0].resolved)
    assert resolved['distill.teacher_workdir'] == str(tmp_path / 'prereq' / 'target')
    assert dict(plan.points[-1].resolved)['distill.kd_weight'] == 0.0


def test_unfinished_point_with_other_settings_is_moved_aside(base_file, tmp_path):
    workdir = str(tmp_path / 'w')
    config = make_config(base_file, overrides=(('fail', True),), seeds=1)
    with pytest.raises(sweep.SweepFailed):
        sweep.run(config, workdir, launcher=FakeLauncher())
    config.sweep.overrides = (('fail', False),)  # fixed settings: old checkpoints must not resume
    launcher = FakeLauncher()
    sweep.run(config, workdir, launcher=launcher)
    assert launcher.calls == ['base__seed-0']
    (stale,) = os.listdir(os.path.join(workdir, 'stale'))
    assert stale.startswith('base__seed-0.')
    assert sweep.read_status(os.path.join(workdir, 'stale', stale))['status'] == 'failed'


def test_named_axis_sets_its_fields_and_variant_runs_its_own_config(base_file, tmp_path):
    other = tmp_path / 'other.py'
    other.write_text(BASE.replace("c.name = 'a'", "c.name = 'a'\n    c.only_here = 0"))
    grid = (('size', ((1, {'x': 1.0, 'tup': (1, 1)}), (2, {'x': 2.0, 'tup': (2, 2)}))),)
    variants = (('alt', {'only_here': 5}, str(other)),)
    config = make_config(base_file, grid=grid, variants=variants, seeds=1, metrics=('score',))
    plan = plan_sweep(config.sweep, str(tmp_path / 'w'))
    assert plan.labels == ('size-1', 'size-2', 'alt') and plan.grid_fields == ('size',)
    size2 = plan.points[1]
    assert dict(size2.resolved) == {'x': 2.0, 'tup': (2, 2), 'seed': 0}
    assert size2.fields == (('size', 2),) and size2.config.path == base_file
    assert plan.points[2].config.path == str(other)
    summary = sweep.run(config, str(tmp_path / 'w'), launcher=FakeLauncher())
    means = {c['label']: c['metrics']['score']['mean'] for c in summary['configurations']}
    assert means == {'size-1': 1.0, 'size-2': 2.0, 'alt': 1.0}
    with open(tmp_path / 'w' / 'summary.md') as f:
        assert '## Run time' in f.read()
    bad = make_config(base_file, variants=(('alt', {'only_here': 5}),))
    with pytest.raises(ValueError, match="'only_here' does not exist"):
        plan_sweep(bad.sweep, str(tmp_path / 'w2'))  # checked against base, which lacks it
    mixed = make_config(base_file, grid=(('x', (1.0, (2.0, {'x': 2.0}))),))
    with pytest.raises(ValueError, match='mix of plain values'):
        plan_sweep(mixed.sweep, str(tmp_path / 'w3'))


def test_renamed_config_files_keep_matching_recorded_runs():
    """A run recorded with configs/target.py (the old name) is the same run as pretrain.py."""
    from specjax.sweeps.spec import same_identity

    now = {'config_file': 'pretrain.py', 'config_arg': 'size=tiny', 'overrides': []}
    assert same_identity(dict(now, config_file='target.py'), now)
    assert same_identity(now, now)
    assert not same_identity(dict(now, config_arg='size=small'), now)
    assert not same_identity(dict(now, config_file='distill.py'), now)
    assert not same_identity(None, now)
