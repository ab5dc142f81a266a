r"""k x temperature ablation: one fixed target-draft pair decoded speculatively at every draft
length k and sampling temperature, against the target decoding alone.

The pair is trained once (prerequisites): a target (configs/pretrain.py) and a draft distilled
from it with the DistillSpec ablation's best setting (FKL on target-generated continuations,
configs/ablations/distillspec.py). Every point is mode spec_eval (configs/spec_eval.py) with one
k and one temperature (top_k 0, top_p 1): it times c and v(k) on this machine, decodes the
same prompts autoregressively and speculatively, and writes the flat `point` block of its
results.json. Seeds pick the prompts and the sampling keys.

Columns (all from results.json `point`, mean over seeds with a 95% bootstrap interval):
acceptance_rate (accepted / examined draft tokens), alpha (per-token 1 - TV on the target's own
samples), block_efficiency (tau: tokens per target call), expected_block_efficiency (E[tau] from
alpha), measured_speedup (autoregressive / speculative time per token), predicted_speedup
(tau / (k c + v(k))), speedup_ratio (measured / predicted), c (draft / target time per call) and
v_k (verification call / one-token call). Pivot tables: temperature down, k across; plots: one
line per temperature against k (<workdir>/plots/).

Run (tiny: a 0.39M target, 300 steps; a 0.14M draft, 100 steps; 4 k x 3 T x 2 seeds = 24
spec_eval points):

  python -m specjax.main --config=configs/ablations/k_temperature.py:size=tiny \
      --workdir=/tmp/specjax/k_temperature_tiny

Measured and expected durations: docs/findings.md. Rerunning resumes (finished points are
skipped). Outputs: <workdir>/summary.{md,csv,json}, <workdir>/plots/*.png, and per point
<workdir>/points/<name>/{results.json,spec_eval.json,sweep.log,sweep_status.json}.

Presets (`:size=...`):
  smoke  seconds-long models (the draft on dataset batches) and 1 k x 2 T x 1 seed (the test
         suite sweeps it end to end).
  tiny   as above (minutes on a 2-core CPU).
  small  target configs/pretrain.py:size=small (1000 steps), draft distill.py:size=tiny (300
         steps), 64 generated tokens, 3 seeds: about an hour of training plus ~1 min per point.
"""

import os

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.sweeps.runner import default_sweep_config

_CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METRICS = (
    'point.acceptance_rate',
    'point.alpha',
    'point.block_efficiency',
    'point.expected_block_efficiency',
    'point.measured_speedup',
    'point.predicted_speedup',
    'point.speedup_ratio',
    'c',
    'point.v_k',
)

# size: target preset, target steps, draft preset, draft steps, ks, temperatures, seeds,
# new tokens, prompts per domain, timing repeats
_PRESETS = {
    'smoke': dict(
        target='tiny',
        target_steps=8,
        draft='test',
        draft_steps=4,
        ks=(2,),
        temps=(0.0, 1.0),
        seeds=1,
        new_tokens=4,
        prompts=1,
        repeats=1,
    ),
    'tiny': dict(
        target='tiny',
        target_steps=300,
        draft='test',
        draft_steps=100,
        ks=(1, 2, 4, 8),
        temps=(0.0, 0.7, 1.0),
        seeds=2,
        new_tokens=32,
        prompts=4,
        repeats=3,
    ),
    'small': dict(
        target='small',
        target_steps=1000,
        draft='tiny',
        draft_steps=300,
        ks=(1, 2, 4, 8),
        temps=(0.0, 0.7, 1.0),
        seeds=3,
        new_tokens=64,
        prompts=8,
        repeats=3,
    ),
}


def _size(arg) -> str:
    return parse_arg(arg, size=one_of('tiny', _PRESETS)).size  # 'size=tiny' or 'tiny'


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = _size(arg)
    p = _PRESETS[size]
    data = {'data.vocab_size': 1024} if size == 'smoke' else {}  # smoke: the tests' tokenizer
    c = ml_collections.ConfigDict()
    c.mode = 'sweep'  # specjax.main dispatches on this
    c.sweep = default_sweep_config()  # runner fields: see specjax/sweeps/runner.py
    c.sweep.base = os.path.join(_CONFIGS, 'spec_eval.py:checkpoints')  # every point
    c.sweep.prereqs = (
        {
            'name': 'target',
            'config': os.path.join(_CONFIGS, f'pretrain.py:size={p["target"]}'),
            'overrides': dict(data, **{'train.steps': p['target_steps']}),
        },
        {
            'name': 'draft',
            'config': os.path.join(_CONFIGS, f'distill.py:size={p["draft"]}'),
            'overrides': dict(
                data,
                **{
                    'distill.teacher_workdir': '${prereq.target}',
                    'distill.divergence': 'fkl',  # the DistillSpec ablation's best mean alpha_T1
                    'distill.source': 'teacher' if size != 'smoke' else 'dataset',
                    'distill.max_new_tokens': 32,
                    'distill.final_spec_k': 0,  # the points measure speculative decoding
                    'distill.calibrate': False,
                    'train.steps': p['draft_steps'],
                    'train.warmup_steps': max(p['draft_steps'] // 10, 1),
                    'train.eval_every': 0,
                    'train.checkpoint_every': p['draft_steps'],
                },
            ),
        },
    )
    c.sweep.overrides = tuple(data.items()) + (
        ('target_workdir', '${prereq.target}'),
        ('draft_workdir', '${prereq.draft}'),
        ('eval.prompts_per_domain', p['prompts']),
        ('eval.max_new_tokens', p['new_tokens']),
        ('eval.gen_len_edges', (p['new_tokens'] // 2, p['new_tokens'])),
        ('eval.timing_repeats', p['repeats']),
        ('eval.calibration_repeats', p['repeats']),
        ('eval.calibration_iters', 16 if size != 'smoke' else 2),
    )
    c.sweep.grid = (  # named axes: each value sets spec_eval's tuple field to one entry
        ('temperature', tuple((t, {'eval.samplings': ((t, 0, 1.0),)}) for t in p['temps'])),
        ('k', tuple((k, {'eval.ks': (k,)}) for k in p['ks'])),
    )
    c.sweep.seeds = p['seeds']
    c.sweep.metrics = METRICS
    c.sweep.minimize = ('c', 'point.v_k')  # costs: lower is better
    return c
