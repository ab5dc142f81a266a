r"""DistillSpec ablation: divergence x data source for a draft distilled from one frozen target.

Grid (Zhou et al., ICLR 2024, Table/Fig. on divergences and data): {FKL, RKL, JSD(0.5), TVD,
-log alpha} x {dataset, target-generated, on-policy, mixture lambda = 0.5 (on-policy vs dataset)},
plus `ce_baseline`: a draft of the same size trained with next-token cross-entropy on the dataset
for the same steps (distill.kd_weight = 0, ce_weight = 1). 21 configurations x `seeds` seeds. The
target is pretrained once (prerequisite `target`) and every point distills from it.

Columns: alpha_T0, alpha_T1 (held-out per-token acceptance 1 - TV), acceptance_k4_T0/T1 and
tau_k4_T0/T1 (measured speculative run, k = 4), predicted_speedup_k4_T1 (tau / (k c + v(k)) with
c, v(k) timed inside each point), draft_val_loss. Cells: mean over seeds with a 95% percentile
bootstrap interval; "no clear winner" where the best mean's interval overlaps another point's.

Run (tiny: a ~0.4M-param target, ~0.14M-param drafts, 3 seeds; 21 x 3 = 63 distill runs):

  python -m specjax.main --config=configs/ablations/distillspec.py:size=tiny \
      --workdir=/tmp/specjax/distillspec_tiny

Measured (2026-11-30, 2-core CPU shared with one other training job): the whole tiny sweep,
63/63 points, took 1573 s (26 min); a point takes a median 22 s with the sweep's shared JAX
compilation cache warm. At this scale the drafts stay near-unigram after 100 steps, so the T = 0
columns (argmax agreement) are degenerate; the T = 1 columns separate (docs/findings.md).
Fewer seeds for a smoke run: --config.sweep.seeds=1. Rerunning the same command resumes: finished
points are skipped. Outputs: <workdir>/summary.{md,csv,json}, <workdir>/plots/*.png, and per
point <workdir>/points/<name>/{results.json,sweep.log,sweep_status.json}.

Presets (`:size=...`):
  tiny   target configs/pretrain.py:size=tiny (300 steps), draft configs/distill.py:size=test
         (d_model 32 x 1 layer) for 100 steps, 32 generated tokens per prompt.
  small  target configs/pretrain.py:size=small (1000 steps), draft configs/distill.py:size=tiny
         (d_model 64 x 2 layers) for 300 steps, 64 generated tokens: hours on a 2-core CPU,
         minutes per point on an accelerator.
"""

import os

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.distill.results import HEADLINE_METRICS
from specjax.sweeps.runner import default_sweep_config

_CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DIVERGENCES = ('fkl', 'rkl', 'jsd', 'tvd', 'neg_log_alpha')
SOURCES = ('dataset', 'teacher', 'on_policy', 'mixture')
METRICS = HEADLINE_METRICS

# size: (target preset, target steps, draft preset, draft steps, warmup, new tokens per prompt)
_PRESETS = {
    'tiny': ('tiny', 300, 'test', 100, 10, 32),
    'small': ('small', 1000, 'tiny', 300, 30, 64),
}


def _size(arg) -> str:
    return parse_arg(arg, size=one_of('tiny', _PRESETS)).size  # 'size=tiny' or 'tiny'


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = _size(arg)
    target, target_steps, draft, steps, warmup, new_tokens = _PRESETS[size]
    c = ml_collections.ConfigDict()
    c.mode = 'sweep'  # specjax.main dispatches on this
    c.sweep = default_sweep_config()  # runner fields: see specjax/sweeps/runner.py
    c.sweep.base = os.path.join(_CONFIGS, f'distill.py:size={draft}')  # every point
    c.sweep.prereqs = (
        {
            'name': 'target',
            'config': os.path.join(_CONFIGS, f'pretrain.py:size={target}'),
            'overrides': {'train.steps': target_steps},
        },
    )
    c.sweep.overrides = (
        ('distill.teacher_workdir', '${prereq.target}'),
        ('distill.beta', 0.5),  # JSD(0.5)
        ('distill.mixture_lambda', 0.5),  # mixture: on-policy with probability 0.5 ...
        ('distill.mixture_base', 'dataset'),  # ... else a dataset batch
        ('distill.max_new_tokens', new_tokens),
        ('distill.final_spec_k', 4),
        ('distill.eval_temperatures', (0.0, 1.0)),
        ('train.steps', steps),
        ('train.warmup_steps', warmup),
        ('train.eval_every', 0),  # evaluate once, at the end
        ('train.checkpoint_every', steps),
    )
    c.sweep.grid = (
        ('distill.divergence', DIVERGENCES),
        ('distill.source', SOURCES),
    )
    c.sweep.variants = (
        (
            'ce_baseline',
            {
                'distill.divergence': 'fkl',  # unused: kd_weight = 0
                'distill.source': 'dataset',
                'distill.kd_weight': 0.0,
                'distill.ce_weight': 1.0,
            },
        ),
    )
    c.sweep.seeds = 3
    c.sweep.metrics = METRICS
    c.sweep.minimize = ('draft_val_loss',)
    return c
