r"""Co-training against distillation after pretraining against cross-entropy, at matched compute.

Three ways to get a target-draft pair, all on the same data (the packed corpus batches, no
generated continuations, so every FLOP is counted) and the same draft size:

  distill  pretrain the target with cross-entropy for N steps (prerequisite `target`), then
           distill the draft from the frozen target for M steps (FKL on dataset batches);
  ce       the same target, the draft trained with next-token cross-entropy for M steps
           (kd_weight 0, ce_weight 1: the DistillSpec ablation's baseline);
  cotrain  target and draft trained together from scratch (mode cotrain, FKL from the target's
           logits of the same forward) for S steps.

Matched: training FLOPs (steps x FLOPs per step; specjax.train.runs.train_flops: 3 x forward for
each trained model, 1 x forward for a frozen teacher, per token). S is chosen here so that
S x 3 (F_target + F_draft) = N x 3 F_target + M x (F_target + 3 F_draft); distill and ce spend the
budget as N target steps + M draft steps. The summary reports both measures: train_flops per
point (the target's own in the Run time table's prerequisite row: add it to the distill and ce
rows) and the wall / CPU seconds of each point and of the prerequisite.

Columns: alpha_T0 / alpha_T1, tau_k4_T0 / tau_k4_T1, predicted_speedup_k4_T1, cost_ratio_c,
draft_val_loss, target_val_loss (the cotrained target against the pretrained one),
train_flops, step.

Run (tiny: the 0.39M tiny target and the 0.14M test draft; N = 300, M = 100, S from the FLOPs,
3 seeds of each arm; the distill and ce seeds share one target):

  python -m specjax.main --config=configs/ablations/cotrain_vs_distill.py:size=tiny \
      --workdir=/tmp/specjax/cotrain_vs_distill_tiny

Expected durations: docs/findings.md. Rerunning resumes.

Presets (`:size=...`):
  smoke  seconds-long runs, 1 seed (the test suite sweeps it end to end).
  tiny   as above.
  small  the 3.4M small target (N = 1000) and the tiny draft (M = 300), 3 seeds.
"""

import os

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.models import TransformerConfig, presets
from specjax.sweeps.runner import default_sweep_config

_CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METRICS = (
    'alpha_T0',
    'alpha_T1',
    'tau_k4_T0',
    'tau_k4_T1',
    'predicted_speedup_k4_T1',
    'cost_ratio_c',
    'draft_val_loss',
    'target_val_loss',
    'train_flops',
    'step',
)

# size: target preset, N, draft preset, M, seeds, vocabulary, seq_len (configs/pretrain.py's)
_PRESETS = {
    'smoke': ('tiny', 8, 'test', 4, 1, 1024, 128),
    'tiny': ('tiny', 300, 'test', 100, 3, 4096, 128),
    'small': ('small', 1000, 'tiny', 300, 3, 4096, 256),
}


def _size(arg) -> str:
    return parse_arg(arg, size=one_of('tiny', _PRESETS)).size  # 'size=tiny' or 'tiny'


def _model(kind: str, name: str, vocab: int, seq_len: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab, max_len=seq_len, **presets.shape(kind, name))


def matched_cotrain_steps(target, draft, target_steps: int, draft_steps: int, seq_len: int):
    """S with S x 3 (F_t + F_d) = N x 3 F_t + M x (F_t + 3 F_d) (per-token forward FLOPs F)."""
    f_t, f_d = (m.forward_flops_per_token(seq_len) for m in (target, draft))
    budget = target_steps * 3 * f_t + draft_steps * (f_t + 3 * f_d)
    return max(round(budget / (3 * (f_t + f_d))), 1)


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = _size(arg)
    target, n, draft, m, seeds, vocab, seq_len = _PRESETS[size]
    s = matched_cotrain_steps(
        _model('target', target, vocab, seq_len), _model('draft', draft, vocab, 128), n, m, seq_len
    )
    data = (('data.vocab_size', vocab),) if size == 'smoke' else ()  # smoke: the tests' tokenizer
    c = ml_collections.ConfigDict()
    c.mode = 'sweep'  # specjax.main dispatches on this
    c.sweep = default_sweep_config()  # runner fields: see specjax/sweeps/runner.py
    c.sweep.base = os.path.join(_CONFIGS, f'distill.py:size={draft}')  # distill and ce
    c.sweep.prereqs = (
        {
            'name': 'target',
            'config': os.path.join(_CONFIGS, f'pretrain.py:size={target}'),
            'overrides': dict(data, **{'train.steps': n}),
        },
    )
    c.sweep.overrides = data + (  # every arm: fields of both distill.py and cotrain.py
        ('data.seq_len', seq_len),
        ('distill.source', 'dataset'),
        ('distill.divergence', 'fkl'),
        ('distill.max_new_tokens', 32),
        ('distill.final_spec_k', 4),
        ('distill.eval_temperatures', (0.0, 1.0)),
        ('distill.eval_generate_batches', 0),  # held-out alpha only (no generated-text alpha)
        ('train.eval_every', 0),  # evaluate once, at the end
    )
    distill_arm = {
        'distill.teacher_workdir': '${prereq.target}',
        'draft.max_len': seq_len,
        'train.steps': m,
        'train.warmup_steps': max(m // 10, 1),
        'train.checkpoint_every': m,
    }
    c.sweep.variants = (
        ('distill', distill_arm),
        ('ce', dict(distill_arm, **{'distill.kd_weight': 0.0, 'distill.ce_weight': 1.0})),
        (
            'cotrain',
            {'train.steps': s, 'train.checkpoint_every': s},
            os.path.join(_CONFIGS, f'cotrain.py:size={target},draft={draft}'),
        ),
    )
    c.sweep.seeds = seeds
    c.sweep.metrics = METRICS
    c.sweep.minimize = ('cost_ratio_c', 'draft_val_loss', 'target_val_loss', 'train_flops')
    return c
