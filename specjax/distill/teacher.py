"""The frozen teacher: loaded once from its own workdir, checked against this run, fingerprinted.

The teacher is never trained, has no optimizer state and is not re-saved with the draft: the draft
checkpoint's metadata records where it came from (`teacher_identity`), and a resumed run must
find the very same teacher (same path, step, config and parameter fingerprint).
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import numpy as np

from specjax import workdir as workdir_lib
from specjax.checkpoint import Checkpoints, CorruptCheckpoint, load_model
from specjax.models import TransformerConfig, split


@dataclasses.dataclass
class Teacher:
    graphdef: object
    params: object  # nnx.State, sharded on the run's mesh; never donated or updated
    config: TransformerConfig
    metadata: dict  # the teacher checkpoint's meta (model_config, tokenizer, corpus, ...)
    workdir: str
    step: int

    def identity(self) -> dict:
        """Recorded in (and on resume compared with) the draft checkpoint's metadata."""
        return {
            'workdir': self.workdir,
            'step': self.step,
            'mode': self.metadata.get('mode'),
            'model_config': self.config.to_dict(),
            'tokenizer': self.metadata.get('tokenizer'),
            'corpus': self.metadata.get('corpus'),
            'params_sha256': params_fingerprint(self.params),
        }


def params_fingerprint(params) -> str:
    """sha256 over each parameter's path, dtype, shape and bytes (host copy; small models)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = np.asarray(jax.device_get(leaf))
        h.update(f'{jax.tree_util.keystr(path)}:{arr.dtype}:{arr.shape}\n'.encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def teacher_step(workdir: str, step: int) -> int:
    """The checkpoint step to load (-1 = latest); ValueError naming the field if absent."""
    with Checkpoints(workdir, read_only=True) as ckpts:
        steps = ckpts.all_steps()
    if not steps:
        raise ValueError(f'config.distill.teacher_workdir={workdir!r} has no checkpoints')
    if step == -1:
        return max(steps)
    if step not in steps:
        raise ValueError(
            f'config.distill.teacher_step={step} is not a checkpoint of {workdir!r} '
            f'(have {sorted(steps)})'
        )
    return step


def load_teacher(workdir: str, step: int, *, mesh, rules) -> Teacher:
    """Loads the teacher's params onto `mesh`; clear ValueErrors for missing / mismatched ones
    (CorruptCheckpoint naming the step folder if its files or params are not what was saved)."""
    workdir = workdir_lib.resolve(workdir)
    step = teacher_step(workdir, step)
    try:
        model, meta = load_model(workdir, step, mesh=mesh, rules=rules)
    except CorruptCheckpoint:  # verified on load: refused as it is, naming the step folder
        raise
    except Exception as e:  # orbax: stored arrays do not fit the recorded model_config, ...
        raise ValueError(
            f'config.distill.teacher_workdir={workdir!r} step {step}: cannot load the teacher; '
            f'its checkpoint does not match its recorded model_config or is unreadable '
            f'({type(e).__name__}: {e})'
        ) from e
    for key in ('model_config', 'tokenizer'):
        if key not in meta:
            raise ValueError(f'teacher checkpoint {workdir!r} step {step} has no {key!r} metadata')
    graphdef, params = split(model)
    _check_shapes(params, meta, workdir, step)
    return Teacher(graphdef, params, model.config, meta, workdir, step)


def _check_shapes(params, meta, workdir, step) -> None:
    cfg = TransformerConfig.from_dict(meta['model_config'])
    emb = params['embed'][...]
    if tuple(emb.shape) != (cfg.vocab_size, cfg.d_model):
        raise ValueError(
            f'teacher checkpoint {workdir!r} step {step}: embedding {tuple(emb.shape)} does not '
            f'match its model_config ({cfg.vocab_size}, {cfg.d_model})'
        )


def precheck(config, draft_cfg: TransformerConfig, *, data_config: bool = True) -> None:
    """Vocabulary / tokenizer checks from the teacher's metadata alone, before any data work.

    Runs before the tokenizer is built (a SentencePiece model may otherwise be trained first):
    config.draft.vocab_size must equal the teacher's, and config.data.tokenizer (and, for
    SentencePiece, config.data.vocab_size) must match the teacher's tokenizer identity (skipped
    with data_config=False: the caller supplies the data itself).
    """
    d = config.distill
    workdir = workdir_lib.resolve(d.teacher_workdir)
    step = teacher_step(workdir, int(d.teacher_step))
    with Checkpoints(workdir, read_only=True) as ckpts:
        meta = ckpts.metadata(step)
    t_vocab = meta.get('model_config', {}).get('vocab_size')
    if t_vocab is not None and draft_cfg.vocab_size != t_vocab:
        raise ValueError(
            f"config.draft.vocab_size={draft_cfg.vocab_size} differs from the teacher's "
            f'vocab_size={t_vocab} (config.distill.teacher_workdir={workdir!r} step {step}): '
            'draft and target must share a vocabulary'
        )
    if not data_config:
        return
    tok = meta.get('tokenizer') or {}
    kind = config.data.get('tokenizer')
    if tok.get('kind') and kind != tok['kind']:
        raise ValueError(
            f"config.data.tokenizer={kind!r} differs from the teacher's {tok['kind']!r} "
            f'(config.distill.teacher_workdir={workdir!r})'
        )
    data_vocab = config.data.get('vocab_size')
    if kind == 'sentencepiece' and tok.get('vocab_size') not in (None, data_vocab):
        raise ValueError(
            f"config.data.vocab_size={data_vocab!r} differs from the teacher's tokenizer "
            f'vocab_size={tok["vocab_size"]} (config.distill.teacher_workdir={workdir!r})'
        )


def check_compatible(teacher: Teacher, draft_cfg: TransformerConfig, tokenizer: dict) -> None:
    """The draft must share the teacher's tokenizer and vocabulary (clear error otherwise)."""
    if teacher.metadata['tokenizer'] != tokenizer:
        raise ValueError(
            f"tokenizer mismatch: config.data's tokenizer {tokenizer!r} differs from the "
            f"teacher's {teacher.metadata['tokenizer']!r} (config.distill.teacher_workdir="
            f"{teacher.workdir!r}); the draft must share the target's tokenizer"
        )
    if draft_cfg.vocab_size != teacher.config.vocab_size:
        raise ValueError(
            f"config.draft.vocab_size={draft_cfg.vocab_size} differs from the teacher's "
            f'vocab_size={teacher.config.vocab_size}: draft and target must share a vocabulary'
        )
