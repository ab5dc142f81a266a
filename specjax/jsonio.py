"""JSON for every record specjax writes: normalised values and one atomic writer.

- `to_json(value)`: a value (ConfigDict, tuples, numpy scalars) as JSON gives it back; NaN stays
  NaN. Checkpoint metadata and results.json configs go through it, so a saved config compares
  equal to the live one.
- `jsonable(obj)`: numpy arrays, tuples, ConfigDicts and NaN/Inf -> plain JSON values (NaN/Inf
  become null); what `write_json` writes.
- `write_json(path, obj)`: atomic (temporary file, then rename), local or remote (etils.epath).

Differences between two configs are specjax.config_diff's (every differing field, named).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
from etils import epath


def to_json(value) -> Any:
    """Normalises a value (ConfigDict, tuples, numpy scalars) to what JSON gives back."""
    if hasattr(value, 'to_json_best_effort'):
        return json.loads(value.to_json_best_effort())

    def as_plain(o):
        if hasattr(o, 'to_json_best_effort'):  # a ConfigDict nested in a dict
            return json.loads(o.to_json_best_effort())
        return o.item() if hasattr(o, 'item') else str(o)

    return json.loads(json.dumps(value, default=as_plain))


def jsonable(obj):
    """numpy, tuples, ConfigDicts and NaN/Inf -> plain JSON values (NaN/Inf become None)."""
    if hasattr(obj, 'to_dict') and callable(obj.to_dict):
        return jsonable(obj.to_dict())
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_text(path, text: str) -> None:
    """Writes `text` to path (local or remote) through a temporary file and a rename."""
    if not isinstance(path, epath.Path):
        path = path if '://' in os.fspath(path) else os.path.abspath(path)
    file = epath.Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.parent / (file.name + '.tmp')
    tmp.write_text(text)
    tmp.replace(file)


def write_json(path: str, obj, *, indent: int | None = 2, sort_keys: bool = False) -> str:
    """Writes jsonable(obj) to path (local or gs://) atomically; returns path."""
    write_text(path, json.dumps(jsonable(obj), indent=indent, sort_keys=sort_keys))
    return path


def read_json(path) -> Any:
    """The JSON value in a local or remote file."""
    return json.loads(epath.Path(path).read_text())
