"""Reporting helpers for experiment modes: JSON-safe values, atomic writes, markdown tables."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np
from etils import epath


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


def write_json(path: str, obj) -> str:
    """Writes jsonable(obj) to path (local or gs://, via etils.epath) by a temporary file."""
    file = epath.Path(path if '://' in os.fspath(path) else os.path.abspath(path))
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.parent / (file.name + '.tmp')
    tmp.write_text(json.dumps(jsonable(obj), indent=2, sort_keys=False))
    tmp.replace(file)
    return path


def fmt(x, digits: int = 3) -> str:
    """A table cell: '-' for None/NaN, ints as is, floats with `digits` significant digits."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return '-'
    if isinstance(x, bool | str):
        return str(x)
    if isinstance(x, int | np.integer):
        return str(int(x))
    return f'{float(x):.{digits}g}'


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub markdown table; cells go through `fmt`."""
    lines = ['| ' + ' | '.join(headers) + ' |', '|' + '|'.join('---' for _ in headers) + '|']
    lines += ['| ' + ' | '.join(fmt(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines)


def sampling_label(sampling) -> str:
    """'T=1,top_k=0,top_p=1' (greedy: 'T=0')."""
    if sampling.temperature == 0:
        return 'T=0'
    return f'T={sampling.temperature:g},top_k={sampling.top_k},top_p={sampling.top_p:g}'


def key_safe(label: str) -> str:
    """A results.json key without dots (sweep summaries address nested keys with dots)."""
    return label.replace('.', 'p').replace('=', '').replace(',', '_')
