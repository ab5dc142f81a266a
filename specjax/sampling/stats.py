"""Acceptance statistics of speculative decoding, under the names of docs/design.md ("Quantities").

Counts come from the sampler's `stats` (totals, or per-row `row_*` fields); everything here
reduces counts first and divides last, so buckets and batches combine exactly:

  acceptance_rate          accepted / examined (estimates the per-token acceptance alpha)
  accepted_fraction        accepted / drafted (what vLLM calls acceptance rate)
  acceptance_per_position  conditional: accepted at i / examined at i;
                           unconditional: accepted at i / rounds
  block_efficiency (tau)   tokens emitted per target call excluding prefill, over active rounds
  alpha                    the acceptance rule's per-position acceptance probability from logits
                           after the sampling transform (rule_distribution.acceptance_probability:
                           sum_v min(p_v, q_v) for probabilistic, p(argmax q) for argmax_draft,
                           ...); every prediction below takes the alpha of the rule it predicts
  expected_block_efficiency  Leviathan: (1 - alpha^(k+1)) / (1 - alpha)
  expected_block_efficiency_by_position  the same with an alpha per draft position:
                           1 + sum_{i<=k} prod_{j<=i} alpha_j
  predicted_speedup        tau / (k c + v(k))

Zero denominators give NaN (JSON writers turn it into null).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Count fields (totals) and the per-row field each reduces from.
COUNT_FIELDS = (
    'drafted',
    'examined',
    'accepted',
    'rounds',
    'target_calls',
    'draft_calls',
    'accepted_per_position',
    'examined_per_position',
)
# Extra per-row columns that sum like counts when present in a row table.
EXTRA_SUM_FIELDS = ('emitted', 'generated', 'alpha_sum', 'alpha_count', 'rows')


def safe_ratio(num, den):
    """num / den elementwise as float64, NaN where den <= 0; a float for scalars."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    with np.errstate(divide='ignore', invalid='ignore'):
        out = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    return float(out) if out.ndim == 0 else out


def acceptance_rate(stats: Mapping) -> float:
    """accepted / examined: the empirical estimate of alpha."""
    return safe_ratio(stats['accepted'], stats['examined'])


def accepted_fraction(stats: Mapping) -> float:
    """accepted / drafted (vLLM's 'acceptance rate'); lower than acceptance_rate for k > 1."""
    return safe_ratio(stats['accepted'], stats['drafted'])


def acceptance_per_position(stats: Mapping) -> dict[str, np.ndarray]:
    """{'conditional': [k] accepted at i / examined at i, 'unconditional': [k] per round}."""
    acc = np.asarray(stats['accepted_per_position'], np.float64)
    return {
        'conditional': safe_ratio(acc, stats['examined_per_position']),
        'unconditional': safe_ratio(acc, np.full_like(acc, float(stats['rounds']))),
    }


def emitted_tokens(stats: Mapping) -> float:
    """Tokens emitted by verification rounds: `emitted` if counted, else accepted + one per round.

    accepted + rounds counts the replacement/bonus token of every round, including a final round
    cut short by eos or max_new_tokens; a row table from `row_table` carries the exact count.
    """
    if 'emitted' in stats:
        return float(stats['emitted'])
    return float(stats['accepted']) + float(stats['rounds'])


def block_efficiency(stats: Mapping) -> float:
    """tau: tokens emitted per target call excluding prefill = emitted / active rounds."""
    return safe_ratio(emitted_tokens(stats), stats['rounds'])


def batch_block_efficiency(stats: Mapping, batch_size: int) -> float:
    """Tokens per row per batched round: emitted / (B * batch_rounds).

    A batch runs until its slowest row is done, so at B > 1 this (not tau) is what the batch's
    wall time follows; it equals tau when all rows need the same number of rounds.
    """
    return safe_ratio(emitted_tokens(stats), batch_size * float(stats['batch_rounds']))


def expected_block_efficiency(alpha, k):
    """Leviathan et al.'s E[tau] = (1 - alpha^(k+1)) / (1 - alpha); k + 1 at alpha = 1."""
    alpha = np.asarray(alpha, np.float64)
    k = np.asarray(k, np.float64)
    if np.any((alpha < 0) | (alpha > 1)) or np.any(k < 0):
        raise ValueError(f'need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}')
    near_one = np.abs(1.0 - alpha) < 1e-9
    safe = np.where(near_one, 0.5, alpha)
    out = np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))
    return float(out) if out.ndim == 0 else out


def expected_block_efficiency_by_position(alphas, k: int) -> float:
    """E[tau] of a k-token chain whose draft position i is accepted with probability alphas[i-1]
    given that the positions before it were: 1 + sum_{i<=k} prod_{j<=i} alpha_j (a round emits
    its accepted prefix, whose expected length is the block's of
    specjax.distill.divergences.expected_accepted_length, and one more token). Positions past
    len(alphas) take the last alpha; with every alpha equal it is expected_block_efficiency."""
    a = np.asarray(alphas, np.float64).reshape(-1)
    if a.size == 0 or np.any((a < 0) | (a > 1)) or int(k) < 0:
        raise ValueError(f'need 1 or more alphas in [0, 1] and k >= 0, got {a.tolist()}, k={k}')
    a = np.concatenate([a, np.full(max(int(k) - a.size, 0), a[-1])])[: int(k)]
    return float(1.0 + np.cumprod(a).sum())


def round_cost(k: int, c: float, v: Mapping[int, float] | float) -> float:
    """k c + v(k): one round's cost in target steps (k draft steps and one (k+1)-token
    verification); v is a mapping k -> v(k) or a number. The one round-cost model of specjax."""
    vk = v[k] if isinstance(v, Mapping) else v
    return k * float(c) + float(vk)


def predicted_speedup(tau, k: int, c: float, v: Mapping[int, float] | float) -> float:
    """tau / round_cost(k, c, v): tokens per round over the round's cost in target steps."""
    return safe_ratio(tau, round_cost(k, c, v))


def predicted_speedups(alpha: float, c: float, v: Mapping[int, float]) -> dict[int, float]:
    """k -> E[tau](alpha, k) / (k c + v(k)) for every k in v."""
    return {
        int(k): predicted_speedup(expected_block_efficiency(alpha, k), int(k), c, v)
        for k in sorted(v)
    }


def alpha_for_tau(tau: float, k: int) -> float | None:
    """The alpha at which E[tau](alpha, k) equals `tau` (bisection; E[tau] increases with alpha):
    0.0 when tau <= 1 (alpha = 0 already gives it), None when tau > k + 1 (not even alpha = 1)."""
    if tau <= 1.0:
        return 0.0
    if tau > k + 1.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if float(expected_block_efficiency(mid, k)) < tau else (lo, mid)
    return hi


def required_alpha(k: int, c: float, v_k: float, speedup: float = 1.0) -> float | None:
    """The alpha at which E[tau](alpha, k) / (k c + v(k)) equals `speedup`: 0.0 when even
    alpha = 0 reaches it, None when even alpha = 1 (tau = k + 1) does not."""
    return alpha_for_tau(speedup * round_cost(k, c, v_k), k)


def optimal_k(alpha: float, c: float, v: Mapping[int, float]) -> int:
    """The k in v maximising the predicted speedup for acceptance alpha, cost ratio c and v(k).

    Ties go to the smaller k.
    """
    if not v:
        raise ValueError('optimal_k: v must map at least one k to v(k)')
    speedups = predicted_speedups(alpha, c, v)
    return max(speedups, key=lambda k: (speedups[k], -k))


# ---------------------------------------------------------------- alpha from logits


def alpha_per_position(target_logits, draft_logits, sampling, acceptance='probabilistic'):
    """Per-position alpha [...]: the probability that rule `acceptance` keeps a proposal
    (rule_distribution.acceptance_probability of the transformed float32 distributions; for the
    default `probabilistic` sum_v min(p_v, q_v)).

    Logits [..., V]. At temperature 0 every rule is greedy verification: argmax agreement (1.0
    or 0.0). `sampling`: a SamplingConfig or its traced form (`SamplingConfig.traced`: one
    compile for every setting). `acceptance`: a rule name, dict or Acceptance (static).
    """
    from specjax.sampling.acceptance import as_acceptance
    from specjax.sampling.rule_distribution import acceptance_probability
    from specjax.sampling.transforms import branch, is_greedy, transform_logits

    if target_logits.shape != draft_logits.shape:
        raise ValueError(
            f'alpha: target logits {target_logits.shape} and draft logits '
            f'{draft_logits.shape} differ in shape (vocab mismatch?)'
        )
    acc = as_acceptance(acceptance)
    t32 = jnp.asarray(target_logits, jnp.float32)
    d32 = jnp.asarray(draft_logits, jnp.float32)
    agree = lambda t, d: (jnp.argmax(t, -1) == jnp.argmax(d, -1)).astype(jnp.float32)
    kept = lambda t, d: acceptance_probability(
        transform_logits(t, sampling), transform_logits(d, sampling), acc, xp=jnp
    )
    return branch(is_greedy(sampling), agree, kept, t32, d32)


def alpha_from_logits(target_logits, draft_logits, sampling, mask=None, acceptance='probabilistic'):
    """Mean alpha of rule `acceptance` over positions (where mask [...] is true): float32."""
    a = alpha_per_position(target_logits, draft_logits, sampling, acceptance)
    if mask is None:
        return jnp.mean(a)
    m = jnp.asarray(mask, jnp.float32)
    return jnp.sum(a * m) / jnp.maximum(jnp.sum(m), 1.0)


# ---------------------------------------------------------------- row tables and buckets


def row_table(stats: Mapping, lengths=None, emitted=None, **labels) -> dict[str, np.ndarray]:
    """Per-row columns from a sampler's stats: counts (row_X -> X), plus labels.

    lengths [B]: generated tokens per row (column 'generated'); emitted [B]: tokens emitted by
    verification rounds (column 'emitted', for exact block efficiency; default: the sampler's
    row_emitted when present). labels: name -> a scalar (broadcast) or a [B] array, e.g.
    temperature=1.0, domain=['code', 'prose', ...].
    """
    cols = {}
    for name in COUNT_FIELDS:
        key = f'row_{name}'
        if key not in stats:
            raise ValueError(f'row_table: stats has no per-row field {key!r}')
        cols[name] = np.asarray(jax.device_get(stats[key]))
    batch = cols['drafted'].shape[0]
    cols['rows'] = np.ones((batch,), np.int64)
    if lengths is not None:
        cols['generated'] = _column(lengths, batch, 'lengths')
    if emitted is None and 'row_emitted' in stats:
        emitted = stats['row_emitted']
    if emitted is not None:
        cols['emitted'] = _column(emitted, batch, 'emitted')
    for name, value in labels.items():
        cols[name] = _column(value, batch, name)
    return cols


def _column(value, batch: int, name: str) -> np.ndarray:
    arr = np.asarray(jax.device_get(value))
    if arr.ndim == 0:
        return np.full((batch,), arr.item(), dtype=object if arr.dtype.kind in 'USO' else arr.dtype)
    if arr.shape[0] != batch:
        raise ValueError(f'row_table: column {name!r} has {arr.shape[0]} rows, expected {batch}')
    return arr


def concat_tables(tables: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stacks row tables with the same columns (and the same k) along rows."""
    if not tables:
        raise ValueError('concat_tables: no tables')
    keys = set(tables[0])
    for t in tables[1:]:
        if set(t) != keys:
            raise ValueError(f'concat_tables: columns differ: {sorted(keys ^ set(t))}')
    return {key: np.concatenate([np.asarray(t[key]) for t in tables], axis=0) for key in tables[0]}


def reduce_rows(table: Mapping[str, np.ndarray], index=None) -> dict:
    """Sums the count columns over rows (all, or `index`) into a totals dict."""
    out = {}
    for name in COUNT_FIELDS + EXTRA_SUM_FIELDS:
        if name in table:
            col = np.asarray(table[name])
            col = col if index is None else col[index]
            total = col.sum(axis=0)
            out[name] = total.tolist() if np.ndim(total) else total.item()
    return out


def summarize(totals: Mapping) -> dict:
    """Totals -> the totals plus every derived quantity (JSON-friendly: floats and lists)."""
    out = {k: totals[k] for k in totals}
    out['acceptance_rate'] = acceptance_rate(totals)
    out['accepted_fraction'] = accepted_fraction(totals)
    per_pos = acceptance_per_position(totals)
    out['acceptance_per_position_conditional'] = np.asarray(per_pos['conditional']).tolist()
    out['acceptance_per_position_unconditional'] = np.asarray(per_pos['unconditional']).tolist()
    out['block_efficiency'] = block_efficiency(totals)
    if 'alpha_sum' in totals:
        out['alpha'] = safe_ratio(totals['alpha_sum'], totals['alpha_count'])
        k = len(per_pos['conditional'])
        alpha = out['alpha']
        out['expected_block_efficiency'] = (
            expected_block_efficiency(alpha, k) if np.isfinite(alpha) else float('nan')
        )
    return out


def length_bucket(values, edges: Sequence[int]) -> np.ndarray:
    """Labels '[lo,hi)' for values [N] by sorted bucket edges ('<e0' and '>=eN' at the ends)."""
    edges = list(edges)
    if edges != sorted(edges):
        raise ValueError(f'length_bucket: edges must be sorted, got {edges}')
    values = np.asarray(values)
    labels = [f'<{edges[0]}'] + [f'[{a},{b})' for a, b in zip(edges[:-1], edges[1:])]
    labels.append(f'>={edges[-1]}')
    idx = np.searchsorted(np.asarray(edges), values, side='right')
    return np.asarray([labels[i] for i in idx], dtype=object)


def bucket_stats(table: Mapping[str, np.ndarray], keys: Sequence[str]) -> dict[tuple, dict]:
    """Groups rows by the values of columns `keys` and summarizes each group.

    Returns {(value of keys[0], value of keys[1], ...): summarize(sums over the group)}, in
    sorted key order; keys=() gives one group {(): ...} over all rows.
    """
    for key in keys:
        if key not in table:
            raise ValueError(f'bucket_stats: no column {key!r} (have {sorted(table)})')
    n = np.asarray(table['drafted']).shape[0]
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        label = tuple(_plain(np.asarray(table[key])[i]) for key in keys)
        groups.setdefault(label, []).append(i)
    return {
        label: summarize(reduce_rows(table, np.asarray(groups[label])))
        for label in sorted(groups, key=lambda t: tuple(str(x) for x in t))
    }


def _plain(x):
    return x.item() if hasattr(x, 'item') else x


def sampler_stats(state, row_drafted_B, row_draft_calls_B, flags: dict) -> dict:
    """A chain or tree sampler's per-row counts from its loop state and their totals (sums over
    rows), named as in `SampleOutput`; `flags`: the state's non-finite flags (guards)."""
    rounds = state.row_rounds
    rows = dict(
        row_examined_per_position=state.row_examined_per_position,
        row_accepted_per_position=state.row_accepted_per_position,
        row_examined=state.row_examined_per_position.sum(-1),
        row_accepted=state.row_accepted_per_position.sum(-1),
        row_drafted=row_drafted_B,
        row_emitted=state.emitted,
        row_rounds=rounds,
        row_target_calls=rounds + 1,
        row_draft_calls=row_draft_calls_B,
    )
    totals = {name[4:]: value.sum(0) for name, value in rows.items()}
    return {**totals, **rows, 'batch_rounds': state.round, **flags}
