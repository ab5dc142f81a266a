r"""Train an EAGLE-3-shaped feature draft on a frozen target (training-time test, EAGLE-3).

The draft reads the target's hidden states after three of its blocks (low / mid / high), so the
target needs at least 3 blocks (configs/pretrain.py:size=small has 3). First train a target,
then the draft; the run ends with the held-out TTT loss and alpha at each unrolled step in
<workdir>/results.json (times on CPU not measured yet):

  python -m specjax.main --config=configs/pretrain.py:size=small \
      --workdir=workdirs/target_small
  python -m specjax.main --config=configs/feature_draft.py:size=tiny \
      --workdir=workdirs/feature_draft_tiny \
      --config.distill.teacher_workdir=workdirs/target_small

Presets (`:size=...`: the training schedule; the draft's width, heads and vocabulary come from
the target):
  test   20 steps, unit tests and smoke runs.
  tiny   300 steps of 16 rows.
  small  1000 steps of 16 rows.

Common variations (all config fields):
  --config.feature.ttt_steps=3          unrolled draft steps (1 = true target features only)
  --config.feature.step_decay=0.8       step j weighs 0.8 ** j
  --config.feature.feature_layers=(0,1,2)  target blocks fused (default low / mid / high)
  --config.feature.n_layers=1           the draft's decoder blocks
  --config.feature.vocab_file=DIR/vocab.json --config.feature.vocab_size=1024  reduced vocabulary
  --config.distill.divergence=fkl|tvd|neg_log_alpha|rkl|jsd
  --config.distill.source=teacher|dataset   the target's continuations of data prompts, or data
  --config.feature.cache=False          False (default): the frozen target recomputes its
                                        features and logits in every step (what the 'teacher'
                                        source needs: its rows are new every step). True: read
                                        them from the target's outputs on a finite row set,
                                        computed once and kept in bfloat16
                                        (specjax.distill.feature_cache); needs source=dataset and
                                        a caller that builds the cache (the SmolLM2 quickstart
                                        preset's draft_feature stage, which sets it)
Evaluation always runs the frozen target on the held-out rows (float32).
Rerunning with the same --workdir resumes (the target must be the same checkpoint); the draft
loads with specjax.distill.feature_mode.load_feature_draft(workdir).
"""

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.data import default_data_config
from specjax.distill.config import default_feature_config, default_feature_distill_config
from specjax.parallel import default_mesh_config
from specjax.train.config import default_train_config

# size: (steps, batch, lr, warmup, log_every, eval_every)
_TRAIN = {
    'test': (20, 8, 3e-3, 2, 5, 10),
    'tiny': (300, 16, 3e-3, 30, 20, 100),
    'small': (1000, 16, 3e-3, 100, 50, 250),
}


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = parse_arg(arg, size=one_of('tiny', _TRAIN)).size
    steps, batch, lr, warmup, log_every, eval_every = _TRAIN[size]
    c = ml_collections.ConfigDict()
    c.mode = 'feature_draft'  # specjax.main dispatches on this
    c.seed = 0  # draft init, data order and generation

    c.data = default_data_config()  # must give the target's tokenizer (checked)
    c.data.seq_len = 128  # rows of the dataset source and of evaluation (<= the target's max_len)

    c.distill = default_feature_distill_config()  # target, divergence, data source
    c.feature = default_feature_config()  # the draft and its training-time-test loss

    c.sampling = ml_collections.ConfigDict()  # generation of the target's continuations
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
