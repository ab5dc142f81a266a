"""Draft distillation (DistillSpec / GKD) and target-draft co-training.

from specjax.distill import run_distill, run_cotrain   # modes 'distill' and 'cotrain'
from specjax.distill import divergences                # FKL, RKL, JSD(β), TVD, −log α, ...
"""

from __future__ import annotations

import importlib

# name -> module: the modes pull in training, checkpoints and sampling, so import them lazily.
_LAZY = {
    'run_distill': 'specjax.distill.distill_mode',
    'DistillData': 'specjax.distill.sources',
    'load_data': 'specjax.distill.sources',
    'run_cotrain': 'specjax.distill.cotrain',
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = sorted(_LAZY)
