"""configs/ablations: each sweep's `:size=smoke` runs end to end (real modes, in-process points)
and its summary table's numbers equal the results.json the points wrote; the quantities the
ablations rest on hold in that JSON (predicted speedup = tau / (k c + v(k)); c and train FLOPs
grow with the draft; co-training gets the FLOPs of pretraining + distillation)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from data_fixtures import prepared_stdlib_dir

from specjax.main import resolve_mode
from specjax.models import TransformerConfig, presets
from specjax.sweeps import runner as sweep
from specjax.sweeps.spec import ConfigRef, plan_sweep, point_dir
from specjax.sweeps.summary_markdown import fmt
from specjax.train.runs import train_flops

_ABLATIONS = os.path.join(os.path.dirname(__file__), '..', 'configs', 'ablations')


def in_process(launch: sweep.Launch) -> int:
    """Runs the point's mode in this process (warm jit caches), as specjax.main would."""
    config = launch.run.config.load()
    config.update_from_flattened_dict(dict(launch.run.resolved))
    resolve_mode(config.mode)(config, launch.workdir)
    return 0


_TARGET = []  # the first smoke sweep's finished target prerequisite (identical in all three)


def smoke(name: str, workdir: str):
    """Sweeps configs/ablations/<name>.py:size=smoke on the tests' corpus; (config, summary).

    The three smoke configs pretrain the same target; later sweeps get a copy of the first
    one's finished prerequisite, which the runner skips as finished (same recorded identity).
    """
    config = ConfigRef(os.path.join(_ABLATIONS, f'{name}.py'), 'size=smoke').load()
    data_dir = ('data.data_dir', prepared_stdlib_dir())
    config.sweep.prereqs = tuple(
        dict(p, overrides=dict(p['overrides'], **dict([data_dir]))) for p in config.sweep.prereqs
    )
    config.sweep.overrides = tuple(config.sweep.overrides) + (data_dir,)
    config.sweep.bootstrap_resamples = 100
    target = os.path.join(workdir, 'prereq', 'target')
    if _TARGET:
        shutil.copytree(_TARGET[0], target)
    summary = sweep.run(config, workdir, launcher=in_process)
    _TARGET[:] = _TARGET or [target]
    return config, summary


def results_of(config, workdir: str) -> dict[str, dict]:
    """label -> the results.json its (single) seed wrote, read straight from disk."""
    plan = plan_sweep(config.sweep, workdir)
    out = {}
    for run in plan.points:
        with open(os.path.join(point_dir(plan, run), 'results.json')) as f:
            out[run.label] = json.load(f)
    return out


def get(results: dict, key: str):
    node = results
    for part in key.split('.'):
        node = node[part]
    return node


def main_table(workdir: str) -> dict[str, dict[str, str]]:
    """summary.md's first table: point label -> column -> cell text."""
    with open(os.path.join(workdir, 'summary.md')) as f:
        lines = [line for line in f.read().splitlines() if line.startswith('|')]
    header = [c.strip() for c in lines[0].strip('|').split('|')]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip('|').split('|')]
        if cells[0] == 'metric':  # the verdicts table starts
            break
        rows[cells[0]] = dict(zip(header, (c.strip('*') for c in cells)))
    return rows


def assert_table_equals_json(config, workdir: str) -> dict[str, dict]:
    results, table = results_of(config, workdir), main_table(workdir)
    assert set(table) == set(results)
    for label, res in results.items():
        for metric in config.sweep.metrics:
            cell = table[label][metric]
            assert cell == f'{fmt(float(get(res, metric)))} (n=1)', (label, metric, cell)
    assert sorted(os.listdir(os.path.join(workdir, 'plots')))
    return results


@pytest.fixture(scope='module')
def workdirs(tmp_path_factory):
    return tmp_path_factory.mktemp('ablations')


def test_k_temperature_smoke(workdirs):
    workdir = str(workdirs / 'k_temperature')
    config, summary = smoke('k_temperature', workdir)
    results = assert_table_equals_json(config, workdir)
    for label, res in results.items():
        p = res['point']
        t, k = re.fullmatch(r'temperature-(.*)__k-(.*)', label).groups()
        assert (p['temperature'], p['k']) == (float(t), int(k))
        assert p['predicted_speedup'] == pytest.approx(
            p['block_efficiency'] / (p['k'] * res['c'] + p['v_k']), rel=1e-9
        )
        assert 1.0 <= p['block_efficiency'] <= p['k'] + 1
    with open(os.path.join(workdir, 'summary.md')) as f:
        text = f.read()
    assert '### point.measured_speedup' in text and '| temperature \\ k | 2 |' in text
    assert os.path.isfile(os.path.join(workdir, 'plots', 'point.measured_speedup.png'))


def test_draft_size_smoke(workdirs):
    workdir = str(workdirs / 'draft_size')
    config, summary = smoke('draft_size', workdir)
    results = assert_table_equals_json(config, workdir)
    small, big = results['draft-test'], results['draft-tiny']
    for name, res in (('test', small), ('tiny', big)):
        shape = presets.shape('draft', name)
        draft = TransformerConfig(vocab_size=1024, max_len=128, **shape)
        assert res['num_params_draft'] == draft.num_params
        assert res['cost_ratio_c'] > 0 and res['verify_cost_v4'] > 0
    assert big['train_flops'] > small['train_flops']
    assert big['num_params_draft'] > small['num_params_draft']


def test_cotrain_vs_distill_smoke_matches_flops(workdirs):
    workdir = str(workdirs / 'cotrain_vs_distill')
    config, summary = smoke('cotrain_vs_distill', workdir)
    results = assert_table_equals_json(config, workdir)
    with open(os.path.join(workdir, 'prereq', 'target', 'results.json')) as f:
        target = json.load(f)
    budget = target['train_flops'] + results['distill']['train_flops']
    assert results['ce']['train_flops'] == results['distill']['train_flops']
    t = TransformerConfig(vocab_size=1024, max_len=128, **presets.shape('target', 'tiny'))
    d = TransformerConfig(vocab_size=1024, max_len=128, **presets.shape('draft', 'test'))
    cotrain_step = train_flops([t, d], seq_len=128, tokens=8 * 128)
    assert abs(results['cotrain']['train_flops'] - budget) <= cotrain_step / 2
    prereq_row = summary['prereqs'][0]
    assert prereq_row['metrics']['train_flops'] == target['train_flops']
    with open(os.path.join(workdir, 'summary.md')) as f:
        assert f'prereq target (complete; train_flops {fmt(target["train_flops"])}' in f.read()


def test_tiny_presets_plan_against_the_real_configs(tmp_path):
    def plan(name):
        config = ConfigRef(os.path.join(_ABLATIONS, f'{name}.py'), 'size=tiny').load()
        return plan_sweep(config.sweep, str(tmp_path / name))  # every field checked

    kt = plan('k_temperature')
    assert len(kt.points) == 4 * 3 * 2 and kt.grid_fields == ('temperature', 'k')
    assert dict(kt.points[0].resolved)['eval.ks'] == (1,)
    ds = plan('draft_size')
    assert ds.labels == ('draft-test', 'draft-tiny', 'draft-small')
    assert dict(ds.points[-1].resolved)['draft.d_model'] == presets.DRAFTS['small']['d_model']
    cd = plan('cotrain_vs_distill')
    assert cd.labels == ('distill', 'ce', 'cotrain')
    assert os.path.basename(cd.points[-1].config.path) == 'cotrain.py'
