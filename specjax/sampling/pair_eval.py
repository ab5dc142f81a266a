"""One evaluation path for a (target, draft) pair, shared by spec_eval and distillation's final
measured run: decode prompt batches, tabulate per-row statistics, predict the speedup. A point
carries stats.summarize's names (acceptance_rate, accepted_fraction, block_efficiency = tau, ...)
plus round_cost = k c + v(k) (NaN without a calibration), predicted_speedup = tau / round_cost
and predicted_speedup_from_alpha = expected_block_efficiency / round_cost, where alpha (the
alpha_sum / alpha_count columns) must be the decoding rule's own acceptance probability
(stats.alpha_per_position with that rule's `acceptance`).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from specjax.parallel.distributed import to_host
from specjax.sampling import stats as st


def decode_batches(fn, params, batches, rng, host_local: bool = False) -> list:
    """[(rows, output)]: fn(*params, tokens, lengths, fold_in(rng, i)) for the i-th of `batches`,
    an iterable of (rows [n], tokens [B, P], lengths [B]); rows index the real (unpadded) rows.

    The batches are host-global (every process holds them in full) and each process feeds its
    own rows (fn.host_rows); host_local=True: each process's batches are its own rows already
    (a data pipeline's host batches), the global batch their concatenation, and rows is None
    (every row of the global output). Outputs are global arrays (see row_table).
    """
    out = []
    for i, (rows, tokens, lengths) in enumerate(batches):
        if not host_local:
            tokens, lengths = fn.host_rows(tokens), fn.host_rows(lengths)
        key = jax.random.fold_in(rng, i)
        out.append((None if host_local else rows, fn(*params, tokens, lengths, key)))
    return out


def row_table(outputs, columns=None) -> dict[str, np.ndarray]:
    """The per-row statistics of decode_batches' outputs (padding rows dropped) in one table.

    columns(rows, lengths [n]) -> extra per-row columns (labels, alpha_sum / alpha_count of the
    decoding rule's alpha).
    Outputs may be global arrays over several processes: every process gets the whole table.
    """
    tables = []
    for rows, out in outputs:
        out = to_host(out)  # the whole global batch, on every process
        n = len(out.lengths) if rows is None else len(rows)
        stats = {k: v[:n] for k, v in out.stats.items() if k.startswith('row_')}
        lengths = out.lengths[:n]
        extra = columns(rows, lengths) if columns else {}
        tables.append(st.row_table(stats, lengths=lengths, emitted=lengths, **extra))
    return st.concat_tables(tables)


def point(table, k: int, cal=None) -> dict:
    """Summary of a row table at draft length k, with the predicted speedups (see module doc)."""
    summary = st.summarize(st.reduce_rows(table))
    cost = st.round_cost(k, cal.c, cal.v) if cal is not None else math.nan
    return dict(
        summary,
        round_cost=cost,
        predicted_speedup=st.safe_ratio(summary['block_efficiency'], cost),
        predicted_speedup_from_alpha=st.safe_ratio(
            summary.get('expected_block_efficiency', math.nan), cost
        ),
    )
