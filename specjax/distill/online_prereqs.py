"""The online mode's three models, each a workdir given in the config or trained here first:

  target     config.target_workdir, else config.target trained in <workdir>/target (pretrain)
             on rows of both of the stream's domains, balanced row by row (the embedded
             corpus is 95 % code by tokens: trained on it as it is, a small target barely
             learns prose and has no domain of its own to shift to)
  draft      config.draft_workdir, else config.draft distilled from the target in
             <workdir>/draft on the stream's first domain (the draft the stream starts with;
             served unchanged it is the frozen arm)
  retrained  config.retrained_workdir, else config.retrained distilled in <workdir>/retrained
             on the second domain: a draft retrained offline for the new traffic, the upper bound

A stage whose results.json exists is skipped after checking it was made with the same
result-changing settings (refused naming the fields otherwise); one with checkpoints and no
results resumes (its own mode resumes it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

from specjax import workdir as workdir_lib
from specjax.checkpoint import Checkpoints
from specjax.distill.online_config import imported_target
from specjax.distill.online_stream import domain_run_data
from specjax.workdir import ConfigMismatch


@dataclasses.dataclass(frozen=True)
class Prerequisites:
    target: str  # workdirs
    draft: str
    retrained: str
    trained: tuple[str, ...]  # the stages this call ran (not skipped, not given)
    preempted: bool = False


def target_vocab(config) -> int:
    """The target's vocabulary: config.target_workdir's checkpoint metadata, else its config
    (an imported target's declared config.target.vocab_size)."""
    if not config.target_workdir:
        if imported_target(config):
            return int(config.target.vocab_size)
        return int(config.target.model.vocab_size)
    workdir = workdir_lib.resolve(config.target_workdir)
    if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
        raise ValueError(
            f'config.target_workdir={config.target_workdir!r} has no checkpoints/ folder'
        )
    with Checkpoints(workdir, read_only=True) as ckpts:
        return int(ckpts.metadata()['model_config']['vocab_size'])


def check_target_given(config) -> None:
    """ValueError when config.target is a model to import and no workdir holds it yet: this
    mode trains targets; importing is its entry point's (specjax.quickstart.online.run, what
    specjax.main calls), which then sets config.target_workdir."""
    if imported_target(config) and not config.target_workdir:
        raise ValueError(
            f'config.target.source={config.target.source!r} is a model to import: run the mode '
            'through specjax.main (specjax.quickstart.online.run imports it into '
            '<workdir>/target) or give its imported workdir as config.target_workdir'
        )


def _finished(stage: str, cfg, workdir: str) -> bool:
    """Whether <workdir>/results.json exists; ConfigMismatch naming the fields when it was
    written with other result-changing settings than `cfg`."""
    file = os.path.join(workdir, workdir_lib.RESULTS_FILE)
    if not os.path.exists(file):
        return False
    with open(file) as f:
        saved = json.load(f).get('config', {})
    changes = workdir_lib.config_changes(saved, cfg)
    if changes:
        text = ', '.join(f'{k}: {old!r} -> {new!r}' for k, old, new in changes)
        raise ConfigMismatch(
            f'{workdir} holds the {stage} stage trained with other settings ({text}); use a '
            'new --workdir or the original settings'
        )
    return True


def _stage_config(config, stage: str, target: str):
    cfg = copy.deepcopy(config[stage])
    cfg.seed = int(config.seed)
    if stage != 'target':
        cfg.distill.teacher_workdir = target
    return cfg


def prepare(config, workdir: str, tok) -> Prerequisites:
    """Trains what config does not give (in this process, one stage after another)."""
    from specjax.distill.distill_mode import run_distill
    from specjax.train.pretrain import pretrain

    paths, trained = {}, []
    for stage in ('target', 'draft', 'retrained'):
        given = config[f'{stage}_workdir']
        if given:
            paths[stage] = workdir_lib.resolve(given)
            continue
        paths[stage] = os.path.join(workdir, stage)
        cfg = _stage_config(config, stage, paths['target'])
        if _finished(stage, cfg, paths[stage]):
            continue
        which = {'target': (0, 1), 'draft': (0,), 'retrained': (1,)}[stage]
        domains = [config.stream.domains[i] for i in which]
        data = domain_run_data(cfg, tok, domains, [f'config.stream.domains[{i}]' for i in which])
        if stage == 'target':
            result = pretrain(cfg, paths[stage], data=data)
        else:
            result = run_distill(cfg, paths[stage], data=data)
        trained.append(stage)
        if workdir_lib.was_preempted(result):
            paths = {s: paths.get(s, '') for s in ('target', 'draft', 'retrained')}
            return Prerequisites(**paths, trained=tuple(trained), preempted=True)
    return Prerequisites(**paths, trained=tuple(trained))
