"""The online_distill mode's config sections (stream, online) and its checks, run before any
model is trained, compiled or loaded; errors name the field and its value."""

from __future__ import annotations

import dataclasses

import ml_collections

from specjax.distill.config import default_distill_config
from specjax.distill.divergences import DIVERGENCES, ON_POLICY_ONLY
from specjax.distill.online_buffer import entry_bytes
from specjax.models import TransformerConfig
from specjax.sampling import SamplingConfig
from specjax.train.config import check_keys, default_train_config, validate_train_config
from specjax.train.runs import check_mesh_config

MODE = 'online_distill'
SECTIONS = (
    'mode', 'size', 'seed', 'compilation_cache', 'data', 'mesh', 'sampling', 'stream', 'online',
    'target', 'draft', 'retrained', 'target_workdir', 'draft_workdir', 'retrained_workdir',
)  # fmt: skip
# Fields of config.data every stage must share with the run (the tokenizer and the corpus).
SHARED_DATA_FIELDS = (
    'name', 'data_dir', 'text_feature', 'domain_feature', 'train_split', 'eval_split',
    'tokenizer', 'tokenizer_path', 'vocab_size',
)  # fmt: skip
# config.target of an imported target (e.g. configs/online_distill.py:size=smollm2): the model to
# import (specjax.interop source), its parameter layout and its vocabulary (the buffer's size)
IMPORTED_TARGET_FIELDS = ('source', 'scan_layers', 'vocab_size')


def default_stream_config() -> ml_collections.ConfigDict:
    """config.stream: the requests served, and how they are reported."""
    c = ml_collections.ConfigDict()
    c.domains = ('code', 'prose')  # the corpus domain before the shift, and after it
    c.requests = 384  # requests in the stream; the shift is at requests // 2
    c.split = 'validation'  # split whose documents the prompts are cut from
    c.prompt_len_min = 8  # prompt tokens, uniform in [min, max] per request
    c.prompt_len_max = 24
    c.max_new_tokens = 32  # tokens served per request (fewer after eos)
    c.stop_at_eos = True  # a request ends at the tokenizer's eos
    c.batch_size = 8  # requests per sampler call (a round); divides every count below
    c.window = 32  # requests per reported window (a multiple of batch_size dividing the halves)
    c.k = 4  # draft tokens per speculative round
    return c


def default_online_config() -> ml_collections.ConfigDict:
    """config.online: the buffer, the updates and their loss."""
    c = ml_collections.ConfigDict()
    c.buffer_size = 1024  # entries the FIFO buffer holds (its memory: results' buffer.bytes)
    c.max_buffer_mib = 256.0  # a config whose buffer would take more is refused
    c.wrong_below = 0.5  # a position enters when the draft's alpha_t there is below this ...
    c.right_fraction = 1.0  # ... and each other position with this probability (findings.md)
    c.update_every = 16  # requests between updates (a multiple of stream.batch_size)
    c.learn_every = 1  # the online arm's rounds re-scored into the buffer: every n-th (1: all)
    c.steps = 4  # distillation steps per update
    c.batch_size = 8  # requests per step, each a row with all of its buffered entries
    c.checkpoint_every = 1  # updates between checkpoints of the draft, its optimizer and buffer
    c.divergence = 'fkl'  # any of specjax.distill.divergences but the on-policy-only ones
    c.beta = 0.5  # JSD(beta) weight
    c.loss_temperature = 1.0  # applied to the stored target log-probs and the draft's logits
    c.scale_by_t2 = False
    c.lr = 3e-3  # constant learning rate of the draft's AdamW (a fresh optimizer state)
    c.b1 = 0.9
    c.b2 = 0.95
    c.eps = 1e-8
    c.weight_decay = 0.0
    c.grad_clip = 1.0  # global-norm clipping (<= 0: off)
    return c


@dataclasses.dataclass(frozen=True)
class Settings:
    """Derived sizes: rounds, width L of a served row (prompt + tokens), updates and steps."""

    rounds: int
    width: int
    updates: int
    total_steps: int
    sampling: SamplingConfig


def _int(value, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{field} must be an int >= {minimum}, got {value!r}')
    return value


def _unit(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f'{field} must be in [0, 1], got {value!r}')
    return float(value)


def _multiple(value: int, of: int, field: str, of_field: str) -> None:
    if value % of:
        raise ValueError(f'{field}={value} must be a multiple of {of_field}={of}')


def check_stream(s) -> tuple[int, int]:
    """config.stream -> (rounds, row width); ValueError naming the field otherwise."""
    check_keys(s, default_stream_config().keys(), 'config.stream')
    domains = tuple(s.domains)
    if (
        len(domains) != 2
        or domains[0] == domains[1]
        or not all(isinstance(d, str) for d in domains)
    ):
        raise ValueError(f'config.stream.domains must be two different names, got {domains!r}')
    batch = _int(s.batch_size, 'config.stream.batch_size', 1)
    requests = _int(s.requests, 'config.stream.requests', 2 * batch)
    _multiple(requests, 2 * batch, 'config.stream.requests', '2 x config.stream.batch_size')
    window = _int(s.window, 'config.stream.window', batch)
    _multiple(window, batch, 'config.stream.window', 'config.stream.batch_size')
    _multiple(requests // 2, window, 'config.stream.requests // 2', 'config.stream.window')
    lo = _int(s.prompt_len_min, 'config.stream.prompt_len_min', 1)
    hi = _int(s.prompt_len_max, 'config.stream.prompt_len_max', lo)
    new = _int(s.max_new_tokens, 'config.stream.max_new_tokens', 1)
    _int(s.k, 'config.stream.k', 1)
    if not isinstance(s.stop_at_eos, bool):
        raise ValueError(f'config.stream.stop_at_eos must be True or False, got {s.stop_at_eos!r}')
    return requests // batch, hi + new


def check_online(o, stream, width: int, vocab: int) -> tuple[int, int]:
    """config.online -> (updates, total steps); the buffer's bytes against max_buffer_mib."""
    check_keys(o, default_online_config().keys(), 'config.online')
    if o.divergence not in DIVERGENCES or o.divergence in ON_POLICY_ONLY:
        known = sorted(set(DIVERGENCES) - ON_POLICY_ONLY)
        raise ValueError(f'config.online.divergence={o.divergence!r}: use one of {known}')
    _unit(o.beta, 'config.online.beta')
    _unit(o.wrong_below, 'config.online.wrong_below')
    _unit(o.right_fraction, 'config.online.right_fraction')
    every = _int(o.update_every, 'config.online.update_every', 1)
    _multiple(every, stream.batch_size, 'config.online.update_every', 'config.stream.batch_size')
    steps = _int(o.steps, 'config.online.steps', 1)
    _int(o.batch_size, 'config.online.batch_size', 1)
    size = _int(o.buffer_size, 'config.online.buffer_size', 1)
    _int(o.checkpoint_every, 'config.online.checkpoint_every', 1)
    _int(o.learn_every, 'config.online.learn_every', 1)
    for name in ('loss_temperature', 'lr', 'max_buffer_mib'):
        if isinstance(o[name], bool) or not o[name] > 0:
            raise ValueError(f'config.online.{name} must be > 0, got {o[name]!r}')
    for name in ('b1', 'b2'):
        if not 0 <= o[name] < 1:
            raise ValueError(f'config.online.{name} must be in [0, 1), got {o[name]!r}')
    if o.weight_decay < 0 or o.eps <= 0:
        raise ValueError(
            f'config.online.weight_decay={o.weight_decay!r} must be >= 0 and eps={o.eps!r} > 0'
        )
    mib = size * entry_bytes(width, vocab) / 2**20
    if mib > o.max_buffer_mib:
        raise ValueError(
            f'config.online.buffer_size={size} entries of {width} tokens and {vocab} log-probs '
            f'take {mib:.1f} MiB, above config.online.max_buffer_mib={o.max_buffer_mib}'
        )
    updates = int(stream.requests) // every
    return updates, updates * steps


def optimizer_config(o, total_steps: int) -> ml_collections.ConfigDict:
    """config.online as a config.train for specjax.train.optimizer.make_optimizer: AdamW at a
    constant o.lr (no warmup, no decay) over the run's total_steps, clipped."""
    t = default_train_config()
    t.update(
        steps=max(total_steps, 1), warmup_steps=0, min_lr_ratio=1.0, lr=float(o.lr), b1=o.b1,
        b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
    )  # fmt: skip
    return t


def _check_stage_data(config, stage: str) -> None:
    for field in SHARED_DATA_FIELDS:
        if config[stage].data.get(field) != config.data.get(field):
            raise ValueError(
                f'config.{stage}.data.{field}={config[stage].data.get(field)!r} differs from '
                f'config.data.{field}={config.data.get(field)!r}: every stage reads one corpus '
                'and tokenizer'
            )


def _check_draft_stage(config, stage: str) -> TransformerConfig:
    c = config[stage]
    check_keys(c.distill, default_distill_config().keys(), f'config.{stage}.distill')
    validate_train_config(c.train)
    _check_stage_data(config, stage)
    if c.mode != 'distill':
        raise ValueError(f"config.{stage}.mode={c.mode!r}: the drafts are trained by 'distill'")
    return TransformerConfig.from_dict(c.draft)


def imported_target(config) -> bool:
    """Whether config.target names a model to import (config.target.source; imported into
    <workdir>/target by the mode's entry point, specjax.quickstart.online) rather than a
    pretrain config."""
    return 'source' in config.target


def _check_imported_target(t) -> None:
    check_keys(t, IMPORTED_TARGET_FIELDS, 'config.target')
    if not isinstance(t.source, str) or not t.source:
        raise ValueError(f'config.target.source must name a model to import, got {t.source!r}')
    _int(t.get('vocab_size'), 'config.target.vocab_size', 2)


def check_sections(config) -> None:
    """The config's sections are those of an online_distill config, and its mode this one."""
    check_keys(config, SECTIONS, 'config')
    missing = sorted(set(SECTIONS) - set(config.keys()))
    if missing:
        raise ValueError(f'Missing config section(s) {[f"config.{k}" for k in missing]}')
    if config.mode != MODE:
        raise ValueError(f'config.mode={config.mode!r} but this is the {MODE!r} mode')


def validate(config, target_vocab: int) -> Settings:
    """Every check of an online_distill config; target_vocab: the target's vocabulary (its
    config, or the metadata of config.target_workdir), for the buffer's size."""
    check_sections(config)
    imported = imported_target(config)
    if not config.target_workdir and imported:
        _check_imported_target(config.target)
    elif not config.target_workdir:
        from specjax.train.pretrain import validate_config

        validate_config(config.target)
    check_mesh_config(config.mesh)
    sampling = SamplingConfig.from_dict(config.sampling)
    rounds, width = check_stream(config.stream)
    updates, total = check_online(config.online, config.stream, width, target_vocab)
    drafts = {}
    for stage in ('draft', 'retrained'):
        if not config[f'{stage}_workdir']:
            drafts[stage] = _check_draft_stage(config, stage)
    if not config.target_workdir and not imported:
        _check_stage_data(config, 'target')
    for stage, cfg in drafts.items():
        if cfg.vocab_size != target_vocab:
            raise ValueError(
                f'config.{stage}.draft.vocab_size={cfg.vocab_size} differs from the '
                f"target's vocab_size={target_vocab}"
            )
    return Settings(rounds, width, updates, total, sampling)
