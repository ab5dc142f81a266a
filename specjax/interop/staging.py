"""Workdirs written whole or not at all: what a failed import created is removed, nothing else.

`staged(workdir)` is a context manager yielding the directory to write into:
- workdir absent: a fresh hidden sibling (`.<name>.partial-<random>`), renamed to workdir when the
  body returns; on any exception the sibling (and any parent directories this call created) is
  removed, so a failed or interrupted write never leaves a half-made workdir under its name.
- workdir present: workdir itself; on any exception every file or directory under it that did
  not exist on entry is removed. Files that existed on entry are never removed.
Only local paths are staged; a URI (gs://...) is yielded unchanged.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator


def _tree(root: str) -> set[str]:
    """Every path under root (itself included), without following symlinks."""
    paths = {root}
    for parent, dirs, files in os.walk(root):
        paths.update(os.path.join(parent, n) for n in (*dirs, *files))
    return paths


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_new(root: str, before: set[str]) -> None:
    """Removes what appeared under root since `before` (a new directory goes with its contents)."""
    for parent, dirs, files in os.walk(root):
        for name in files:
            if os.path.join(parent, name) not in before:
                _remove(os.path.join(parent, name))
        new = [d for d in dirs if os.path.join(parent, d) not in before]
        for name in new:
            _remove(os.path.join(parent, name))
        dirs[:] = [d for d in dirs if d not in new]


def _missing_ancestors(path: str) -> list[str]:
    """The ancestors of path that do not exist, outermost first."""
    missing = []
    parent = os.path.dirname(path)
    while parent and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    return missing[::-1]


@contextlib.contextmanager
def staged(workdir: str) -> Iterator[str]:
    """The directory to write `workdir` into (see the module docstring)."""
    if '://' in str(workdir):
        yield workdir
        return
    target = os.path.abspath(os.path.expanduser(workdir))
    if os.path.lexists(target):
        before = _tree(target) if os.path.isdir(target) else {target}
        try:
            yield target
        except BaseException:
            if os.path.isdir(target):
                _remove_new(target, before)
            raise
        return
    created = _missing_ancestors(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    try:
        staging = os.path.join(
            parent, f'.{os.path.basename(target)}.partial-{secrets.token_hex(6)}'
        )
        os.mkdir(staging)  # (not mkdtemp: the workdir gets the umask's permissions, not 0700)
        try:
            yield staging
            os.rename(staging, target)  # fails if target appeared meanwhile (not empty)
        except BaseException:
            _remove(staging)
            raise
    except BaseException:
        if created:
            _remove(created[0])
        raise
