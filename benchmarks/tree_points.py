"""The sampler grid of benchmarks.trees and its measurement: one point per (sampler, batch, T).

`measure(target, draft, tokens_NP, lengths_N, grid=..., ...)` builds every sampler of `grid`
(autoregressive, chains k, confidence-stopped chains, static trees under each sibling rule,
EAGLE-2 dynamic trees), decodes the N prompts at each batch size
b (b = 1: one call per prompt; b > 1: calls of b prompts, the last one filled by cycling), times
every call `repeats` times round-robin over all calls (CPU seconds of this process and wall
seconds of the same runs), and returns {'points': [...], 'calibration': {b: ...}, ...}.

Per point (`POINT_FIELDS`): tau = emitted / row rounds; alpha at depth d = rounds that accepted a
node at depth d / rounds that tested depth d; round_cpu_ms = CPU time / loop rounds (a batched
call's round serves all its rows); tokens_per_cpu_s = emitted / CPU seconds (sum over calls of
each call's minimum); speedups are ratios of tokens/s within one run. The prediction is the
optimal-k cost model (specjax.sampling.stats.round_cost) extended to trees: a round costs
(draft calls per round) c + v(N) target steps, N = the tokens verified besides the root, with c
and v(N) from specjax.sampling.calibrate at the same batch size; predicted_speedup = tau_round /
that cost, tau_round = emitted / (b * loop rounds) (tau at batch 1). It counts a tree's draft
level (several nodes in one call) as one draft step.

`best_shape(points)` picks per (batch, T) the sampler with the highest measured tokens/s and
the one with the highest predicted speedup.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

# Point fields that every measured point carries (the smoke test checks them).
POINT_FIELDS = (
    'name', 'kind', 'batch', 'temperature', 'nodes', 'depth', 'siblings', 'max_siblings', 'tau',
    'tau_round', 'alpha', 'alpha_per_depth', 'examined_per_depth', 'accepted_per_depth',
    'emitted', 'rounds', 'loop_rounds', 'draft_calls_per_round', 'cpu_s', 'wall_s', 'round_cpu_ms',
    'tokens_per_cpu_s', 'tokens_per_wall_s', 'speedup_vs_ar', 'wall_speedup_vs_ar',
    'speedup_vs_best_chain', 'predicted_cost_steps', 'predicted_speedup', 'first_call_s',
)  # fmt: skip
SIBLINGS = ('without_replacement', 'iid')


@dataclasses.dataclass(frozen=True)
class Grid:
    """The samplers measured: chain lengths k, stop_below thresholds h (on a chain of
    `stop_k`), static trees {name: paths}, sibling rules at T > 0 (at T = 0 only the first) and
    dynamic (depth, expand, nodes) budgets."""

    chains: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    stops: tuple[float, ...] = (0.3, 0.6)
    stop_k: int = 6
    trees: dict = dataclasses.field(default_factory=dict)
    siblings: tuple[str, ...] = SIBLINGS
    dynamic: tuple[tuple[int, int, int], ...] = ((4, 2, 8), (5, 3, 12), (6, 4, 20))


def samplers(tgd, dgd, grid: Grid, temperature: float, max_new: int,
             draft_vocab_ids=None) -> dict[str, dict]:  # fmt: skip
    """name -> {fn, kind, nodes, depth, siblings, drafts} for one temperature (fn takes
    (target_params, draft_params, ...) when drafts, else (target_params, ...)); a reduced draft
    proposes `draft_vocab_ids` (as in speculative_sample)."""
    from specjax.sampling import (
        DynamicTree,
        SamplingConfig,
        make_autoregressive_fn,
        make_speculative_fn,
        make_tree_speculative_fn,
    )

    s = SamplingConfig(temperature)
    common = dict(max_new_tokens=max_new, sampling=s)
    out = {'ar': dict(fn=make_autoregressive_fn(tgd, **common), kind='ar', nodes=0, depth=0,
                      siblings=None, max_siblings=0, drafts=False)}  # fmt: skip
    common['draft_vocab_ids'] = draft_vocab_ids
    for k in grid.chains:
        fn = make_speculative_fn(tgd, dgd, num_draft_tokens=k, **common)
        out[f'chain k={k}'] = dict(fn=fn, kind='chain', nodes=k, depth=k, siblings=None)
    for h in grid.stops:
        fn = make_speculative_fn(tgd, dgd, num_draft_tokens=grid.stop_k, stop_below=h, **common)
        out[f'chain k={grid.stop_k} stop<{h:g}'] = dict(
            fn=fn, kind='stopped', nodes=grid.stop_k, depth=grid.stop_k, siblings=None
        )
    rules = grid.siblings if temperature > 0 else grid.siblings[:1]
    for name, paths in grid.trees.items():
        for rule in rules:
            fn = make_tree_speculative_fn(tgd, dgd, tree=paths, siblings=rule, **common)
            label = f'tree {name}' + (f' ({_short(rule)})' if temperature > 0 else '')
            depth = max(len(p) for p in paths)
            out[label] = dict(fn=fn, kind='tree', nodes=len(paths), depth=depth, siblings=rule,
                              max_siblings=max_siblings(paths))  # fmt: skip
    for d, m, n in grid.dynamic:
        tree = DynamicTree(depth=d, expand=m, nodes=n)
        fn = make_tree_speculative_fn(tgd, dgd, tree=tree, **common)
        out[f'dynamic D={d} m={m} N={n}'] = dict(fn=fn, kind='dynamic', nodes=n, depth=d,
                                                 siblings=None, max_siblings=m)  # fmt: skip
    for spec in out.values():
        spec.setdefault('drafts', True)
        spec.setdefault('max_siblings', 1)
    return out


def max_siblings(paths) -> int:
    """The most children any node of the static tree `paths` has."""
    counts = {}
    for path in paths:
        counts[tuple(path[:-1])] = counts.get(tuple(path[:-1]), 0) + 1
    return max(counts.values())


def _short(rule: str) -> str:
    return {'without_replacement': 'w/o repl.', 'iid': 'iid'}.get(rule, rule)


def batches(tokens_NP, lengths_N, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The prompts in calls of `batch` rows; the last call is filled by cycling the prompts."""
    n = len(lengths_N)
    calls = []
    for start in range(0, n, batch):
        rows = np.arange(start, start + batch) % n
        calls.append((np.asarray(tokens_NP)[rows], np.asarray(lengths_N)[rows]))
    return calls


def interleaved_cpu_wall(calls: dict, repeats: int) -> dict:
    """name -> (cpu seconds [repeats], wall seconds [repeats]) of each call, round-robin over
    all calls each repeat (as specjax.sampling.calibrate.interleaved_times, both clocks at once:
    CPU time of this process barely moves under other jobs' load, wall time beside it)."""
    import jax

    times = {name: ([], []) for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            c0, w0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn())
            times[name][1].append(time.perf_counter() - w0)
            times[name][0].append(time.process_time() - c0)
    return times


def calibrations(target, draft, batch_sizes, widths, *, context_len, capacity, repeats,
                 draft_vocab_ids=None):  # fmt: skip
    """batch -> specjax.sampling.calibrate.Calibration (c and v(k) for k in widths; a reduced
    draft's draft_vocab_ids as the samplers take them)."""
    from specjax.sampling.calibrate import calibrate

    return {
        b: calibrate(target, draft, batch_size=b, ks=sorted(set(widths)), context_len=context_len,
                     capacity=capacity, iters=8, repeats=max(repeats, 3),
                     draft_vocab_ids=draft_vocab_ids)
        for b in batch_sizes
    }  # fmt: skip


def measure(target, draft, tokens_NP, lengths_N, *, grid: Grid, batch_sizes, temperatures,
            max_new: int, repeats: int, seed: int = 0, calibrate: bool = True,
            sibling_keys: int = 0, draft_vocab_ids=None, log=None) -> dict:  # fmt: skip
    """Every point of `grid` at every batch size and temperature (see the module docstring);
    `log` (e.g. print) reports each sampler's first call (compile and run) as it ends. With
    `sibling_keys` > 0 every static tree at T > 0 also decodes the prompts `sibling_keys` more
    times (untimed, at the largest batch, new keys) for `sibling_test`."""
    import jax

    from specjax.models import split

    (tgd, tp), (dgd, dp) = split(target), split(draft)
    key = jax.random.key(seed)
    grid_fns = {t: samplers(tgd, dgd, grid, t, max_new, draft_vocab_ids) for t in temperatures}
    calls, specs = {}, {}
    for t, named in grid_fns.items():
        for name, spec in named.items():
            params = (tp, dp) if spec['drafts'] else (tp,)
            for b in batch_sizes:
                specs[(name, t, b)] = spec
                for i, (toks, lens) in enumerate(batches(tokens_NP, lengths_N, b)):
                    args = (*params, toks, lens, jax.random.fold_in(key, i))
                    calls[(name, t, b, i)] = (lambda fn, a: lambda: fn(*a))(spec['fn'], args)
    # The calibration first: it is short, so a pair it refuses costs nothing of the timings.
    widths = [s['nodes'] for s in specs.values() if s['kind'] != 'ar']
    cal = {}
    if calibrate and widths:
        capacity = min(target.config.max_len, tokens_NP.shape[1] + max_new + max(widths) + 1)
        context = min(int(np.mean(lengths_N)) + max_new // 2, capacity - max(widths) - 1)
        cal = calibrations(target, draft, batch_sizes, widths, context_len=context,
                           capacity=capacity, repeats=repeats,
                           draft_vocab_ids=draft_vocab_ids)  # fmt: skip
    outputs, first = {}, {}
    compile_started = time.perf_counter()
    for name, fn in calls.items():  # first calls: compile (one per sampler and shape) and run
        w0 = time.perf_counter()
        outputs[name] = jax.device_get(jax.block_until_ready(fn()))
        first[name[:3]] = first.get(name[:3], 0.0) + time.perf_counter() - w0
        if log is not None and name[3] == 0:
            log(f'first call {name[0]} T={name[1]:g} b={name[2]}: {time.perf_counter() - w0:.1f} s')
    compile_s = time.perf_counter() - compile_started
    times = interleaved_cpu_wall(calls, repeats)
    resampled, skey = {}, jax.random.fold_in(key, 1_000_003)  # keys unlike the timed calls'
    for (name, t, b), spec in specs.items():
        if sibling_keys and spec['kind'] == 'tree' and t > 0 and b == max(batch_sizes):
            per = resampled.setdefault((name.rsplit(' (', 1)[0], t, b), {})
            per['max_siblings'] = spec['max_siblings']
            calls_b = batches(tokens_NP, lengths_N, b) * sibling_keys
            run = lambda j, toks, lens, fn=spec['fn']: fn(
                tp, dp, toks, lens, jax.random.fold_in(skey, j)
            )
            per[spec['siblings']] = [
                _counts(jax.device_get(run(j, *c).stats)) for j, c in enumerate(calls_b)
            ]
    points = []
    for (name, t, b), spec in specs.items():
        keys = [k for k in calls if k[:3] == (name, t, b)]
        stats = _sum_stats([outputs[k].stats for k in keys])
        cpu = sum(min(times[k][0]) for k in keys)
        wall = sum(min(times[k][1]) for k in keys)
        points.append(_point(name, spec, t, b, stats, cpu, wall, first[(name, t, b)], cal.get(b)))
    _relative_speedups(points)
    return dict(
        points=points,
        best=best_shape(points),
        siblings=sibling_comparison(points),
        siblings_resampled=sibling_test(resampled),
        calibration={str(b): c.to_dict() for b, c in cal.items()},
        compile_and_first_call_s=compile_s,
    )


def _sum_stats(stats_list) -> dict:
    keys = ('emitted', 'rounds', 'batch_rounds', 'draft_calls', 'accepted', 'examined')
    out = {k: sum(int(np.asarray(s.get(k, 0))) for s in stats_list) for k in keys}
    out['calls'] = len(stats_list)
    for k in ('examined_per_position', 'accepted_per_position'):
        out[k] = np.sum([np.atleast_1d(np.asarray(s.get(k, 0))) for s in stats_list], axis=0)
    return out


def _point(name, spec, t, b, s, cpu, wall, first_s, cal) -> dict:
    kind, nodes = spec['kind'], spec['nodes']
    rounds, loop_rounds, emitted = s['rounds'], s['batch_rounds'], s['emitted']
    examined = [int(x) for x in np.atleast_1d(s['examined_per_position'])]
    accepted = [int(x) for x in np.atleast_1d(s['accepted_per_position'])]
    tau_round = emitted / (b * loop_rounds)
    # Draft calls a round, without each row's prefill (row_draft_calls = steps * rounds + 1).
    draft_steps = (s['draft_calls'] - s['calls'] * b) / rounds if kind != 'ar' else 0
    cost = pred = None
    if cal is not None and kind != 'ar':
        from specjax.sampling import stats as st

        cost = draft_steps * cal.c + cal.v[nodes]
        pred = st.safe_ratio(tau_round, cost)
    elif kind == 'ar':
        cost, pred = 1.0, 1.0
    return dict(
        name=name, kind=kind, batch=b, temperature=t, nodes=nodes, depth=spec['depth'],
        siblings=spec['siblings'], max_siblings=spec['max_siblings'], tau=emitted / rounds,
        tau_round=tau_round,
        alpha=s['accepted'] / max(s['examined'], 1) if kind != 'ar' else None,
        alpha_per_depth=[a / e if e else None for a, e in zip(accepted, examined, strict=True)]
        if kind != 'ar' else [],
        examined_per_depth=examined if kind != 'ar' else [],
        accepted_per_depth=accepted if kind != 'ar' else [],
        emitted=emitted, rounds=rounds, loop_rounds=loop_rounds,
        draft_calls_per_round=draft_steps, cpu_s=cpu, wall_s=wall,
        round_cpu_ms=1e3 * cpu / loop_rounds, tokens_per_cpu_s=emitted / cpu,
        tokens_per_wall_s=emitted / wall, predicted_cost_steps=cost, predicted_speedup=pred,
        first_call_s=first_s,
    )  # fmt: skip


def _relative_speedups(points) -> None:
    """Adds speedup_vs_ar (CPU), wall_speedup_vs_ar and speedup_vs_best_chain (CPU) in place."""
    groups = {}
    for p in points:
        groups.setdefault((p['batch'], p['temperature']), []).append(p)
    for group in groups.values():
        ar = next(p for p in group if p['kind'] == 'ar')
        chains = [p['tokens_per_cpu_s'] for p in group if p['kind'] == 'chain']
        best_chain = max(chains) if chains else None
        for p in group:
            p['speedup_vs_ar'] = p['tokens_per_cpu_s'] / ar['tokens_per_cpu_s']
            p['wall_speedup_vs_ar'] = p['tokens_per_wall_s'] / ar['tokens_per_wall_s']
            p['speedup_vs_best_chain'] = p['tokens_per_cpu_s'] / best_chain if best_chain else None


def best_shape(points) -> dict:
    """Per 'b=B T=t': the speculative sampler with the highest measured tokens per CPU second
    ('measured') and the one with the highest predicted speedup ('predicted', None without a
    calibration), the measured tokens/s of both (and their ratio), and for chains alone the
    measured best k and the k that the cost model predicts from the chains' measured tau
    ('chain_k_measured', 'chain_k_predicted'). Pure: reads only the points."""
    out = {}
    groups = {}
    for p in points:
        if p['kind'] != 'ar':
            groups.setdefault((p['batch'], p['temperature']), []).append(p)
    for (b, t), group in sorted(groups.items()):
        measured = max(group, key=lambda p: p['tokens_per_cpu_s'])
        scored = [p for p in group if p['predicted_speedup'] is not None]
        predicted = max(scored, key=lambda p: p['predicted_speedup']) if scored else None
        chains = [p for p in group if p['kind'] == 'chain']
        scored_chains = [p for p in chains if p['predicted_speedup'] is not None]
        out[f'b={b} T={t:g}'] = dict(
            batch=b,
            temperature=t,
            measured=measured['name'],
            measured_tokens_per_cpu_s=measured['tokens_per_cpu_s'],
            measured_speedup_vs_ar=measured['speedup_vs_ar'],
            predicted=predicted['name'] if predicted else None,
            predicted_speedup=predicted['predicted_speedup'] if predicted else None,
            predicted_pick_tokens_per_cpu_s=predicted['tokens_per_cpu_s'] if predicted else None,
            predicted_pick_vs_measured_best=(
                predicted['tokens_per_cpu_s'] / measured['tokens_per_cpu_s'] if predicted else None
            ),
            chain_k_measured=(
                max(chains, key=lambda p: p['tokens_per_cpu_s'])['nodes'] if chains else None
            ),
            chain_k_predicted=(
                max(scored_chains, key=lambda p: (p['predicted_speedup'], -p['nodes']))['nodes']
                if scored_chains else None
            ),
        )  # fmt: skip
    return out


def sibling_comparison(points) -> list[dict]:
    """Per static tree, batch and T > 0: tau under 'without_replacement' and 'iid' siblings,
    their ratio, the tree's largest sibling count, and whether the target holds (w/o-repl tau
    >= iid tau; strictly higher where some node has >= 3 children: `target_met`)."""
    out = []
    trees = {}
    for p in points:
        if p['kind'] == 'tree' and p['temperature'] > 0:
            base = p['name'].rsplit(' (', 1)[0]
            trees.setdefault((base, p['batch'], p['temperature']), {})[p['siblings']] = p
    for (base, b, t), rules in trees.items():
        if set(SIBLINGS) - set(rules):
            continue
        wor, iid = rules['without_replacement'], rules['iid']
        out.append(dict(
            tree=base, batch=b, temperature=t, tau_without_replacement=wor['tau'],
            tau_iid=iid['tau'], ratio=wor['tau'] / iid['tau'], max_siblings=wor['max_siblings'],
            target_met=bool(wor['tau'] > iid['tau'] if wor['max_siblings'] >= 3
                            else wor['tau'] >= iid['tau']),
            alpha1_without_replacement=wor['alpha_per_depth'][0],
            alpha1_iid=iid['alpha_per_depth'][0],
        ))  # fmt: skip
    return out


def _counts(stats) -> tuple[int, int, int, int]:
    """(emitted, rounds, accepted at depth 1, examined at depth 1) of one call."""
    acc, exa = (
        np.asarray(stats['accepted_per_position']),
        np.asarray(stats['examined_per_position']),
    )
    return int(stats['emitted']), int(stats['rounds']), int(acc[0]), int(exa[0])


def sibling_test(resampled: dict) -> list[dict]:
    """{(tree, T, batch): {'max_siblings': n, rule: [(emitted, rounds, acc1, exa1) per call]}}
    -> per tree: pooled tau and alpha at depth 1 under both rules, the mean paired per-call tau
    difference (w/o replacement - iid, same prompts and key index) with its standard error and
    z = diff / se; target_met: z > -2 (not lower), and z > 2 (higher) where max_siblings >= 3."""
    out = []
    for (tree, t, b), per in resampled.items():
        wor, iid = (np.asarray(per[r], np.float64) for r in SIBLINGS)
        diff = wor[:, 0] / wor[:, 1] - iid[:, 0] / iid[:, 1]
        se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float('nan')
        z = float(diff.mean() / se) if se > 0 else 0.0
        out.append(dict(
            tree=tree, temperature=t, batch=b, calls=len(diff), max_siblings=per['max_siblings'],
            tau_without_replacement=wor[:, 0].sum() / wor[:, 1].sum(),
            tau_iid=iid[:, 0].sum() / iid[:, 1].sum(), diff=float(diff.mean()), se=se, z=z,
            alpha1_without_replacement=wor[:, 2].sum() / max(wor[:, 3].sum(), 1),
            alpha1_iid=iid[:, 2].sum() / max(iid[:, 3].sum(), 1),
            target_met=bool(z > 2 if per['max_siblings'] >= 3 else z > -2),
        ))  # fmt: skip
    return out
