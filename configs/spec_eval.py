r"""Speculative-decoding evaluation: autoregressive vs speculative decoding of a target + draft.

Runs both samplers over validation-document prefixes (with domain labels) for a grid of draft
lengths k and sampling settings, measures c and v(k) on this hardware, and writes
<workdir>/spec_eval.json (acceptance statistics per bucket, wall time per token, measured vs
predicted speedup, optimal k, peak memory) plus <workdir>/results.json (headline numbers).

Trained checkpoints (after configs/pretrain.py and configs/distill.py; CPU, ~3-4 minutes):

  python -m specjax.main --config=configs/spec_eval.py:checkpoints \
      --workdir=/tmp/specjax/spec_eval \
      --config.target_workdir=/tmp/specjax/target_small \
      --config.draft_workdir=/tmp/specjax/distill_tiny

Random-init target and draft (runs before any checkpoint exists; CPU, ~3 minutes, most of it
compiling one sampler per (k, sampling) point):

  python -m specjax.main --config=configs/spec_eval.py:random \
      --workdir=/tmp/specjax/spec_eval_random

Give spec_eval its own --workdir: it refuses one whose results.json another mode wrote (a
training workdir), before loading anything. prompt_len_max + max_new_tokens + max(ks) + 1 must fit
both models' max_len; a mismatch fails early with the arithmetic.

Presets: `random` (models from config.model / config.draft) and `checkpoints` (models from the
two workdirs; their tokenizer identities must match each other and config.data's). Any field is
a flag, e.g. --config.eval.ks='(1,2,3,4)' --config.eval.samplings='((0.0,0,1.0),)'.
"""

import ml_collections

from specjax.config_files import one_of, parse_arg
from specjax.data import default_data_config
from specjax.parallel import default_mesh_config

_PRESETS = ('random', 'checkpoints')


def _model(d_model, n_layers, n_heads, d_ff, vocab_ref, max_len) -> ml_collections.ConfigDict:
    m = ml_collections.ConfigDict()
    m.vocab_size = vocab_ref  # must equal the tokenizer's vocabulary
    m.d_model = d_model  # residual width
    m.n_layers = n_layers  # decoder blocks
    m.n_heads = n_heads  # query heads
    m.n_kv_heads = n_heads  # key/value heads
    m.d_ff = d_ff  # SwiGLU hidden width
    m.max_len = max_len  # >= eval.prompt_len_max + eval.max_new_tokens + max(eval.ks) + 1
    m.rope_theta = 10000.0  # rotary base
    m.tie_embeddings = True  # output head shares the embedding matrix
    m.norm_eps = 1e-6  # RMSNorm epsilon
    m.dtype = 'float32'  # activation compute dtype
    m.param_dtype = 'float32'  # parameter storage dtype
    m.scan_layers = False  # True: blocks stacked, one lax.scan body
    return m


def get_config(arg=None) -> ml_collections.ConfigDict:
    preset = parse_arg(arg, preset=one_of('random', _PRESETS)).preset  # 'random' | 'checkpoints'
    c = ml_collections.ConfigDict()
    c.mode = 'spec_eval'  # specjax.main dispatches on this
    c.seed = 0  # random-init weights, prompt choice and sampling keys

    c.random_init = preset == 'random'  # True: random-init models from config.model/config.draft
    c.target_workdir = ''  # target's workdir (its checkpoints/), when random_init is False
    c.draft_workdir = ''  # draft's workdir (its checkpoints/), when random_init is False
    c.draft_params_key = 'params'  # state key of the draft's params ('draft_params' if co-trained)
    c.draft_config_key = 'model_config'  # metadata key of the draft's TransformerConfig
    # 'model': the draft is a model (draft_workdir, or config.draft when random_init); 'ngram':
    # the training-free prompt-lookup draft (specjax.sampling.NGramDraft), no draft_workdir
    c.draft_kind = 'model'
    c.ngram = ml_collections.ConfigDict()
    c.ngram.max_n = 3  # the longest n-gram matched against the context (longest first)
    c.ngram.min_n = 1  # the shortest
    # proposals per round after a match of n = 1..max_n tokens, capped at k (() = k after any)
    c.ngram.proposals_by_n = ()

    c.data = default_data_config()  # validation split supplies the prompts; tokenizer must match
    c.model = _model(256, 4, 4, 704, c.data.get_ref('vocab_size'), 256)  # random-init target
    c.draft = _model(128, 1, 2, 352, c.data.get_ref('vocab_size'), 256)  # random-init draft

    c.eval = ml_collections.ConfigDict()
    c.eval.prompts_per_domain = 8  # validation documents per domain (fewer if the split lacks)
    c.eval.prompt_len_min = 16  # prompt = a document's first L tokens (bos included), L uniform
    # prompt_len_max + max_new_tokens + max(ks) + 1 must fit both models' max_len (checked before
    # loading): 48 + 64 + 8 + 1 = 121 <= 128, the max_len of configs/distill.py's drafts.
    c.eval.prompt_len_max = 48  # ... in [prompt_len_min, prompt_len_max]
    c.eval.max_new_tokens = 64  # generated tokens per prompt (fewer if eos comes first)
    c.eval.stop_at_eos = True  # stop a row at the tokenizer's eos
    c.eval.batch_size = 8  # rows per sampler call (the last batch is padded, padding ignored)
    c.eval.ks = (1, 2, 4, 8)  # draft lengths k to evaluate
    c.eval.samplings = ((0.0, 0, 1.0), (1.0, 0, 1.0))  # (temperature, top_k, top_p) grid
    c.eval.prompt_len_edges = (24, 40)  # prompt-length bucket edges
    c.eval.gen_len_edges = (16, 64)  # generated-length bucket edges
    c.eval.acceptance = 'probabilistic'  # probabilistic|argmax_draft|strict|lenient|typical
    c.eval.acceptance_params = ml_collections.ConfigDict(
        dict(lenience=0.5, typical_threshold=0.09, typical_alpha=0.3)
    )  # lenient: eps in (0, 1]; typical: Medusa's threshold and alpha (lossy rules only)
    c.eval.timing_repeats = 5  # timed regions per point, round-robin over points (median)
    c.eval.timing_floor_s = 0.2  # each timed region repeats its pass until it lasts this long
    # True: greedy shares the T > 0 settings' programs (one per k; greedy decided at run time,
    # ~10% slower greedy rounds); for compile-bound runs
    c.eval.dynamic_greedy = False
    c.eval.calibration_iters = 16  # cached calls per timed loop (calibrate)
    c.eval.calibration_repeats = 5  # timed repeats; medians of ratios
    if preset == 'random':
        c.eval.prompts_per_domain = 8
        c.eval.max_new_tokens = 32
        c.eval.ks = (1, 2, 4)
        c.eval.gen_len_edges = (16, 32)

    c.mesh = default_mesh_config()  # axes ('data', 'fsdp', 'tensor'), shape, logical-axis rules
    return c
