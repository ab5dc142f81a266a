r"""Distill a draft from a frozen target checkpoint (DistillSpec-style), toward acceptance.

First train a target, then distill. On a 2-core CPU the tiny preset takes about 5 minutes
(300 steps at ~1 s; measured 5.4 min on a shared machine), and ends with α, predicted τ, a
measured speculative run and predicted speedup in <workdir>/results.json:

  python -m specjax.main --config=configs/pretrain.py:size=small \
      --workdir=/tmp/specjax/target_small
  python -m specjax.main --config=configs/distill.py:size=tiny \
      --workdir=/tmp/specjax/distill_tiny \
      --config.distill.teacher_workdir=/tmp/specjax/target_small

Presets (`:size=...`, the draft's size; any other field is a flag):
  test   d_model 32 x 1 layer; unit tests and smoke runs (seconds).
  tiny   d_model 64 x 2 layers (~0.4M params with the 4096 vocabulary), 300 steps.
  small  d_model 128 x 2 layers (~0.9M params), 1000 steps.
  medium d_model 256 x 4 layers, for accelerator targets.

Common variations (all are config fields, so sweeps can set them):
  --config.distill.divergence=fkl|rkl|jsd|tvd|neg_log_alpha|expected_accepted_length
  --config.distill.beta=0.5             JSD(β) weight (0 = FKL, 1 = RKL)
  --config.distill.source=dataset|teacher|on_policy|mixture  --config.distill.mixture_lambda=0.5
  --config.sampling.temperature=1.0     generation temperature (teacher / on-policy data)
  --config.distill.loss_temperature=1.0 --config.distill.scale_by_t2=True
  --config.distill.kd_weight=0 --config.distill.ce_weight=1   (cross-entropy-only baseline)
Rerunning with the same --workdir resumes (the teacher must be the same checkpoint).
"""

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.data import default_data_config
from specjax.distill.config import default_distill_config, model_config
from specjax.parallel import default_mesh_config
from specjax.train.config import default_train_config

# size: (steps, batch, lr, warmup, log_every, eval_every)
_TRAIN = {
    'test': (20, 8, 3e-3, 2, 5, 10),
    'tiny': (300, 16, 3e-3, 30, 20, 100),
    'small': (1000, 16, 3e-3, 100, 50, 250),
    'medium': (5000, 64, 1e-3, 500, 50, 1000),
}


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = parse_arg(arg, size=one_of('tiny', _TRAIN)).size
    steps, batch, lr, warmup, log_every, eval_every = _TRAIN[size]
    c = ml_collections.ConfigDict()
    c.mode = 'distill'  # specjax.main dispatches on this
    c.seed = 0  # draft init, data order, generation and mixture choices

    c.data = default_data_config()  # must give the teacher's tokenizer (checked)
    c.data.seq_len = 128  # rows of the dataset source (<= the teacher's max_len)

    c.draft = model_config(size, c.data.get_ref('vocab_size'), 128)  # draft Transformer

    c.distill = default_distill_config()  # teacher, loss, data source, evaluation

    c.sampling = ml_collections.ConfigDict()  # generation of teacher / on-policy data
    c.sampling.temperature = 1.0  # 0 = greedy
    c.sampling.top_k = 0  # 0 = all tokens
    c.sampling.top_p = 1.0  # 1 = all mass

    c.train = default_train_config()  # optimizer, schedule, logging, eval, checkpoints
    c.train.steps = steps
    c.train.batch_size = batch
    c.train.lr = lr
    c.train.warmup_steps = warmup
    c.train.log_every = log_every
    c.train.eval_every = eval_every
    c.train.eval_batches = 4
    c.train.checkpoint_every = eval_every

    c.mesh = default_mesh_config()  # axes, shape, logical-axis rules
    return c
