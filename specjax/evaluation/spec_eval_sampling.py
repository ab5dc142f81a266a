"""spec_eval's points for one sampling setting: autoregressive and speculative (every k) decoding,
compiled ahead of time, timed round-robin, alpha re-scored from the target's own samples.

alpha is the configured acceptance rule's per-position acceptance probability
(stats.alpha_per_position with config.eval.acceptance: sum min(p, q) only for `probabilistic`),
so E[tau], the predicted speedups and the optimal k all predict the rule that was measured. For a
lossy rule (lenient, typical) the rule's own output drifts from the target's, whose samples alpha
is scored on: there the prediction is an approximation.

`evaluate_sampling` returns the setting's runs (one autoregressive, one per k: acceptance
statistics, measured speedup, predicted speedup = tau / stats.round_cost(k, c, v) from the
calibration), its buckets (BUCKET_KEYS) and its optimal-k record; specjax.evaluation.spec_eval
runs it for every setting, and specjax.preflight.selfcheck on a fixed calibration.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from specjax.evaluation import intervals, measure
from specjax.evaluation.prompts import Prompts
from specjax.evaluation.tables import sampling_label
from specjax.parallel import to_host
from specjax.sampling import (
    Acceptance,
    as_acceptance,
    make_autoregressive_fn,
    make_speculative_fn,
    pair_eval,
    rescore,
)
from specjax.sampling import stats as st

# per-row count columns each speculative run keeps (prompt order), for paired intervals
PER_ROW = (
    'accepted',
    'examined',
    'emitted',
    'rounds',
    'alpha_sum',
    'alpha_count',
    'accepted_per_position',
    'examined_per_position',
)
BUCKET_KEYS = {
    'domain': ('domain',),
    'prompt_len': ('prompt_len',),
    'gen_len': ('gen_len',),
    'all': ('domain', 'prompt_len', 'gen_len'),
}


def acceptance(ev) -> Acceptance:
    """config.eval.acceptance (rule name) and its parameters as an Acceptance (checked)."""
    a = ev.get('acceptance', 'probabilistic')
    if isinstance(a, str):
        a = dict(rule=a, **dict(ev.get('acceptance_params', {})))
    return as_acceptance(a)


def _compile_and_run(points: dict, prompts: Prompts, batch_size: int, seed: int):
    """Compiles every point's sampler ahead of time, side by side (measure.compile_samplers),
    and decodes every batch once with each (untimed: this is the warm-up).

    points: name -> (sampler_fn, params). Returns (run_alls, outputs, records), each keyed by
    point name: run_alls[name]() decodes all batches again with the same keys (same outputs),
    for timing.
    """
    batches = list(prompts.batches(batch_size))
    rng = jax.random.key(seed)
    _, tok0, len0 = batches[0]
    # each process compiles for, and feeds, its own rows
    jobs = [
        (fn, params, fn.host_rows(tok0), fn.host_rows(len0), rng) for fn, params in points.values()
    ]
    run_alls, outputs, records = {}, {}, {}
    for name, compiled, (_, params) in zip(points, measure.compile_samplers(jobs), points.values()):

        def run_all(compiled=compiled, params=params):
            return pair_eval.decode_batches(compiled, params, batches, rng)

        t0 = time.perf_counter()
        out = jax.block_until_ready(run_all())
        warmup_s = time.perf_counter() - t0
        outputs[name] = [(rows, to_host(o)) for rows, o in out]
        generated = int(sum(o.lengths[: len(r)].sum() for r, o in outputs[name]))
        run_alls[name] = run_all
        records[name] = {
            'rows': len(prompts),
            'generated_tokens': generated,
            'compile_s': compiled.compile_s,
            'warmup_s': warmup_s,  # the untimed first pass: the timing's probe
            'memory': {'compiled': compiled.memory(), 'process': measure.process_memory()},
        }
    return run_alls, outputs, records


def _time_points(run_alls: dict, records: dict, repeats: int, floor_s: float) -> dict:
    """Times every point's full pass round-robin `repeats` times, each timed region repeating
    the pass until it lasts `floor_s` (measure.floored_times, each point's warm-up pass as its
    probe); fills wall/per-token fields and the point's timing summary
    (intervals.timing_summary).

    Returns name -> array [repeats] of seconds per generated token.
    """
    probes = {name: rec['warmup_s'] for name, rec in records.items()}
    times, passes = measure.floored_times(run_alls, repeats, floor_s, probes)
    per_token = {}
    for name, t in times.items():
        rec = records[name]
        t = np.asarray(t)
        per_token[name] = t / max(rec['generated_tokens'], 1)
        wall = float(np.median(t))
        rec.update(
            wall_s=wall,
            wall_s_repeats=t.tolist(),
            time_per_token_s=float(np.median(per_token[name])),
            tokens_per_s=rec['generated_tokens'] / wall if wall > 0 else float('nan'),
            timing=dict(intervals.timing_summary(t), passes=passes[name], floor_s=floor_s),
        )
    return per_token


def _alpha_columns(
    target, draft, prompts: Prompts, outputs, sampling, batch_size: int, acc, vocab_ids=None
):
    """Per-row sums and counts [N] of rule `acc`'s alpha over the generated positions of
    `outputs`."""
    alpha_sum = np.zeros(len(prompts))
    alpha_count = np.zeros(len(prompts), np.int64)
    for (rows, tokens, lengths), (_, out) in zip(prompts.batches(batch_size), outputs):
        # Whole (padded) batches: one compile for every batch.
        alpha, mask = rescore.alpha_of_sequences(
            target, draft, tokens, lengths, out.tokens, out.lengths, sampling, vocab_ids, acc
        )
        n = len(rows)
        alpha_sum[rows], alpha_count[rows] = alpha[:n].sum(1), mask[:n].sum(1)
    return alpha_sum, alpha_count


def _spec_table(prompts: Prompts, outputs, alpha_cols, ev) -> dict:
    def columns(rows, lengths):
        return dict(
            domain=prompts.domains[rows],
            prompt_len=st.length_bucket(prompts.lengths[rows], ev.prompt_len_edges),
            gen_len=st.length_bucket(lengths, ev.gen_len_edges),
            alpha_sum=alpha_cols[0][rows],
            alpha_count=alpha_cols[1][rows],
        )

    return pair_eval.row_table(outputs, columns)


def dynamic_sampling(sampling, ev) -> bool:
    """Whether `sampling` runs as the shared T > 0 program (dynamic_sampling): every sampled
    setting, and greedy too under ev.dynamic_greedy (serve follows spec_eval to share them)."""
    return not sampling.greedy or bool(ev.get('dynamic_greedy', False))


def evaluate_sampling(
    models, prompts, sampling, ks, cal, ev, *, seed, eos_id, mesh, rules, draft_rules
):
    """Autoregressive and speculative (every k) decoding for one sampling setting.

    Compiles every point (side by side) and decodes with each once, then times all points
    round-robin, so load drift on a shared machine hits them alike; measured speedup is the
    median over repeats of the per-repeat ratio. Returns (runs, buckets, optimal-k record).
    """
    target, draft, t_graphdef, d_graphdef, t_params, d_params, ids = models
    label = sampling_label(sampling)
    batch = int(ev.batch_size)
    # Compiles are most of this mode's time: every setting with temperature > 0 (top-p or not)
    # shares one program per k and one autoregressive program (dynamic_sampling). Greedy keeps
    # its own lean programs (deciding greediness at run time costs ~10% per greedy token here)
    # unless ev.dynamic_greedy: then greedy joins them (compile-bound smoke runs).
    common = dict(
        max_new_tokens=int(ev.max_new_tokens),
        sampling=sampling,
        eos_id=eos_id,
        mesh=mesh,
        rules=rules,
        dynamic_sampling=dynamic_sampling(sampling, ev),
    )
    points = {'ar': (make_autoregressive_fn(t_graphdef, **common), [t_params])}
    if ids is not None:  # a reduced-vocabulary draft (its workdir's draft_vocab.json)
        common['draft_vocab_ids'] = tuple(ids)
    for k in ks:
        fn = make_speculative_fn(
            t_graphdef,
            d_graphdef,
            num_draft_tokens=k,
            acceptance=acceptance(ev),
            draft_rules=draft_rules,
            **common,
        )
        points[k] = (fn, [t_params, d_params])
    run_alls, outputs, records = _compile_and_run(points, prompts, batch, seed)
    floor_s = float(ev.get('timing_floor_s', 0.0))
    per_token = _time_points(run_alls, records, int(ev.timing_repeats), floor_s)

    vocab_ids = common.get('draft_vocab_ids')
    alpha_cols = _alpha_columns(
        target, draft, prompts, outputs['ar'], sampling, batch, acceptance(ev), vocab_ids
    )
    alpha = st.safe_ratio(alpha_cols[0].sum(), alpha_cols[1].sum())
    tags = dict(sampling=sampling.to_dict(), sampling_label=label, acceptance=acceptance(ev).label)
    ar_cols = dict(alpha_sum=alpha_cols[0], alpha_count=alpha_cols[1])
    runs = [
        dict(
            records['ar'],
            method='autoregressive',
            k=None,
            alpha=alpha,
            alpha_interval=intervals.ratio_interval(ar_cols, 'alpha', seed=seed),
            per_row={name: col.tolist() for name, col in ar_cols.items()},
            **tags,
        )
    ]
    buckets = {name: [] for name in BUCKET_KEYS}
    logging.info('%s autoregressive: %.3f ms/token', label, 1e3 * records['ar']['time_per_token_s'])
    for k in ks:
        table = _spec_table(prompts, outputs[k], alpha_cols, ev)
        speedup = intervals.ratio_summary(per_token['ar'], per_token[k])
        runs.append(_spec_run(records[k], table, k, cal, speedup, outputs[k], batch, tags))
        runs[-1]['intervals'] = intervals.table_intervals(table, seed=seed)
        runs[-1]['per_row'] = {name: np.asarray(table[name]).tolist() for name in PER_ROW}
        for name, keys in BUCKET_KEYS.items():
            for key, b in st.bucket_stats(table, keys).items():
                buckets[name].append(dict(zip(keys, key), sampling_label=label, k=k, **b))
        logging.info(
            '%s k=%d: acceptance %.3f tau %.2f speedup %.2f (predicted %.2f)',
            label,
            k,
            runs[-1]['acceptance_rate'],
            runs[-1]['block_efficiency'],
            speedup['value'],
            runs[-1]['predicted_speedup'],
        )
    return runs, buckets, dict(_optimal(alpha, cal, runs[1:]), acceptance=tags['acceptance'])


def _spec_run(record, table, k, cal, speedup, outputs, batch, tags) -> dict:
    """One speculative point's run: its record, the row table's summary at k (pair_eval.point),
    the measured speedup (intervals.ratio_summary: median, range over repeats, verdict) and the
    predicted speedups from tau and from the batch's tau."""
    measured = speedup['value']
    summary = pair_eval.point(table, k, cal)
    # A batch runs until its slowest row is done (padding rows included: they cost time).
    tau_batch = st.safe_ratio(
        sum(float(np.sum(o.lengths)) for _, o in outputs),
        batch * sum(int(o.stats['batch_rounds']) for _, o in outputs),
    )
    predicted_batch = st.predicted_speedup(tau_batch, k, cal.c, cal.v)
    return dict(
        record,
        **summary,
        **tags,
        method='speculative',
        k=k,
        measured_speedup=measured,
        speedup=speedup,
        speedup_ratio=measured / summary['predicted_speedup'],
        batch_block_efficiency=tau_batch,
        predicted_speedup_batch=predicted_batch,
        speedup_ratio_batch=measured / predicted_batch,
    )


def _optimal(alpha, cal, spec: list[dict]) -> dict:
    """The setting's optimal-k record: predicted from the rule's alpha and the calibration, and
    measured."""
    finite_alpha = alpha if np.isfinite(alpha) else 0.0
    return {
        'alpha': alpha,
        'predicted_optimal_k': st.optimal_k(finite_alpha, cal.c, cal.v),
        'predicted_speedups': st.predicted_speedups(finite_alpha, cal.c, cal.v),
        'best_measured_k': max(spec, key=lambda r: r['measured_speedup'])['k'],
        'best_measured_speedup': max(r['measured_speedup'] for r in spec),
    }
