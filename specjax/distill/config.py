"""config.distill defaults, model size presets and validation for the distill and cotrain modes
(sections, loss identity, vocabulary checks).

Everything a sweep may vary is a typed config field (never None), so `--config.distill.X=...`
and sweep overrides work. Validation runs before anything is built and raises ValueError naming
`config.<section>.<field>` and the value.
"""

from __future__ import annotations

import os

import ml_collections

from specjax.distill.divergences import DIVERGENCES, ON_POLICY_ONLY
from specjax.models import TransformerConfig, presets
from specjax.sampling import SamplingConfig
from specjax.train.config import check_keys, validate_train_config
from specjax.train.runs import check_mesh_config

SOURCES = ('dataset', 'teacher', 'on_policy', 'mixture')
MIXTURE_BASES = ('dataset', 'teacher')
DISTILL_SECTIONS = ('mode', 'seed', 'draft', 'data', 'train', 'sampling', 'mesh', 'distill')
COTRAIN_SECTIONS = DISTILL_SECTIONS + ('model', 'init')
_IDENTITY_FIELDS = (
    'divergence',
    'beta',
    'block_size',
    'loss_temperature',
    'scale_by_t2',
    'kd_weight',
    'ce_weight',
    'source',
    'mixture_lambda',
    'mixture_base',
    'prompt_len',
    'max_new_tokens',
)

# Draft sizes live in specjax.models.presets (one registry); the name is kept for callers.
MODEL_PRESETS = presets.DRAFTS


def model_config(size: str, vocab_size: int, max_len: int) -> ml_collections.ConfigDict:
    """config.model / config.draft for a preset `size` (TransformerConfig fields)."""
    if size not in MODEL_PRESETS:
        raise ValueError(f'model size preset {size!r} unknown; known: {sorted(MODEL_PRESETS)}')
    c = ml_collections.ConfigDict()
    c.vocab_size = vocab_size  # must equal the tokenizer's (and the teacher's) vocabulary
    c.max_len = max_len  # longest sequence / KV cache capacity
    for key, value in MODEL_PRESETS[size].items():
        c[key] = value
    c.rope_theta = 10000.0  # RoPE base
    c.tie_embeddings = True  # output head shares the embedding matrix
    c.norm_eps = 1e-6  # RMSNorm epsilon
    c.dtype = 'float32'  # activation dtype
    c.param_dtype = 'float32'  # parameter dtype
    c.scan_layers = False  # True: blocks stacked, one lax.scan body (faster deep compiles)
    return c


def default_distill_config() -> ml_collections.ConfigDict:
    """config.distill: the loss, the data source and the evaluation of a draft."""
    c = ml_collections.ConfigDict()
    c.teacher_workdir = ''  # workdir of the frozen target (distill mode); '' = not set
    c.teacher_step = -1  # teacher checkpoint step (-1 = latest)
    c.divergence = 'fkl'  # fkl | rkl | jsd | tvd | neg_log_alpha | expected_accepted_length
    c.beta = 0.5  # JSD(β) mixture weight in [0, 1] (0 = FKL, 1 = RKL, as in TRL)
    c.block_size = 4  # k of the expected-accepted-length loss (draft blocks of k tokens)
    c.loss_temperature = 1.0  # temperature applied to both p and q logits inside the loss
    c.scale_by_t2 = False  # multiply the divergence by loss_temperature ** 2 (Hinton et al.)
    c.kd_weight = 1.0  # weight of the divergence (0 with ce_weight 1 = cross-entropy baseline)
    c.ce_weight = 0.0  # weight of an added next-token cross-entropy on data tokens
    c.source = 'dataset'  # dataset | teacher | on_policy | mixture (on-policy w.p. mixture_lambda)
    c.mixture_lambda = 0.5  # probability that a mixture batch is on-policy (draft-generated)
    c.mixture_base = 'dataset'  # what a mixture batch is otherwise: dataset | teacher
    c.prompt_len = 32  # prompt tokens taken from each data row for generated continuations
    c.max_new_tokens = 64  # generated tokens per prompt (training and evaluation)
    c.eval_temperatures = (0.0, 1.0)  # α is reported at each (0 = argmax agreement)
    c.eval_ks = (1, 2, 4, 8)  # predicted τ reported for each k
    c.eval_generate_batches = 1  # eval batches whose prompts the draft continues for α
    c.final_spec_k = 4  # k of the measured speculative run at the end (0 = skip it)
    c.final_spec_batches = 1  # eval batches of prompts for the measured speculative run
    c.calibrate = True  # time c and v(k) at the end for predicted_speedup (False: null)
    return c


def _check_unit(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f'{field} must be in [0, 1], got {value!r}')


def _check_int(value, field: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{field} must be an int >= {minimum}, got {value!r}')


def validate_distill_section(d, mode: str) -> None:
    """Checks config.distill (names, ranges, source/loss compatibility) for `mode`."""
    check_keys(d, default_distill_config().keys(), 'config.distill')
    if d.divergence not in DIVERGENCES:
        raise ValueError(
            f'config.distill.divergence={d.divergence!r} is not a known divergence; '
            f'known: {sorted(DIVERGENCES)}'
        )
    if d.source not in SOURCES:
        raise ValueError(
            f'config.distill.source={d.source!r} is not a known data source; known: {list(SOURCES)}'
        )
    if d.mixture_base not in MIXTURE_BASES:
        raise ValueError(
            f'config.distill.mixture_base={d.mixture_base!r} must be one of {list(MIXTURE_BASES)}'
        )
    _check_unit(d.beta, 'config.distill.beta')
    _check_unit(d.mixture_lambda, 'config.distill.mixture_lambda')
    if d.divergence in ON_POLICY_ONLY and d.source not in ('on_policy', 'mixture'):
        raise ValueError(
            f'config.distill.divergence={d.divergence!r} needs draft-sampled blocks: use '
            f"config.distill.source='on_policy' or 'mixture', not {d.source!r}"
        )
    if mode == 'cotrain' and d.source != 'dataset':
        raise ValueError(
            f"config.distill.source={d.source!r}: cotrain distills on the target's own batch, "
            "so only 'dataset' is supported"
        )
    if not d.loss_temperature > 0:
        raise ValueError(f'config.distill.loss_temperature must be > 0, got {d.loss_temperature!r}')
    for name in ('kd_weight', 'ce_weight'):
        if not d[name] >= 0:
            raise ValueError(f'config.distill.{name} must be >= 0, got {d[name]!r}')
    if d.kd_weight == 0 and d.ce_weight == 0:
        raise ValueError('config.distill.kd_weight and ce_weight are both 0: nothing to train on')
    for name, minimum in (
        ('block_size', 1),
        ('prompt_len', 1),
        ('max_new_tokens', 1),
        ('eval_generate_batches', 0),
        ('final_spec_k', 0),
        ('final_spec_batches', 1),
    ):
        _check_int(d[name], f'config.distill.{name}', minimum)
    temps = tuple(d.eval_temperatures)
    if not temps or any(not t >= 0 for t in temps):
        raise ValueError(f'config.distill.eval_temperatures must be >= 0, got {temps!r}')
    ks = tuple(d.eval_ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f'config.distill.eval_ks must be ints >= 1, got {ks!r}')
    if mode == 'distill':
        check_teacher_workdir(d, mode)


def check_teacher_workdir(d, mode: str) -> None:
    """ValueError unless config.distill.teacher_workdir is set and holds checkpoints/."""
    if not d.teacher_workdir:
        raise ValueError(
            f"config.distill.teacher_workdir is not set (got ''): {mode} needs "
            'the workdir of a trained target'
        )
    if not os.path.isdir(os.path.join(os.path.expanduser(d.teacher_workdir), 'checkpoints')):
        raise ValueError(
            f'config.distill.teacher_workdir={d.teacher_workdir!r} has no checkpoints/ '
            'folder: train the target first (mode pretrain) or fix the path'
        )


def needed_len(d, data_seq_len: int) -> int:
    """Longest position a model sees: training rows, generated rows, the final speculative run."""
    generated = d.prompt_len + d.max_new_tokens
    spec = generated + (d.final_spec_k + 1 if d.final_spec_k else 0)
    return max(data_seq_len, generated, spec)


def validate_common(config, mode: str, sections) -> TransformerConfig:
    """Checks the sections shared by distill and cotrain; returns the draft TransformerConfig."""
    check_keys(config, sections, 'config')
    missing = sorted(set(sections) - set(config.keys()) - {'init'})  # init: cotrain, optional
    if missing:
        raise ValueError(f'Missing config section(s) {[f"config.{k}" for k in missing]}')
    if config.mode != mode:
        raise ValueError(f'config.mode={config.mode!r} but this is the {mode!r} mode')
    validate_train_config(config.train)
    validate_distill_section(config.distill, mode)
    SamplingConfig.from_dict(config.sampling)  # ValueError naming the SamplingConfig field
    check_mesh_config(config.mesh)
    seq_len = config.data.seq_len
    _check_int(seq_len, 'config.data.seq_len', 2)
    draft = TransformerConfig.from_dict(config.draft)
    need = needed_len(config.distill, seq_len)
    if need > draft.max_len:
        raise ValueError(
            f'config.draft.max_len={draft.max_len} is below {need} (config.data.seq_len, '
            'distill.prompt_len + max_new_tokens (+ final_spec_k + 1))'
        )
    return draft


def sampling_config(config) -> SamplingConfig:
    """config.sampling as a SamplingConfig (generation of teacher / on-policy data)."""
    return SamplingConfig.from_dict(config.sampling)


def loss_identity(config) -> dict:
    """The config.distill fields a resumed run must match (loss, source, generation)."""
    return {k: config.distill[k] for k in _IDENTITY_FIELDS}


# ---------------------------------------------------------------- the feature_draft mode

FEATURE_SECTIONS = ('mode', 'seed', 'data', 'train', 'sampling', 'mesh', 'distill', 'feature')
FEATURE_SOURCES = ('teacher', 'dataset')  # the draft cannot generate on its own (no on_policy)
FEATURE_DISTILL_FIELDS = (
    'teacher_workdir',
    'teacher_step',
    'divergence',
    'beta',
    'source',
    'prompt_len',
    'max_new_tokens',
)


def default_feature_distill_config() -> ml_collections.ConfigDict:
    """config.distill of the feature_draft mode: the target, the loss's divergence and the data
    (FEATURE_DISTILL_FIELDS, defaults as the distill mode's; source 'teacher')."""
    full = default_distill_config()
    c = ml_collections.ConfigDict({k: full[k] for k in FEATURE_DISTILL_FIELDS})
    c.source = 'teacher'  # teacher: the target's continuations of data prompts | dataset
    return c


def default_feature_config() -> ml_collections.ConfigDict:
    """config.feature: the EAGLE-3-shaped draft and its training-time-test loss."""
    c = ml_collections.ConfigDict()
    c.feature_layers = ()  # target blocks fused (>= 3 distinct); () = low / mid / high
    c.n_layers = 1  # the draft's decoder blocks
    c.ttt_steps = 3  # unrolled draft steps (1 = true target features only)
    c.step_decay = 0.8  # step j of the unroll weighs step_decay ** j, in (0, 1]
    c.vocab_file = ''  # JSON with 'ids' (target ids, most frequent first); '' = full vocabulary
    c.vocab_size = 0  # the first vocab_size ids of vocab_file (0 = all of them)
    c.freeze_embedding = True  # keep the embedding copied from the target fixed
    # the draft's final norm and head start as the target's (its output columns of the draft's
    # vocabulary); False: from the seed, as EAGLE-3
    c.init_head = False
    # the target's features and log-probs on a finite row set computed once, kept in bfloat16
    # (specjax.distill.feature_cache; needs source 'dataset' and a caller that builds it: the
    # SmolLM2 preset's stage); False: the frozen target runs in every step
    c.cache = False
    return c


def feature_row_lengths(config) -> tuple[int, ...]:
    """Lengths of the rows the feature draft trains and evaluates on (the TTT unroll's T)."""
    d = config.distill
    rows = (config.data.seq_len,)
    return rows + ((d.prompt_len + d.max_new_tokens,) if d.source == 'teacher' else ())


def validate_feature_draft_config(config) -> None:
    """Checks a feature_draft config before anything is read or built (the target-dependent
    checks, feature_layers in range and the vocabulary, follow once its metadata is read)."""
    check_keys(config, FEATURE_SECTIONS, 'config')
    missing = sorted(set(FEATURE_SECTIONS) - set(config.keys()))
    if missing:
        raise ValueError(f'Missing config section(s) {[f"config.{k}" for k in missing]}')
    if config.mode != 'feature_draft':
        raise ValueError(f"config.mode={config.mode!r} but this is the 'feature_draft' mode")
    validate_train_config(config.train)
    SamplingConfig.from_dict(config.sampling)
    check_mesh_config(config.mesh)
    d, f = config.distill, config.feature
    check_keys(d, FEATURE_DISTILL_FIELDS, 'config.distill')
    if d.divergence not in DIVERGENCES or d.divergence in ON_POLICY_ONLY:
        known = sorted(set(DIVERGENCES) - ON_POLICY_ONLY)
        raise ValueError(f'config.distill.divergence={d.divergence!r} is not one of {known}')
    if d.source not in FEATURE_SOURCES:
        raise ValueError(
            f'config.distill.source={d.source!r} must be one of {list(FEATURE_SOURCES)}'
        )
    _check_unit(d.beta, 'config.distill.beta')
    for name in ('prompt_len', 'max_new_tokens'):
        _check_int(d[name], f'config.distill.{name}', 1)
    _check_int(config.data.seq_len, 'config.data.seq_len', 2)
    check_keys(f, default_feature_config().keys(), 'config.feature')
    layers = tuple(f.feature_layers)
    if layers and (
        any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
        or len(set(layers)) != len(layers)
        or len(layers) < 3
    ):
        raise ValueError(
            f'config.feature.feature_layers={layers!r} must be () or >= 3 distinct block indices'
        )
    _check_int(f.n_layers, 'config.feature.n_layers', 1)
    _check_int(f.ttt_steps, 'config.feature.ttt_steps', 1)
    shortest = min(feature_row_lengths(config))
    if f.ttt_steps >= shortest:
        raise ValueError(
            f"config.feature.ttt_steps={f.ttt_steps} must be below the training rows' length "
            f'{shortest} (config.data.seq_len / distill.prompt_len + max_new_tokens)'
        )
    decay = f.step_decay
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
        raise ValueError(f'config.feature.step_decay must be in (0, 1], got {decay!r}')
    _check_int(f.vocab_size, 'config.feature.vocab_size', 0)
    if f.vocab_size and not f.vocab_file:
        raise ValueError(
            f"config.feature.vocab_size={f.vocab_size} needs config.feature.vocab_file (got '')"
        )
    if f.vocab_file and not os.path.isfile(os.path.expanduser(f.vocab_file)):
        raise ValueError(f'config.feature.vocab_file={f.vocab_file!r} is not a file')
    if not isinstance(f.freeze_embedding, bool):
        raise ValueError(
            f'config.feature.freeze_embedding must be True or False, got {f.freeze_embedding!r}'
        )
    if not isinstance(f.init_head, bool):
        raise ValueError(f'config.feature.init_head must be True or False, got {f.init_head!r}')
    if not isinstance(f.cache, bool):
        raise ValueError(f'config.feature.cache must be True or False, got {f.cache!r}')
    if f.cache and d.source != 'dataset':
        raise ValueError(
            f"config.feature.cache=True needs config.distill.source='dataset' (a finite row set), "
            f'got {d.source!r}, whose rows are new every step'
        )
    check_teacher_workdir(d, 'feature_draft')
