r"""Co-train a target and a draft: each step the target takes its cross-entropy step and the draft
distills from the target's logits of that same forward (before the update). The target starts
from scratch, or with --config.init.target_workdir=DIR --config.init.target_step=S from step S of
a pretrain run (params, optimizer state, data position: its schedule continues to train.steps).

Run (2-core CPU: the tiny preset takes about 3 minutes, measured 2.9 min on a shared machine;
small is estimated at ~15 minutes, configs/pretrain.py small's ~10 plus the draft's share):

  python -m specjax.main --config=configs/cotrain.py:size=tiny --workdir=/tmp/specjax/cotrain_tiny

Presets (`:size=...`): the target is configs/pretrain.py's preset of that name (same model, data
and schedule, so its validation loss compares with a plain pretrain run); the draft is the
distill preset `draft` (test for tiny, tiny for small; override with `size=small,draft=small`).
The draft's loss fields live in config.distill (divergence, beta, loss_temperature,
scale_by_t2, kd_weight, ce_weight); the data source is the target's own batch ('dataset').
Both models are checkpointed; load the draft with
specjax.checkpoint.load_model(workdir, params_key='draft_params', config_key='draft_config').
"""

import os

import ml_collections

from specjax.config_files import load_config, one_of, parse_arg
from specjax.distill.config import default_distill_config, model_config

_DEFAULT_DRAFT = {'tiny': 'test', 'small': 'tiny', 'base': 'medium'}


def _target_config(size: str) -> ml_collections.ConfigDict:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'pretrain.py')
    return load_config(f'{path}:size={size}')


def get_config(arg=None) -> ml_collections.ConfigDict:
    opts = parse_arg(arg, size=one_of('tiny', _DEFAULT_DRAFT), draft='')  # '' = size's default
    size = opts.size
    c = _target_config(size)  # mode, seed, data, model (the target), train, mesh
    c.mode = 'cotrain'
    c.draft = model_config(
        opts.draft or _DEFAULT_DRAFT[size],
        c.data.get_ref('vocab_size'),
        c.data.get_ref('seq_len'),
    )  # draft Transformer
    c.distill = default_distill_config()  # the draft's loss; prompt_len / max_new_tokens: eval
    c.init = ml_collections.ConfigDict()  # where the target starts
    c.init.target_workdir = ''  # '' = from scratch; else a pretrain workdir (same model and data)
    c.init.target_step = -1  # its checkpoint step to continue from (params, optimizer, data)
    c.sampling = ml_collections.ConfigDict()  # evaluation sampling (top-k / top-p)
    c.sampling.temperature = 1.0  # unused by cotrain's training (no generation)
    c.sampling.top_k = 0  # 0 = all tokens
    c.sampling.top_p = 1.0  # 1 = all mass
    return c
