"""The router's and the cascade's quality-latency curves from per-prompt measurements.

Input: a per-prompt table (dict of equal-length arrays, one entry per prompt, `table` below):
  split                 'validation' or 'held_out'
  time/<path>           seconds of one batch-1 request: target (the target alone), tier (the
                        target tier: the target with its best exact draft), student (its whole
                        answer), student_m (its first m tokens), student_prefill (its prompt),
                        cascade/<j> (the cascade at its j-th lenience)
  ll/<answer>, count/<answer>, agree/<answer>
                        the target's log-likelihood (nats, T = 1) of an answer's tokens, their
                        count, and how many equal the target's argmax given the answer before
                        them (greedy agreement); answers: target, tier, student, cascade/<j>
  accepted/cascade/<j>  the cascade's answer tokens that were the student's proposals kept at
                        positions 1..k of a round (the sampler's `accepted`; a round's last token
                        is not counted, even when it is the student's x_{k+1}: a lower bound)
  u/<signal>            the student's uncertainty (specjax.evaluation.routing.SIGNALS)

A routed request costs what the router ran (routing.SIGNAL_COST): the student's answer, plus
the tier's when deferred; for the _first_m signals the student's first m tokens plus the tier's
when deferred (a kept request is the student's whole answer); for the probe the student's
prefill plus the answering path's. Quality is measured against the target's own samples: the
tier's answers (exact speculation: the target's law), so the routing threshold -inf costs 0
nats. quality_cost = LL per token of the tier's answers - LL per token of the routed ones
(ratios of sums over prompts); relative_latency = the requests' summed seconds / the target
alone's on the same prompts.

Thresholds (the router's) and leniences (the cascade's) are chosen on the validation prompts
only: the fastest point whose validation quality cost is within the floor; every figure of a
chosen point is then the held-out prompts', with 95 % bootstrap intervals over those prompts.
"""

from __future__ import annotations

import math

import numpy as np

from specjax.evaluation.intervals import LEVEL, resample_index
from specjax.evaluation.routing import SIGNAL_COST

STATS = ('latency_s', 'relative_latency', 'kept_fraction', 'quality_cost', 'agreement')
SPLITS = ('validation', 'held_out')


def threshold_label(threshold: float):
    """A threshold for JSON: the number, or '-inf' / 'inf'."""
    return threshold if math.isfinite(threshold) else ('inf' if threshold > 0 else '-inf')


def routed(table: dict, signal: str, threshold: float) -> dict:
    """Per-prompt columns [n] of the router at `threshold`: latency (s), kept (0/1), ll, count,
    agree of the answer it returns."""
    if signal not in SIGNAL_COST:
        raise ValueError(f'routed: signal must be one of {tuple(SIGNAL_COST)}, got {signal!r}')
    kept = np.asarray(table[f'u/{signal}'], np.float64) <= threshold
    student, tier = table['time/student'], table['time/tier']
    latency = {
        'answer': student + np.where(kept, 0.0, tier),
        'first_m': np.where(kept, student, table['time/student_m'] + tier),
        'prompt': table['time/student_prefill'] + np.where(kept, student, tier),
    }[SIGNAL_COST[signal]]
    pick = lambda name: np.where(kept, table[f'{name}/student'], table[f'{name}/tier'])
    return dict(
        latency=latency, kept=kept.astype(np.float64), ll=pick('ll'), count=pick('count'),
        agree=pick('agree'),
    )  # fmt: skip


def path(table: dict, name: str, student_share=None) -> dict:
    """Per-prompt columns of one fixed path (`name`: target, tier, student, cascade/<j>); kept:
    `student_share` [n] (the share of the answer the student gave) or 0."""
    kept = np.zeros(len(table['split'])) if student_share is None else student_share
    cols = {c: np.asarray(table[f'{c}/{name}'], np.float64) for c in ('ll', 'count', 'agree')}
    return dict(latency=np.asarray(table[f'time/{name}'], np.float64), kept=kept, **cols)


def _stats(cols: dict, table: dict, idx: np.ndarray) -> dict:
    """{stat: float [resamples]} over the prompt draws idx [resamples, n]."""
    s = lambda a: np.asarray(a, np.float64)[idx].sum(axis=1)
    ref = s(table['ll/tier']) / np.maximum(s(table['count/tier']), 1)
    tokens = np.maximum(s(cols['count']), 1)
    return {
        'latency_s': s(cols['latency']) / idx.shape[1],
        'relative_latency': s(cols['latency']) / s(table['time/target']),
        'kept_fraction': s(cols['kept']) / idx.shape[1],
        'quality_cost': ref - s(cols['ll']) / tokens,
        'agreement': s(cols['agree']) / tokens,
    }


def point(cols: dict, table: dict, rows: np.ndarray, seed: int = 0, intervals: bool = True):
    """{stat: value, stat_interval: [lo, hi]} of the columns over prompts `rows` (percentile
    bootstrap over those prompts; intervals=False: values only)."""
    rows = np.asarray(rows, np.int64)
    if not len(rows):
        raise ValueError('point: no prompts in this split (config.route.prompts_per_domain)')
    sub = lambda d: {k: np.asarray(v)[rows] for k, v in d.items() if k != 'split'}
    idx = resample_index(len(rows), seed=seed) if intervals else np.arange(len(rows))[None]
    stats = _stats(sub(cols), sub(table), idx)
    out = {name: float(v[0]) for name, v in stats.items()}
    if intervals:
        tail = 100 * (1 - LEVEL) / 2
        for name, v in stats.items():
            out[f'{name}_interval'] = np.percentile(v, [tail, 100 - tail]).tolist()
    out['prompts'] = len(rows)
    return out


def split_rows(table: dict) -> dict[str, np.ndarray]:
    """{'validation' | 'held_out': row indices}; ValueError naming an unknown split value."""
    split = np.asarray(table['split'])
    unknown = sorted(set(split.tolist()) - set(SPLITS))
    if unknown:
        raise ValueError(f'table split values must be in {SPLITS}, got {unknown}')
    return {name: np.flatnonzero(split == name) for name in SPLITS}


def choose(candidates: list[dict], floor: float) -> int:
    """Index of the fastest candidate whose validation quality cost is within `floor` (the
    first, i.e. the most conservative, on ties); the first candidate when none is."""
    ok = [i for i, c in enumerate(candidates) if c['validation']['quality_cost'] <= floor]
    return min(ok, key=lambda i: (candidates[i]['validation']['latency_s'], i)) if ok else 0


def router_curve(table: dict, signal: str, floor: float, seed: int = 0) -> dict:
    """The router on `signal`: every threshold that changes a validation decision (-inf, each
    validation prompt's u, +inf), its validation and held-out points, and the threshold
    chosen on validation (held-out figures with intervals)."""
    rows = split_rows(table)
    u_val = np.asarray(table[f'u/{signal}'], np.float64)[rows['validation']]
    thresholds = [-math.inf, *sorted(set(u_val[np.isfinite(u_val)].tolist())), math.inf]
    curve = []
    for t in thresholds:
        cols = routed(table, signal, t)
        curve.append(
            dict(
                threshold=threshold_label(t),
                validation=point(cols, table, rows['validation'], intervals=False),
                held_out=point(cols, table, rows['held_out'], seed=seed),
            )
        )
    best = choose(curve, floor)
    return dict(signal=signal, cost=SIGNAL_COST[signal], chosen=best, curve=curve)


def cascade_curve(table: dict, leniences, floor: float, seed: int = 0) -> dict:
    """The cascade at each lenience: validation and held-out points (kept_fraction: the share
    of its answer's tokens that were the student's kept proposals, accepted/cascade/<j>) and the
    lenience chosen on validation."""
    rows, curve = split_rows(table), []
    for j, a in enumerate(leniences):
        name = f'cascade/{j}'
        share = np.asarray(table[f'accepted/{name}'], np.float64) / np.maximum(
            np.asarray(table[f'count/{name}'], np.float64), 1
        )
        cols = path(table, name, share)
        curve.append(
            dict(
                lenience=float(a),
                validation=point(cols, table, rows['validation'], intervals=False),
                held_out=point(cols, table, rows['held_out'], seed=seed),
            )
        )
    return dict(chosen=choose(curve, floor), curve=curve)


def references(table: dict, seed: int = 0) -> dict:
    """Held-out points of the fixed paths: the target alone, the tier and the student alone."""
    held = split_rows(table)['held_out']
    student = path(table, 'student', np.ones(len(table['split'])))
    return {
        'target': point(path(table, 'target'), table, held, seed=seed),
        'tier': point(path(table, 'tier'), table, held, seed=seed),
        'student': point(student, table, held, seed=seed),
    }


def best_router(routers: dict) -> str:
    """The signal whose chosen threshold is fastest on validation (ties: SIGNALS order)."""
    chosen = {s: r['curve'][r['chosen']]['validation']['latency_s'] for s, r in routers.items()}
    return min(chosen, key=lambda s: (chosen[s], list(routers).index(s)))


def summarize(table: dict, signals, leniences, floor: float, seed: int = 0) -> dict:
    """route.json's curves: {'references', 'routers' {signal: router_curve}, 'best_signal',
    'cascade' (cascade_curve, when leniences are given)}."""
    routers = {s: router_curve(table, s, floor, seed) for s in signals}
    out = {'references': references(table, seed), 'routers': routers}
    out['best_signal'] = best_router(routers) if routers else None
    if len(leniences):
        out['cascade'] = cascade_curve(table, leniences, floor, seed)
    return out
