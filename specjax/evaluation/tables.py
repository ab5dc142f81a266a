"""Table cells and labels for reports: formatted numbers, markdown tables, sampling labels."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


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
