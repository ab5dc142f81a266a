"""Every field that differs between two JSON config trees, for drift refusals that name them all.

`differences(saved, current)` walks nested dicts (ConfigDict.to_dict(), a checkpoint's 'meta'
JSON) and returns (dotted path, saved, current) for every leaf that differs, in sorted path
order; a field present on one side only has ABSENT on the other. Lists and tuples are compared
as whole values (a changed `eval.ks` is one field). `describe(...)` renders them as one line.
Imports nothing from specjax (any layer may use it).
"""

from __future__ import annotations

from typing import Any


class _Absent:
    """The value of a field one side does not have."""

    def __repr__(self) -> str:
        return '(absent)'


ABSENT = _Absent()


def differences(saved, current, path: str = '') -> list[tuple[str, Any, Any]]:
    """(dotted path, saved value, current value) for every differing leaf, sorted by path."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            sub = f'{path}.{key}' if path else str(key)
            out += differences(saved.get(key, ABSENT), current.get(key, ABSENT), sub)
        return out
    if _same(saved, current):
        return []
    return [(path, saved, current)]


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b or (_number(a) and _number(b) and a == b)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def describe(
    diffs: list[tuple[str, Any, Any]], saved_label: str = 'in the workdir', current_label='now'
) -> str:
    """'a.b: 1 in the workdir, 2 now; c: ...' (one line; every difference)."""
    parts = [f'{p}: {old!r} {saved_label}, {new!r} {current_label}' for p, old, new in diffs]
    return '; '.join(parts)
