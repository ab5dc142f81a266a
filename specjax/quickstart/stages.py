"""The quickstart's stages: what a stage is, and the embedded-corpus preset's stages.

A `Stage` names its config section, the results file whose presence means finished, its
prerequisites and the function that runs it, `run(stage_config, stage_workdir, workdir)`. Every
`run` is a module-level function or a functools.partial of one, so a stage pickles into the
child process that runs it (specjax.quickstart.stage_runner). The SmolLM2 preset's stages are in
specjax.quickstart.smollm2.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    section: str  # config section holding the stage's config ('' = none)
    results: str  # file in the stage workdir whose presence means finished
    prereqs: tuple[str, ...]
    run: Callable  # (stage_config, stage_workdir, workdir) -> None
    concurrent: bool = False  # training: may run beside other concurrent stages (stage_runner)
    after: tuple[str, ...] = ()  # run after these when selected (e.g. to reuse their compiles)


def _pretrain(cfg, wd, root):
    from specjax.train.pretrain import pretrain

    pretrain(cfg, wd)


def _distill(cfg, wd, root):
    from specjax.distill.distill_mode import run_distill

    cfg.distill.teacher_workdir = os.path.join(root, 'target')
    run_distill(cfg, wd)


def _cotrain(cfg, wd, root):
    from specjax.distill.cotrain import run_cotrain

    if cfg.init.target_step > 0:
        cfg.init.target_workdir = os.path.join(root, 'target')
    run_cotrain(cfg, wd)


def _spec_eval(target: str, draft: str, cotrained: bool):
    """The spec_eval stage of (target, draft): a picklable partial of _run_spec_eval."""
    return functools.partial(_run_spec_eval, target, draft, cotrained)


def _run_spec_eval(target, draft, cotrained, cfg, wd, root):
    from specjax.evaluation import spec_eval

    cfg.target_workdir = os.path.join(root, target)
    cfg.draft_workdir = os.path.join(root, draft)
    if cotrained:
        cfg.draft_params_key, cfg.draft_config_key = 'draft_params', 'draft_config'
    spec_eval.run(cfg, wd)


def _serve(cfg, wd, root):
    from specjax.evaluation import serving

    serving.run(cfg, wd, root)


def run_report(cfg, wd, root):
    from specjax.quickstart import report as quickstart_report

    d = quickstart_report.load(root)
    quickstart_report.write(root, accelerator_ks=tuple(cfg.accelerator_ks), d=d)
    print('[quickstart] verdict (greedy; report.md has intervals and flags):', flush=True)
    print(quickstart_report.verdict_text(d), flush=True)


STAGES = (
    Stage('target', 'target', 'results.json', (), _pretrain),
    Stage('draft_ce', 'draft_ce', 'results.json', ('target',), _distill, concurrent=True),
    Stage(
        'draft_distilled', 'draft_distilled', 'results.json', ('target',), _distill, concurrent=True
    ),
    Stage('cotrain', 'cotrain', 'results.json', ('target',), _cotrain, concurrent=True),
    Stage(
        'spec_ce',
        'spec_eval',
        'spec_eval.json',
        ('target', 'draft_ce'),
        _spec_eval('target', 'draft_ce', False),
    ),
    Stage(
        'spec_distilled',
        'spec_eval',
        'spec_eval.json',
        ('target', 'draft_distilled'),
        _spec_eval('target', 'draft_distilled', False),
        after=('spec_ce',),  # reuses spec_ce's sampler compiles (same shapes)
    ),
    Stage(
        'spec_cotrain',
        'spec_eval',
        'spec_eval.json',
        ('cotrain',),
        _spec_eval('cotrain', 'cotrain', True),
        after=('spec_ce',),
    ),
    Stage(
        'serve',
        'serve',
        'serve.json',
        ('target', 'draft_ce', 'draft_distilled', 'spec_distilled'),
        _serve,
    ),
    Stage(
        'report',
        '',
        'report.md',
        (
            'target',
            'draft_ce',
            'draft_distilled',
            'cotrain',
            'spec_ce',
            'spec_distilled',
            'spec_cotrain',
            'serve',
        ),
        run_report,
    ),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
