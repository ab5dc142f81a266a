"""quickstart mode: every stage end to end (tiny, further reduced), the report's numbers equal the
stages' JSON, a rerun reuses every stage, and bad input fails before anything is written."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from data_fixtures import prepared_stdlib_dir

from specjax.config_files import load_config
from specjax.evaluation import intervals
from specjax.evaluation.tables import fmt, fmt_interval, human_label
from specjax.quickstart import pipeline as quickstart
from specjax.quickstart import report as quickstart_report
from specjax.quickstart import stage_runner
from specjax.sampling import stats as st

_CONFIG = os.path.join(os.path.dirname(__file__), '..', 'configs', 'quickstart.py')
SECTIONS = (
    '## Target: distilled tau >= 1.25 x cross-entropy tau',
    '## Speculative decoding vs distillation vs both',
    '## Models and run times',
    '## Speculative decoding with each draft',
    '### Acceptance per position',
    '### Acceptance by temperature and top-p',
    '### Acceptance by domain',
    '### Acceptance by prompt length',
    '### Acceptance by generated length',
    '### The same alpha on an accelerator (a model, not a measurement)',
    '## Serving: latency, throughput, memory',
    '## Distillation as replacement: the draft served alone',
    '### Samples side by side',
    '## Alpha over training steps',
    '## Plots',
)


def _config(target_lr=3e-3, **steps):
    c = load_config(f'{_CONFIG}:preset=embedded,size=tiny')
    c.data.data_dir = prepared_stdlib_dir()
    c.compilation_cache = ''  # tests/conftest.py already set the suite's cache
    # cotrain follows the target's schedule from step 24 - 12 (configs/quickstart.py's references)
    for section, n in (('target', 24), ('draft_ce', 12), ('draft_distilled', 12)):
        t = c[section].train
        t.steps = steps.get(section, n)
        t.warmup_steps, t.log_every = 2, 6
        t.eval_every, t.eval_batches = t.steps // 2, 2
        if section != 'target':  # the target's checkpoint_every is where co-training starts
            t.checkpoint_every = t.steps
    c.target.train.lr = target_lr
    ev = c.spec_eval.eval
    ev.prompts_per_domain, ev.max_new_tokens, ev.ks = 2, 8, (1, 2)
    ev.gen_len_edges = (4, 8)
    ev.timing_repeats = ev.calibration_repeats = 1
    ev.calibration_iters = 2
    c.serve.max_new_tokens, c.serve.repeats, c.serve.batch_sizes = 6, 2, (1, 4)
    return c


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp('quickstart') / 'w')
    config = _config()
    t0 = time.perf_counter()
    outcome = quickstart.run(config, workdir)
    return config, workdir, outcome, time.perf_counter() - t0


def _cell(report: str, row_start: str, column: int, after: str = '') -> str:
    """Cell `column` of the first table row starting with `row_start` below heading `after`."""
    for line in report[report.index(after) :].splitlines():
        if line.startswith(row_start):
            return [c.strip() for c in line.strip('|').split('|')][column]
    raise AssertionError(f'no row starting {row_start!r}')


def test_every_stage_runs_and_report_has_every_section_and_plot(finished):
    _, workdir, outcome, _ = finished
    assert outcome == {name: 'ran' for name in quickstart.STAGE_NAMES}
    text = open(os.path.join(workdir, 'report.md')).read()
    for heading in SECTIONS:
        assert heading in text, heading
    for name in (
        'quality_vs_latency',
        'acceptance_by_position',
        'speedup_vs_k',
        'alpha_over_steps',
        'acceptance_by_temperature_domain',
    ):
        path = os.path.join(workdir, 'plots', f'{name}.png')
        with open(path, 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n'
        assert f'(plots/{name}.png)' in text


def test_training_stages_ran_side_by_side_and_timing_stages_alone(finished):
    config, workdir, outcome, _ = finished
    with open(os.path.join(workdir, 'quickstart.json')) as f:
        run = json.load(f)
    beside = run['stage_beside']
    assert 'draft_distilled' in beside['draft_ce']  # 2 workers on this 2-core CPU (auto)
    for stage in ('target', 'spec_ce', 'spec_distilled', 'spec_cotrain', 'serve'):
        assert beside[stage] == [], (stage, beside[stage])
    for stage in ('draft_ce', 'draft_distilled', 'cotrain'):  # their processes logged here
        with open(os.path.join(workdir, stage, 'log.txt')) as f:
            assert 'results: ' in f.read()
    assert run['total_seconds'] >= max(run['stage_seconds'].values())


def test_every_stage_records_the_same_input_digests_and_the_report_names_them(finished):
    _, workdir, _, _ = finished
    recorded = {}
    for stage in ('target', 'draft_ce', 'draft_distilled', 'cotrain', 'spec_ce', 'spec_cotrain'):
        with open(os.path.join(workdir, stage, 'results.json')) as f:
            recorded[stage] = json.load(f)['digests']
    first = recorded['target']
    assert all(d == first for d in recorded.values()), recorded  # one corpus, one tokenizer
    assert first['corpus']['name'] == 'specjax_stdlib' and len(first['corpus']['sha256']) == 64
    assert first['tokenizer']['kind'] == 'sentencepiece'
    text = open(os.path.join(workdir, 'report.md')).read()
    assert f'specjax_stdlib {first["corpus"]["sha256"][:16]}' in text
    assert f'sentencepiece {first["tokenizer"]["sha256"][:16]}' in text


def test_parallel_stages_must_be_a_count():
    config = _config()
    config.parallel_stages = -1
    with pytest.raises(ValueError, match='config.parallel_stages must be an int >= 0'):
        stage_runner.workers(config)


def test_cotrained_target_is_the_pretrained_target(finished):
    """Co-training branched off the target's pretraining at step 24 - 12 with its optimizer state
    and data position: the co-trained target ends where the pretrained one did."""
    _, root, _, _ = finished
    with open(os.path.join(root, 'cotrain', 'results.json')) as f:
        cotrain = json.load(f)
    with open(os.path.join(root, 'target', 'results.json')) as f:
        target = json.load(f)
    assert cotrain['step'] == 24 and cotrain['num_params_target'] == target['num_params']
    assert abs(cotrain['target_val_loss'] - target['eval']['loss']) < 1e-4


def test_report_numbers_equal_the_json(finished):
    _, workdir, _, _ = finished
    text = open(os.path.join(workdir, 'report.md')).read()
    d = quickstart_report.load(workdir)
    k = quickstart_report.ref_k(d['spec_distilled'])
    for label in ('T=0', 'T=1,top_k=0,top_p=1'):
        row = f'| {human_label(label)} | {k} |'
        ce_run = quickstart_report.run_at(d['spec_ce'], label, k)
        di_run = quickstart_report.run_at(d['spec_distilled'], label, k)
        ce, di = ce_run['block_efficiency'], di_run['block_efficiency']
        assert _cell(text, row, 2) == fmt(ce)
        assert _cell(text, row, 3) == fmt(di)
        assert _cell(text, row, 4) == fmt(di / ce)
        assert _cell(text, row, 6) == fmt(di_run['alpha'])
        needed = st.alpha_for_tau(1.25 * ce, k)
        assert _cell(text, row, 7) == fmt(needed)
        assert st.expected_block_efficiency(needed, k) == pytest.approx(1.25 * ce)
        # the ratio's paired bootstrap interval over the same prompts holds the ratio
        paired = intervals.paired_ratio_interval(
            ce_run['per_row'], di_run['per_row'], 'block_efficiency'
        )
        assert paired['value'] == pytest.approx(di / ce)
        assert _cell(text, row, 8) == fmt_interval(paired['value'], paired['interval'])
        # per-position acceptance is printed with the counts it was computed from
        top = quickstart_report.run_at(
            d['spec_distilled'], label, max(r['k'] for r in d['spec_distilled']['runs'] if r['k'])
        )
        acc = np.sum(top['per_row']['accepted_per_position'], axis=0)
        exa = np.sum(top['per_row']['examined_per_position'], axis=0)
        cell = _cell(
            text,
            f'| distilled draft | {human_label(label)} | {top["k"]} |',
            3,
            '### Acceptance per position',
        )
        assert cell.endswith(f'({acc[0]}/{exa[0]})'), cell
    serve = json.load(open(os.path.join(workdir, 'serve', 'serve.json')))
    row = next(r for r in serve['rows'] if r['method'] == 'target' and r['batch_size'] == 1)
    assert _cell(text, '| target alone (autoregressive) | 1 |', 3) == fmt(1e3 * row['ttft_s'])
    assert _cell(text, '| target alone (autoregressive) | 1 |', 4) == fmt(1e3 * row['tpot_s'])
    distilled = json.load(open(os.path.join(workdir, 'draft_distilled', 'results.json')))
    replacement = '## Distillation as replacement'
    assert _cell(text, '| distilled draft | ', 1, replacement) == fmt(distilled['draft_val_loss'])
    assert _cell(text, '| distilled draft | ', 4, replacement) == fmt(1 - distilled['alpha_T1'])
    secs = json.load(open(os.path.join(workdir, 'quickstart.json')))['stage_seconds']
    cpu = json.load(open(os.path.join(workdir, 'quickstart.json')))['stage_cpu_seconds']
    assert (
        f'training {fmt(cpu["draft_distilled"])} CPU s ({fmt(secs["draft_distilled"])} s wall'
        in text
    )
    assert re.search(r'Break-even .* (tokens|never)', text)
    # Greedy speculative decoding reproduces the target's tokens.
    spec = next(r for r in serve['rows'] if r['method'] == 'spec_distilled')
    assert spec['same_tokens_as_target'] == 1.0


def test_report_opens_with_the_verdict_from_the_json(finished):
    config, workdir, _, _ = finished
    text = open(os.path.join(workdir, 'report.md')).read()
    d = quickstart_report.load(workdir)
    assert text.index('## Verdict') < text.index('## Target: distilled tau')
    for stage, option in (('spec_ce', 'speculate'), ('spec_distilled', 'both')):
        runs = [r for r in d[stage]['runs'] if r['method'] == 'speculative']
        best = max(
            (r for r in runs if r['sampling_label'] == 'T=0'), key=lambda r: r['measured_speedup']
        )
        lo, hi = best['speedup']['range']
        assert lo <= best['measured_speedup'] <= hi
        cell = _cell(text, f'| {option} ', 1, '## Verdict')
        assert f'best k = {best["k"]}' in cell and f'{fmt(lo)}-{fmt(hi)}' in cell
        assert best['intervals']['alpha'][0] <= best['alpha'] <= best['intervals']['alpha'][1]
        assert len(best['per_row']['accepted']) == d[stage]['prompts']['count']
        ks = tuple(config.report.accelerator_ks)
        lo, hi = quickstart_report.accelerator_model(d[stage], 'T=0', ks)['range']
        pays = _cell(text, f'| {option} ', 4, '## Verdict')
        assert f'accelerator model: {fmt(lo)}-{fmt(hi)}x' in pays, pays
    bigram, loss = d['target']['baselines']['bigram'], d['target']['eval']['loss']
    assert ('does not beat the count-bigram' in text) == (bigram - loss < 0.3)
    serve = d['serve']
    assert serve['prompts']['calls_per_pass']['1'] == serve['prompts']['count'] > 1
    assert quickstart_report.verdict_text(d).splitlines()[0].startswith('- speculate')


def test_report_renders_the_ngram_option(finished, tmp_path):
    """A results set with a spec_ngram stage (the SmolLM2 preset's training-free draft; faked
    here from spec_distilled's JSON with the n-gram draft's model record and c = 0): its verdict
    row, with nothing trained, and its serving row."""
    import shutil

    _, workdir, _, _ = finished
    root = str(tmp_path / 'w')
    shutil.copytree(workdir, root, ignore=shutil.ignore_patterns('checkpoints*'))
    spec = json.load(open(os.path.join(root, 'spec_distilled', 'spec_eval.json')))
    spec['models']['draft'] = dict(kind='ngram', max_n=3, min_n=1, proposals_by_n=[0, 2, 4],
                                   num_params=0)  # fmt: skip
    spec['calibration']['c'], spec['calibration']['draft_step_s'] = 0.0, 0.0
    os.makedirs(os.path.join(root, 'spec_ngram'))
    with open(os.path.join(root, 'spec_ngram', 'spec_eval.json'), 'w') as f:
        json.dump(spec, f)
    serve_path = os.path.join(root, 'serve', 'serve.json')
    serve = json.load(open(serve_path))
    pair = next(r for r in serve['rows'] if r['method'] == 'spec_distilled')
    serve['rows'].append(dict(pair, method='spec_ngram', k=8))
    json.dump(serve, open(serve_path, 'w'))
    quickstart_report.write(root)
    text = open(os.path.join(root, 'report.md')).read()
    option = 'no training (n-gram prompt lookup, proposing 0/2/4 tokens after a 1/2/3-token match)'
    assert 'best k = ' in _cell(text, f'| speculate with {option} ', 1, '## Verdict')
    assert _cell(text, f'| speculate with {option} ', 3, '## Verdict') == fmt(0.0)
    assert 'target + n-gram draft (training-free, speculative)' in text
    assert option in quickstart_report.verdict_text(quickstart_report.load(root))


def test_report_renders_the_route_row(finished, tmp_path):
    """A results set with a route stage (the SmolLM2 preset's router and cascade; faked here
    from a synthetic per-prompt table through route_curves): the verdict's fourth row, the
    routing section with the cascade marked lossy next to its figures, and the plot."""
    import shutil

    from test_routing import _table

    from specjax.evaluation import route_curves, routing

    _, workdir, _, _ = finished
    root = str(tmp_path / 'w')
    shutil.copytree(workdir, root, ignore=shutil.ignore_patterns('checkpoints*'))
    table = _table()
    route = route_curves.summarize(table, routing.SIGNALS, (0.3, 1.0), 0.1)
    route['cascade'].update(rule='cascade_token_v3', k=2, exact=False)
    route.update(
        student='draft_distilled', tier={'method': 'spec_distilled', 'k': 2}, first_m=8,
        sampling={'temperature': 0.0, 'top_k': 0, 'top_p': 1.0}, max_new_tokens=32,
        quality_floor_nats=0.1, prompts={'count': 12, 'validation': 6, 'held_out': 6},
    )  # fmt: skip
    os.makedirs(os.path.join(root, 'route'))
    with open(os.path.join(root, 'route', 'route.json'), 'w') as f:
        json.dump(route, f)
    quickstart_report.write(root)
    text = open(os.path.join(root, 'report.md')).read()
    option = 'route (the distilled student when confident, else spec_distilled (k = 2))'
    best = route['routers'][route['best_signal']]
    held = best['curve'][best['chosen']]['held_out']
    latency = _cell(text, f'| {option} ', 1, '## Verdict')
    assert latency.startswith(
        fmt_interval(held['relative_latency'], held['relative_latency_interval'])
    )
    quality = _cell(text, f'| {option} ', 2, '## Verdict')
    assert fmt_interval(held['kept_fraction'], held['kept_fraction_interval']) in quality
    assert 'not exact by design' in _cell(text, f'| {option} ', 4, '## Verdict')
    section = text[text.index('## Routing and speculative cascades') :]
    for c in route['cascade']['curve']:
        cost = fmt_interval(c['held_out']['quality_cost'], c['held_out']['quality_cost_interval'])
        assert f'{cost} (not exact by design)' in section
    assert os.path.exists(os.path.join(root, 'plots', 'route_quality_vs_latency.png'))
    assert option in quickstart_report.verdict_text(quickstart_report.load(root))


def test_rerun_reuses_every_stage_without_retraining(finished):
    config, workdir, _, first_s = finished
    before = {
        s: os.path.getmtime(os.path.join(workdir, s, 'results.json'))
        for s in ('target', 'draft_ce', 'draft_distilled', 'cotrain')
    }
    t0 = time.perf_counter()
    outcome = quickstart.run(config, workdir)
    rerun_s = time.perf_counter() - t0
    assert outcome == {n: ('ran' if n == 'report' else 'reused') for n in quickstart.STAGE_NAMES}
    for stage, mtime in before.items():
        assert os.path.getmtime(os.path.join(workdir, stage, 'results.json')) == mtime
        assert sorted(os.listdir(os.path.join(workdir, stage, 'checkpoints')))[-1] == str(
            config[stage].train.steps
        )
    assert rerun_s < 0.5 * first_s


def test_workdir_of_another_config_is_refused_untouched(finished):
    _, workdir, _, _ = finished
    mtime = os.path.getmtime(os.path.join(workdir, 'report.md'))
    with pytest.raises(
        quickstart.StageError,
        match=r"stage 'target' of a different config.*"
        r'train\.lr: 0\.003 in the workdir, 0\.001 now',
    ):
        quickstart.run(_config(target_lr=1e-3), workdir)
    assert os.path.getmtime(os.path.join(workdir, 'report.md')) == mtime


def test_stage_alone_without_prerequisite_fails_before_writing(tmp_path):
    config = _config()
    config.stages = 'spec_ce'
    with pytest.raises(quickstart.StageError, match=r"stage 'spec_ce' needs stage 'target'"):
        quickstart.run(config, str(tmp_path / 'w'))
    assert not os.path.exists(tmp_path / 'w')
    config.stages = 'target,nonsense'
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['nonsense'\]"):
        quickstart.run(config, str(tmp_path / 'w'))


def test_missing_matplotlib_fails_before_training(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, 'find_spec', lambda name, *a: None if name == 'matplotlib' else real(name)
    )
    with pytest.raises(ImportError, match='pip install matplotlib'):
        quickstart.run(_config(), str(tmp_path / 'w'))
    assert not os.path.exists(tmp_path / 'w')


def test_plots_select_no_backend_and_say_when_matplotlib_is_missing(tmp_path, monkeypatch):
    """A notebook's inline backend survives specjax's PNGs: pyplot is never imported."""
    code = (
        'import sys\n'
        'from specjax.quickstart import plots as quickstart_plots\n'
        'from specjax.sweeps import plots\n'
        'fig = plots.new_figure(figsize=(2, 2))\n'
        'fig.subplots().plot([0, 1])\n'
        'quickstart_plots._save(fig, sys.argv[1], "x.png")\n'
        'assert "matplotlib.pyplot" not in sys.modules, "pyplot imported"\n'
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, '-c', code, str(tmp_path)], check=True, env=env)
    assert os.path.getsize(tmp_path / 'x.png') > 0
    from specjax.sweeps import plots

    monkeypatch.setitem(sys.modules, 'matplotlib.figure', None)  # import fails as if absent
    with pytest.raises(ImportError, match='pip install matplotlib'):
        plots.new_figure()


def test_break_even_counts_tokens_or_never():
    assert quickstart_report.break_even(10.0, 0.002) == f'{fmt(5000.0)} tokens'
    assert quickstart_report.break_even(10.0, -0.001).startswith('never')


def test_preempted_stage_stops_the_run_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    stopped = dataclasses.replace(quickstart.STAGES[0], run=lambda cfg, wd, root: None)
    monkeypatch.setattr(quickstart, 'STAGES', (stopped,) + quickstart.STAGES[1:])
    config = _config()
    config.stages = 'target,draft_ce'
    assert quickstart.run(config, str(tmp_path / 'w')) == {'target': 'preempted'}
    assert 'rerun the same command to resume' in capsys.readouterr().out
    with open(tmp_path / 'w' / 'quickstart.json') as f:
        assert list(json.load(f)['stage_seconds']) == ['target']  # the attempt's time counts
