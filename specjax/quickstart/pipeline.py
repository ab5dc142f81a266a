"""The quickstart mode: every stage of "speculate, distill, or both?" in one workdir, then a report.

Each stage runs an existing mode function (pretrain, distill, cotrain, spec_eval) or the serving
measurement in <workdir>/<stage>/ with its own config section of the quickstart config
(configs/quickstart.py). A stage is finished when its results file exists; a stage with a
checkpoint but no results resumes (the modes resume from their checkpoints). Each stage's config
is recorded in <workdir>/<stage>/quickstart_stage.json before it starts: a rerun with another
config for a started stage is refused before anything runs, so nothing is overwritten; the
refusal names every field the user changed, as the quickstart config spells it
(specjax.quickstart.drift). <workdir>/quickstart.json records the seconds each stage took (the
report's run times). SIGTERM stops the run (specjax.main exits 42): a training stage commits its
checkpoint, a stage running here outside a training loop unwinds (specjax.errors.StopRequested),
and the message says what the stopped stage saved (a committed checkpoint step, or nothing).

Entry point: `run(config, workdir)` (mode 'quickstart').
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os

import ml_collections

from specjax import errors, jsonio
from specjax.quickstart import drift, stage_runner
from specjax.quickstart.stages import STAGE_NAMES, STAGES, Stage  # noqa: F401 (STAGE_NAMES re-exported)

STAGE_FILE = 'quickstart_stage.json'
RUN_FILE = stage_runner.RUN_FILE


class StageOutcomes(dict):
    """{stage: 'ran' | 'reused' | 'preempted'}, the quickstart mode's result; `.preempted` is
    what specjax.main reads (specjax.workdir.was_preempted)."""

    @property
    def preempted(self) -> bool:
        return 'preempted' in self.values()


def stages_of(config) -> tuple[Stage, ...]:
    """The preset's stages: STAGES, or SmolLM2's (config.preset='smollm2')."""
    if config.get('preset', 'embedded') == 'smollm2':
        from specjax.quickstart import smollm2 as quickstart_smollm2

        return quickstart_smollm2.stages(config)
    return STAGES


class StageError(errors.SpecjaxError, ValueError):
    """A stage cannot run: prerequisite missing or the workdir holds another config's results."""


def stage_config(config, stage: Stage):
    """The config a stage's mode function receives: its section, with the shared data fields."""
    if stage.name in drift.EVAL_SHARING_STAGES:  # serve, route: spec_eval's prompts and mesh
        cfg = ml_collections.ConfigDict(config[stage.name].to_dict())
        cfg.data = copy.deepcopy(config.spec_eval.data)
        cfg.eval = copy.deepcopy(config.spec_eval.eval)
        cfg.mesh = copy.deepcopy(config.spec_eval.mesh)
        cfg.seed = config.spec_eval.seed
    elif not stage.section:
        return copy.deepcopy(config.report)
    else:
        cfg = copy.deepcopy(config[stage.section])
    for key, value in config.data.items():
        if key != 'seq_len':
            cfg.data[key] = value
    return cfg


def _identity(cfg) -> dict:
    return json.loads(json.dumps(jsonio.jsonable(cfg.to_dict()), sort_keys=True))


def selected(config) -> list[Stage]:
    """The stages config.stages asks for, in pipeline order; ValueError on unknown names."""
    all_stages = stages_of(config)
    stage_names = tuple(s.name for s in all_stages)
    names = stage_names if config.stages == 'all' else [s.strip() for s in config.stages.split(',')]
    unknown = [n for n in names if n not in stage_names]
    if unknown or not names:
        raise ValueError(
            f'config.stages={config.stages!r}: unknown stage(s) {unknown}; '
            f"use 'all' or a comma-separated subset of {list(stage_names)}"
        )
    return [s for s in all_stages if s.name in names]


def stage_dir(workdir: str, stage: Stage) -> str:
    """<workdir>/<stage>; the report is written into the workdir itself."""
    return workdir if stage.name == 'report' else os.path.join(workdir, stage.name)


def check_workdir(config, workdir: str, stages: list[Stage]) -> dict[str, bool]:
    """Raises StageError for a recorded stage whose config differs or a missing prerequisite.

    Returns stage name -> finished. Runs before any stage, so a refused run writes nothing.
    """
    done, recorded = {}, []
    for stage in stages_of(config):
        wd = stage_dir(workdir, stage)
        done[stage.name] = os.path.exists(os.path.join(wd, stage.results))
        record = os.path.join(wd, STAGE_FILE)
        if stage.name == 'report' or not os.path.exists(record):
            continue
        with open(record) as f:
            saved = json.load(f)['config']
        recorded.append((stage, saved, _identity(stage_config(config, stage))))
    refused = drift.refusal(config, workdir, recorded)  # every changed field, as the user set it
    if refused:
        raise StageError(refused)
    chosen = {s.name for s in stages}
    for stage in stages:
        for pre in stage.prereqs:
            if pre not in chosen and not done[pre]:
                raise StageError(
                    f'stage {stage.name!r} needs stage {pre!r}, which has not finished '
                    f'({os.path.join(workdir, pre)} has no results): run it first, e.g. '
                    f'--config.stages={pre},{stage.name}'
                )
    return done


def check_plotting() -> None:
    """ImportError before any training when matplotlib (the report's plots) is missing."""
    if importlib.util.find_spec('matplotlib') is None:
        raise ImportError(
            'the quickstart report needs matplotlib for its plots, and it is not installed: '
            "pip install matplotlib (or pip install -e '.' to get specjax's dependencies)"
        )


def run(config, workdir: str) -> dict:
    """The quickstart mode; returns {stage: 'ran' | 'reused' | 'preempted'} (stops after a
    preempted stage: SIGTERM saves a checkpoint, and a rerun resumes from it)."""
    stages = selected(config)
    check_plotting()
    if config.get('preset', 'embedded') == 'smollm2':
        from specjax.quickstart import smollm2 as quickstart_smollm2

        quickstart_smollm2.check_available(config.target.source)
        quickstart_smollm2.check_config(config)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    done = check_workdir(config, workdir, stages)
    stage_runner.enable_cache(config.compilation_cache)
    todo = [s for s in stages if not (done[s.name] and s.name != 'report')]
    outcome = StageOutcomes({s.name: 'reused' for s in stages if s not in todo})
    for name in outcome:
        print(f'[quickstart] {name}: finished earlier, reused', flush=True)
    n_workers = stage_runner.workers(config)
    if n_workers == 1:
        todo = [dataclasses.replace(s, concurrent=False) for s in todo]
    progress = stage_runner.Progress(todo, config.estimates, n_workers)
    before = stage_runner.read_run(workdir).get('total_seconds', 0.0)  # earlier invocations

    started = []  # stages in the order they started (the last unfinished one runs here)

    def prepare(stage):
        started.append(stage)
        cfg, wd = stage_config(config, stage), stage_dir(workdir, stage)
        os.makedirs(wd, exist_ok=True)
        if stage.name == 'report':  # the report states the time from start to report
            stage_runner.record_run(workdir, '', 0, 0, total=before + progress.elapsed())
        else:
            jsonio.write_json(
                os.path.join(wd, STAGE_FILE), {'stage': stage.name, 'config': _identity(cfg)}
            )
        return cfg, wd

    def finished(stage, times, beside, log) -> bool:
        wd = stage_dir(workdir, stage)
        if stage.name != 'report':
            stage_runner.record_run(
                workdir, stage.name, *times, beside, total=before + progress.elapsed()
            )
        if not os.path.exists(os.path.join(wd, stage.results)):
            print(
                f'[quickstart] stage {stage.name} stopped before finishing: '
                f'{stage_runner.saved_text(wd)}',
                flush=True,
            )
            outcome[stage.name] = 'preempted'
            return False
        progress.end(stage.name, times[0], log)
        outcome[stage.name] = 'ran'
        return True

    try:
        stage_runner.run_pool(workdir, todo, prepare, finished, progress, n_workers)
    except errors.StopRequested:  # SIGTERM to a stage running here outside a training loop
        stage = next((s for s in reversed(started) if s.name not in outcome), None)
        name, saved = 'start-up', 'nothing of the next stage was saved'
        if stage is not None:
            name, saved = stage.name, stage_runner.saved_text(stage_dir(workdir, stage))
        print(f'[quickstart] stopped by SIGTERM during {name}: {saved}', flush=True)
        outcome[name] = 'preempted'
    if 'preempted' not in outcome.values():
        print(f'[quickstart] report: {os.path.join(workdir, "report.md")}', flush=True)
    return outcome
