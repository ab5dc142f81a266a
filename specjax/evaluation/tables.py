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
    text = f'{float(x):.{digits}g}'
    return str(round(float(x))) if 'e+' in text else text  # 3000.0 -> '3000', never '3e+03'


def fmt_interval(value, interval) -> str:
    """'0.412 [0.351, 0.470]': a value and its interval (just the value where there is none)."""
    if not interval or any(x is None for x in interval):
        return fmt(value)
    return f'{fmt(value)} [{fmt(interval[0])}, {fmt(interval[1])}]'


def fmt_count(value, num, den) -> str:
    """'0.667 (2/3)': a ratio with the counts it was computed from."""
    return f'{fmt(value)} ({fmt(num)}/{fmt(den)})'


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


def human_label(label: str) -> str:
    """A sampling label for readers: 'T=0' -> 'T = 0 (greedy)', 'T=1,top_k=0,top_p=1' ->
    'T = 1', 'T=0.7,top_k=40,top_p=0.9' -> 'T = 0.7, top-k 40, top-p 0.9' (defaults left out)."""
    fields = dict(part.split('=', 1) for part in label.split(',') if '=' in part)
    if set(fields) - {'T', 'top_k', 'top_p'} or 'T' not in fields:
        return label
    if float(fields['T']) == 0:
        return 'T = 0 (greedy)'
    words = [f'T = {fields["T"]}']
    if fields.get('top_k', '0') != '0':
        words.append(f'top-k {fields["top_k"]}')
    if float(fields.get('top_p', '1')) != 1:
        words.append(f'top-p {fields["top_p"]}')
    return ', '.join(words)


def key_safe(label: str) -> str:
    """A results.json key without dots (sweep summaries address nested keys with dots)."""
    return label.replace('.', 'p').replace('=', '').replace(',', '_')
