"""What makes a checkpoint step trustworthy: a content digest committed with it, checked on read.

The digest is the sha256 and size of every file orbax wrote for a step (each item's array, JSON
and metadata files), except orbax's bookkeeping that it rewrites after the commit
(`_CHECKPOINT_METADATA`, `commit_success.txt`). It is stored as <step>/specjax_digest.json and
computed from the committed files, not from arrays in memory, so the check does not depend on
the shardings a step is restored onto nor on how many processes wrote it.

When it is written: `specjax.checkpoint.Checkpoints` computes it in orbax's post-finalization
callback, which orbax runs on process 0 after every process has written its files and before the
step's temporary folder is renamed to its number; the digest is therefore committed atomically
with the step (a kill at any moment leaves either no step or a step with its digest). A step
without a digest was saved before digests existed (it loads, with a warning).

How it is checked (`verify_step`): every recorded file exists with its size and sha256 (files not
in the record are ignored); the restoring code then checks that the float arrays are finite.
Every process of a multi-process run verifies on its own: the same files give every process the
same answer, so all of them fall back alike. The check reads the whole step once per process.

`verification_enabled()`: $SPECJAX_VERIFY_CHECKPOINTS ('0' / 'false' / 'off' turn digest and
finiteness checks on restore off; on by default). For negative controls only.

Errors: CorruptCheckpoint (a step whose content is not what was saved; its message names the step
folder and the file) and CheckpointWriteError (a save that failed, e.g. 'no space left on
device', naming the checkpoint folder and step; `write_error` maps orbax's and TensorStore's
errors to it). After a failed save TensorStore reports each of its still pending writes as an
unraisable 'Event loop is closed' error, and asyncio logs the gathered writes' disk errors as
'exception was never retrieved'; `quiet_orphaned_write_callbacks` drops both.
Also here: finiteness checks (`check_finite`), the files every committed step has
(`missing_file`) and moving broken steps aside (`move_aside`).
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import logging as py_logging
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath

from specjax.errors import SpecjaxError

BROKEN_DIR = 'checkpoints_broken'  # beside checkpoints/: steps a resuming run set aside
DIGEST_FILE = 'specjax_digest.json'
DIGEST_FORMAT = 'specjax-step-files-sha256-v1'
VERIFY_ENV = 'SPECJAX_VERIFY_CHECKPOINTS'
# Files every committed step has (orbax's step metadata, then each item's own metadata).
_REQUIRED_FILES = ('_CHECKPOINT_METADATA', 'state/_METADATA', 'data/metadata', 'meta/metadata')
# Written or rewritten by orbax after the post-finalization callback: not part of the content.
_UNHASHED = frozenset({'_CHECKPOINT_METADATA', 'commit_success.txt', DIGEST_FILE})
_TMP_SUFFIX = '.orbax-checkpoint-tmp'  # orbax's temporary step folder
_CHUNK = 1 << 22
# errno -> the words of the one-line message (disk full, quota exhausted, read-only disk).
_DISK_ERRORS = {
    errno.ENOSPC: 'no space left on device',
    errno.EDQUOT: 'disk quota exceeded',
    errno.EROFS: 'read-only file system',
}
_DISK_TEXTS = {
    'no space left on device': errno.ENOSPC,
    'disk quota exceeded': errno.EDQUOT,
    'read-only file system': errno.EROFS,
}


class CorruptCheckpoint(SpecjaxError, ValueError):
    """A checkpoint step whose files differ from those saved, or whose arrays are not finite.

    Training falls back to the previous step (the broken one is moved aside); readers that only
    load refuse it. The message names the step folder and what differs."""


class CheckpointWriteError(SpecjaxError, RuntimeError):
    """A checkpoint save failed (`errno`: the OSError number when known, e.g. ENOSPC); the
    message is one line naming the checkpoint folder, the step and the cause."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_


def verification_enabled() -> bool:
    """Whether restores verify digests and finiteness ($SPECJAX_VERIFY_CHECKPOINTS, default on)."""
    return os.environ.get(VERIFY_ENV, '1').strip().lower() not in ('0', 'false', 'no', 'off')


def _all_finite(tree):
    """Whether every float leaf is finite. Arrays spread over several processes are checked
    shard by shard on the host (no cross-process program: each process checks its own shards)."""
    if any(not getattr(x, 'is_fully_addressable', True) for x in jax.tree.leaves(tree)):
        return all(
            bool(np.isfinite(np.asarray(s.data)).all())
            for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)
            for s in x.addressable_shards
        )
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def check_finite(tree, what: str = 'params') -> None:
    """Raises FloatingPointError naming the first non-finite leaf of `tree`."""
    if bool(_all_finite(tree)):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        inexact = jnp.issubdtype(leaf.dtype, jnp.inexact)
        if inexact and not bool(jnp.all(jnp.isfinite(leaf))):
            raise FloatingPointError(f'non-finite values in {what}{jax.tree_util.keystr(path)}')
    raise FloatingPointError(f'non-finite values in {what}')


def _content_files(step_dir: epath.Path) -> dict[str, epath.Path]:
    """relative posix path -> file, for every content file under step_dir (sorted)."""
    out = {}

    def walk(folder: epath.Path, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f'{prefix}{entry.name}/')
            elif entry.name not in _UNHASHED:
                out[prefix + entry.name] = entry

    walk(step_dir, '')
    return dict(sorted(out.items()))


def _hash_file(file: epath.Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with file.open('rb') as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def write_digest(step_dir) -> None:
    """Writes <step_dir>/specjax_digest.json for the files now in step_dir."""
    step_dir = epath.Path(step_dir)
    files = {}
    for rel, file in _content_files(step_dir).items():
        size, digest = _hash_file(file)
        files[rel] = {'bytes': size, 'sha256': digest}
    record = {'format': DIGEST_FORMAT, 'files': files}
    (step_dir / DIGEST_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))


def write_step_digest(directory: str, step: int) -> None:
    """The digest of `step` in orbax's post-finalization callback (process 0, its save thread):
    every process has written the step, still in its temporary folder <step>.orbax-checkpoint-tmp
    (renamed after this) or, on object stores, already in place (a marker file commits it)."""
    root = epath.Path(directory)
    tmp = sorted(root.glob(f'{step}{_TMP_SUFFIX}*'))
    write_digest(tmp[-1] if tmp else root / str(step))


def check_restored_finite(tree, step_dir: str) -> None:
    """CorruptCheckpoint naming step_dir and the leaf if a float array of `tree` is not finite."""
    try:
        check_finite(tree, 'the restored arrays')
    except FloatingPointError as e:
        raise CorruptCheckpoint(f'checkpoint {step_dir} is corrupt: {e}') from None


def verify_step(step_dir) -> bool:
    """True if every file recorded in step_dir's digest is intact; False (and a warning) if the
    step has no digest (saved before digests were recorded); CorruptCheckpoint otherwise."""
    step_dir = epath.Path(step_dir)
    record_file = step_dir / DIGEST_FILE
    if not record_file.exists():
        logging.warning(
            'checkpoint %s has no content digest (%s; saved before digests were recorded): '
            'loading it unverified',
            step_dir,
            DIGEST_FILE,
        )
        return False
    try:
        record = json.loads(record_file.read_text())
        files = record['files']
        if record.get('format') != DIGEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f'format {record.get("format")!r}')
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpoint(
            f'checkpoint {step_dir} is corrupt: its digest {DIGEST_FILE} is unreadable ({e})'
        ) from None
    for rel, want in files.items():
        file = step_dir / rel
        if not file.exists():
            raise CorruptCheckpoint(f'checkpoint {step_dir} is corrupt: {rel} is missing')
        size, digest = _hash_file(file)
        if size != want['bytes'] or digest != want['sha256']:
            raise CorruptCheckpoint(
                f'checkpoint {step_dir} is corrupt: {rel} does not match what was saved '
                f'({size} bytes, sha256 {digest[:16]}; saved: {want["bytes"]} bytes, sha256 '
                f'{want["sha256"][:16]})'
            )
    return True


def missing_file(step_dir) -> str | None:
    """'<file> is missing' for the first file every committed step has that step_dir lacks."""
    for name in _REQUIRED_FILES:
        if not (epath.Path(step_dir) / name).exists():
            return f'{name} is missing'
    return None


def move_aside(directory: str, steps) -> list[str]:
    """Moves <directory>/<step> folders to <directory>/../checkpoints_broken/<step>.<time> (never
    deleted, so the step numbers can be written again); returns the new paths."""
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    dest_root = epath.Path(directory).parent / BROKEN_DIR
    moved = []
    for step in steps:
        dest = dest_root / f'{step}.{stamp}'
        dest_root.mkdir(parents=True, exist_ok=True)
        (epath.Path(directory) / str(step)).rename(dest)
        logging.warning('moved unreadable checkpoint step %d to %s (not deleted)', step, dest)
        moved.append(os.fspath(dest))
    return moved


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ''


def _orphaned_write_callback(unraisable) -> bool:
    """Whether an unraisable error is TensorStore completing a write for an asyncio event loop
    that orbax already closed (what a failed save leaves: its other writes finish later)."""
    text = str(unraisable.exc_value)
    if not (text == 'Event loop is closed' or text.startswith('sys.meta_path is None')):
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    return any(f'{os.sep}asyncio{os.sep}' in frame.filename for frame in frames)


class _UnretrievedDiskErrors(py_logging.Filter):
    """Drops asyncio's 'exception was never retrieved' records whose exception is a disk error
    (the other writes of a save that failed; the failure is raised as CheckpointWriteError)."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or 'exception was never retrieved' not in str(record.msg):
            return True
        return _disk_errno(error) is None


def quiet_orphaned_write_callbacks() -> None:
    """Drops (process-wide, once) the unraisable 'Event loop is closed' errors that TensorStore
    reports, one per pending write, after a save failed, and asyncio's log records of the same
    writes' disk errors; the failure itself is raised as CheckpointWriteError. Every other
    unraisable error goes to the previous hook, every other record is logged."""
    previous = sys.unraisablehook
    if getattr(previous, '_specjax_quiet', False):
        return
    py_logging.getLogger('asyncio').addFilter(_UnretrievedDiskErrors())

    def hook(unraisable):
        if not _orphaned_write_callback(unraisable):
            previous(unraisable)

    hook._specjax_quiet = True
    sys.unraisablehook = hook


def _disk_errno(error: BaseException) -> int | None:
    """The disk-error errno found in `error`, its causes or its text (TensorStore reports
    OSErrors as text), else None."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_ERRORS:
            return e.errno
        text = str(e).lower()
        for words, number in _DISK_TEXTS.items():
            if words in text:
                return number
        stack += [e.__cause__, e.__context__, *getattr(e, 'exceptions', ())]
    return None


def write_error(error: BaseException, directory: str, step: int | None) -> CheckpointWriteError:
    """The one-line CheckpointWriteError for a failed save of `step` into `directory`."""
    number = _disk_errno(error)
    where = f'checkpoint step {step} could not be written to {directory}'
    if number is not None:
        return CheckpointWriteError(f'{where}: {_DISK_ERRORS[number]}', number)
    first = ' '.join(str(error).split())[:300]
    return CheckpointWriteError(f'{where}: {type(error).__name__}: {first}')
