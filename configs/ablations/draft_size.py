r"""Draft size ablation: drafts of every size in specjax.models.presets.DRAFTS distilled from one
frozen target for the same steps, to show the seed's warning (../shared/seed-*.txt, section 9:
"avoid a draft made stronger but too heavy"): a larger draft raises alpha and tau, but each
draft token costs c (draft / target time per call), so the speedup tau / (k c + v(k)) can fall.

Every point distills with the DistillSpec ablation's best setting (FKL on target-generated
continuations) for the same train.steps and batch (the same training tokens; the train_flops
column shows how much more compute a larger draft spends on them), then times c and v(4) on this
machine and runs speculative decoding at k = 4 (specjax.distill.evaluation).

Columns: num_params_draft, cost_ratio_c (c, timed), verify_cost_v4 (v(4)), alpha_T0 / alpha_T1
(held-out 1 - TV), tau_k4_T0 / tau_k4_T1 (measured tokens per target call),
predicted_speedup_k4_T0 / _T1 (tau / (4 c + v(4))), draft_val_loss, train_flops. One row per
draft preset; plots per metric in <workdir>/plots/.

Run (tiny: the 0.39M tiny target, 300 steps; drafts test, tiny and small, 100 steps, 2 seeds):

  python -m specjax.main --config=configs/ablations/draft_size.py:size=tiny \
      --workdir=/tmp/specjax/draft_size_tiny

At tiny the tiny and small drafts are as large as the target or larger (c >= 1), so the speedup
must fall; `small` uses the 3.4M small target, where the trade-off is a real one. Expected
durations: docs/findings.md. Rerunning resumes.

Presets (`:size=...`):
  smoke  seconds-long runs of drafts test and tiny on dataset batches, 1 seed (the test suite
         sweeps it end to end).
  tiny   as above.
  small  target configs/pretrain.py:size=small (1000 steps); drafts test, tiny, small and medium
         for 300 steps, 3 seeds: hours on a 2-core CPU, minutes per point on an accelerator.
"""

import os

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.models import presets
from specjax.sweeps.runner import default_sweep_config

_CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METRICS = (
    'num_params_draft',
    'cost_ratio_c',
    'verify_cost_v4',
    'alpha_T0',
    'alpha_T1',
    'tau_k4_T0',
    'tau_k4_T1',
    'predicted_speedup_k4_T0',
    'predicted_speedup_k4_T1',
    'draft_val_loss',
    'train_flops',
)

# size: target preset, target steps, draft presets, draft steps, seeds, new tokens
_PRESETS = {
    'smoke': ('tiny', 8, ('test', 'tiny'), 4, 1, 8),
    'tiny': ('tiny', 300, ('test', 'tiny', 'small'), 100, 2, 32),
    'small': ('small', 1000, ('test', 'tiny', 'small', 'medium'), 300, 3, 64),
}


def _size(arg) -> str:
    return parse_arg(arg, size=one_of('tiny', _PRESETS)).size  # 'size=tiny' or 'tiny'


def draft_axis(names) -> tuple:
    """The named grid axis 'draft': each preset name sets config.draft's shape fields."""
    return tuple(
        (name, {f'draft.{k}': v for k, v in presets.shape('draft', name).items()}) for name in names
    )


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = _size(arg)
    target, target_steps, drafts, steps, seeds, new_tokens = _PRESETS[size]
    data = (('data.vocab_size', 1024),) if size == 'smoke' else ()  # smoke: the tests' tokenizer
    c = ml_collections.ConfigDict()
    c.mode = 'sweep'  # specjax.main dispatches on this
    c.sweep = default_sweep_config()  # runner fields: see specjax/sweeps/runner.py
    c.sweep.base = os.path.join(_CONFIGS, 'distill.py:size=test')  # shapes: the 'draft' axis
    c.sweep.prereqs = (
        {
            'name': 'target',
            'config': os.path.join(_CONFIGS, f'pretrain.py:size={target}'),
            'overrides': dict(data, **{'train.steps': target_steps}),
        },
    )
    c.sweep.overrides = data + (
        ('distill.teacher_workdir', '${prereq.target}'),
        ('distill.divergence', 'fkl'),  # the DistillSpec ablation's best mean alpha_T1 ...
        ('distill.source', 'teacher' if size != 'smoke' else 'dataset'),  # ... on target text
        ('distill.eval_generate_batches', 0),  # held-out alpha only (no generated-text alpha)
        ('distill.max_new_tokens', new_tokens),
        ('distill.final_spec_k', 4),
        ('distill.eval_temperatures', (0.0, 1.0)),
        ('train.steps', steps),
        ('train.warmup_steps', max(steps // 10, 1)),
        ('train.eval_every', 0),  # evaluate once, at the end
        ('train.checkpoint_every', steps),
    )
    c.sweep.grid = (('draft', draft_axis(drafts)),)
    c.sweep.seeds = seeds
    c.sweep.metrics = METRICS
    c.sweep.minimize = ('cost_ratio_c', 'verify_cost_v4', 'draft_val_loss', 'train_flops')
    c.sweep.plot_metrics = (
        'alpha_T1',
        'tau_k4_T1',
        'cost_ratio_c',
        'predicted_speedup_k4_T0',
        'predicted_speedup_k4_T1',
    )
    return c
