r"""Target pretraining on the embedded stdlib corpus (code + prose), next-token cross-entropy.

Run (CPU, 3.4M params, 1000 steps of 8 x 256 tokens; ends with validation loss next to the
corpus's count-bigram baseline and writes <workdir>/results.json). About 10 minutes at the
3.3-4k tokens/s of a quiet 2-core CPU (measured figures: docs/performance.md):

  python -m specjax.main --config=configs/pretrain.py:size=small \
      --workdir=/tmp/specjax/target_small

Presets (`:size=...`):
  tiny   0.39M params, 100 steps in well under a minute (smoke runs):
         python -m specjax.main --config=configs/pretrain.py:size=tiny --workdir=/tmp/t \
             --config.train.steps=100
  small  3.4M params (wide and shallow: fastest per token on CPU); beats the bigram baseline.
  base   287M params, bf16 compute, FSDP over every device: an accelerator run (5000 steps of
         64 x 1024 tokens, ~0.3B tokens: roughly an hour on one H100/H200-class GPU; not yet run).
         The stdlib corpus has only ~3.5M tokens: point --config.data.name at a larger
         array_record TFDS dataset (see specjax.data) or expect heavy overfitting.

Override any field, e.g. --config.train.steps=100 --config.train.lr=1e-3. Rerunning with the
same --workdir resumes from the latest checkpoint (data order included); a checkpoint made with
another model, tokenizer or corpus is refused, and so is any other result-changing field (seed,
steps, ...) unless --config.train.allow_config_change=True. SIGTERM saves and exits 42.
"""

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.data import default_data_config
from specjax.models import presets
from specjax.parallel import default_mesh_config
from specjax.train.config import default_train_config

# name: (seq_len, batch, steps, lr, warmup); model shapes: specjax.models.presets.TARGETS
_PRESETS = {
    'tiny': (128, 8, 100, 3e-3, 10),
    'small': (256, 8, 1000, 1e-3, 50),
    'base': (1024, 64, 5000, 3e-4, 500),
}


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = parse_arg(arg, size=one_of('small', _PRESETS)).size  # 'size=tiny' or 'tiny'
    seq_len, batch, steps, lr, warmup = _PRESETS[size]
    shape = presets.shape('target', size)
    c = ml_collections.ConfigDict()
    c.mode = 'pretrain'  # specjax.main dispatches on this
    c.seed = 0  # model init and data order

    c.data = default_data_config()  # corpus, tokenizer, packing (see specjax.data.config)
    c.data.seq_len = seq_len

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = c.data.get_ref('vocab_size')  # linked: set data.vocab_size instead
    c.model.d_model = shape['d_model']  # residual width
    c.model.n_layers = shape['n_layers']  # decoder blocks
    c.model.n_heads = shape['n_heads']  # query heads (head_dim = d_model / n_heads)
    c.model.n_kv_heads = shape['n_kv_heads']  # key/value heads (grouped-query attention)
    c.model.d_ff = shape['d_ff']  # SwiGLU hidden width
    c.model.max_len = seq_len  # longest sequence (RoPE positions); must be >= data.seq_len
    c.model.rope_theta = 10000.0  # rotary base
    c.model.tie_embeddings = True  # output head shares the embedding matrix
    c.model.norm_eps = 1e-6  # RMSNorm epsilon
    c.model.dtype = 'bfloat16' if size == 'base' else 'float32'  # activation compute dtype
    c.model.param_dtype = 'float32'  # parameter storage dtype
    c.model.scan_layers = False  # True: blocks stacked, one lax.scan body (faster deep compiles)

    c.train = default_train_config()  # optimizer, schedule, logging, eval, checkpoints
    c.train.steps = steps
    c.train.batch_size = batch
    c.train.lr = lr
    c.train.warmup_steps = warmup
    if size == 'tiny':
        c.train.log_every, c.train.eval_every, c.train.eval_batches = 10, 50, 4
        c.train.checkpoint_every = 50
    if size == 'small':
        c.train.log_every, c.train.eval_every, c.train.eval_batches = 50, 250, 8
        c.train.checkpoint_every = 500
    if size == 'base':
        c.train.log_every, c.train.eval_every, c.train.eval_batches = 50, 500, 16
        c.train.checkpoint_every = 500

    c.mesh = default_mesh_config()  # axes ('data', 'fsdp', 'tensor'), shape, logical-axis rules
    if size == 'base':
        c.mesh.shape = (1, -1, 1)  # FSDP: parameters, optimizer state and batch over all devices
    return c
