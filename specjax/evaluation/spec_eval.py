"""spec_eval mode: autoregressive vs speculative decoding of a target and draft, measured.

For every sampling setting of config.eval.samplings: the target decodes the prompts alone
(autoregressive), then with the draft for every k in config.eval.ks (or the setting's own ks).
Reported per point: the acceptance statistics of specjax.sampling.stats (overall and bucketed by
domain, prompt length and generated length), wall time per generated token (compiled ahead of
time, warm-up excluded), measured speedup = autoregressive time per token / speculative time per
token, predicted speedup = tau / (k c + v(k)) with c and v(k) measured here
(specjax.sampling.calibrate), their ratio, the optimal k, and peak memory. alpha is measured
from logits on the target's own autoregressive samples of the same prompts (the distribution
speculative decoding reproduces).

Entry point: `run(config, workdir)` (mode 'spec_eval'); writes <workdir>/spec_eval.json and
<workdir>/results.json, holding the workdir lock, and refuses (before loading anything) a workdir
whose results were written by another mode (e.g. a training workdir).
"""

from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np

from specjax import jsonio
from specjax import workdir as workdir_lib
from specjax.data import build_tokenizer
from specjax.evaluation import measure
from specjax.evaluation import tables as report
from specjax.evaluation.pairs import draft_vocab_ids, load_models
from specjax.evaluation.prompts import Prompts, make_prompts
from specjax.models import split
from specjax.parallel import is_main_process, make_mesh, to_host
from specjax.parallel.mesh import mesh_rules
from specjax.sampling import (
    Acceptance,
    SamplingConfig,
    as_acceptance,
    make_autoregressive_fn,
    make_speculative_fn,
    pair_eval,
)
from specjax.sampling import stats as st
from specjax.sampling.calibrate import calibrate

BUCKET_KEYS = {
    'domain': ('domain',),
    'prompt_len': ('prompt_len',),
    'gen_len': ('gen_len',),
    'all': ('domain', 'prompt_len', 'gen_len'),
}


def _check_ks(ks, where: str) -> tuple[int, ...]:
    if (
        not isinstance(ks, tuple | list)
        or not ks
        or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks)
    ):
        raise ValueError(f'{where} must be a non-empty tuple of positive ints, got {ks!r}')
    return tuple(int(k) for k in ks)


def _check_eval(ev) -> tuple[list[tuple[SamplingConfig, tuple[int, ...]]], tuple[int, ...]]:
    """([(sampling, its ks)], every k): an entry's optional 4th element replaces config.eval.ks
    for that setting (e.g. the k sweep at T = 0 and 1 only, one k elsewhere)."""
    for field in ('max_new_tokens', 'batch_size', 'prompts_per_domain'):
        if int(ev[field]) < 1:
            raise ValueError(f'config.eval.{field} must be >= 1, got {ev[field]!r}')
    ks = _check_ks(ev.ks, 'config.eval.ks')
    samplings = []
    if not isinstance(ev.samplings, tuple | list) or not all(
        isinstance(s, tuple | list) for s in ev.samplings
    ):
        raise ValueError(
            'config.eval.samplings must be a tuple of (temperature, top_k, top_p) tuples, got '
            f'{ev.samplings!r} (one setting needs a trailing comma: ((0.0, 0, 1.0),))'
        )
    for s in ev.samplings:
        if len(s) not in (3, 4):
            raise ValueError(
                f'config.eval.samplings entries are (temperature, top_k, top_p[, ks]), got {s!r}'
            )
        own = _check_ks(s[3], f'config.eval.samplings entry {s!r}: its ks') if len(s) > 3 else ks
        samplings.append((SamplingConfig(float(s[0]), int(s[1]), float(s[2])), own))
    if not samplings:
        raise ValueError('config.eval.samplings is empty')
    _acceptance(ev)
    return samplings, tuple(sorted(set().union(*(own for _, own in samplings))))


def model_max_lens(config) -> dict[str, tuple[int, str]]:
    """{'target'|'draft': (max_len, where it comes from)}, read from configs or checkpoint metadata
    (no weights loaded)."""
    if config.random_init:
        return {
            'target': (int(config.model.max_len), 'config.model.max_len'),
            'draft': (int(config.draft.max_len), 'config.draft.max_len'),
        }
    from specjax.checkpoint import Checkpoints

    out = {}
    for name, field, key in (
        ('target', 'target_workdir', 'model_config'),
        ('draft', 'draft_workdir', config.draft_config_key),
    ):
        if not config.get(field):
            raise ValueError(f'config.{field} is empty; set it or config.random_init=True')
        ckpts = Checkpoints(config[field], read_only=True)
        try:
            _, meta = ckpts.newest_readable(ckpts.metadata)  # as load_model: skip broken steps
        finally:
            ckpts.close()
        if key not in meta:
            raise ValueError(f'config.{field}={config[field]!r}: its checkpoint has no {key!r}')
        out[name] = (int(meta[key]['max_len']), f'the {name} checkpoint in config.{field}')
    return out


def check_lengths(ev, ks, max_lens: dict[str, tuple[int, str]]) -> None:
    """ValueError with the arithmetic if a KV cache would not fit a model's max_len."""
    need = int(ev.prompt_len_max) + int(ev.max_new_tokens) + max(ks) + 1
    for name, (max_len, where) in max_lens.items():
        if need > max_len:
            room = max_len - int(ev.prompt_len_max) - max(ks) - 1
            raise ValueError(
                f'config.eval.prompt_len_max ({ev.prompt_len_max}) + config.eval.max_new_tokens '
                f'({ev.max_new_tokens}) + max(config.eval.ks) ({max(ks)}) + 1 = {need} positions, '
                f'above the {name} max_len={max_len} ({where}); e.g. '
                f'--config.eval.max_new_tokens={max(room, 0)} or a smaller prompt_len_max / ks'
            )


def _acceptance(ev) -> Acceptance:
    """config.eval.acceptance (rule name) and its parameters as an Acceptance (checked)."""
    a = ev.get('acceptance', 'probabilistic')
    if isinstance(a, str):
        a = dict(rule=a, **dict(ev.get('acceptance_params', {})))
    return as_acceptance(a)


def _compile_and_run(sampler_fn, params, prompts: Prompts, batch_size: int, seed: int):
    """Compiles ahead of time and decodes every batch once (untimed: this is the warm-up).

    Returns (run_all, outputs, record): run_all() decodes all batches again with the same keys
    (same outputs), for timing.
    """
    batches = list(prompts.batches(batch_size))
    rng = jax.random.key(seed)
    _, tok0, len0 = batches[0]
    host = sampler_fn.host_rows  # each process compiles for, and feeds, its own rows
    compiled = measure.compile_sampler(sampler_fn, params, host(tok0), host(len0), rng)

    def run_all():
        return pair_eval.decode_batches(compiled, params, batches, rng)

    outputs = [(rows, to_host(out)) for rows, out in jax.block_until_ready(run_all())]
    generated = int(sum(o.lengths[: len(r)].sum() for r, o in outputs))
    record = {
        'rows': len(prompts),
        'generated_tokens': generated,
        'compile_s': compiled.compile_s,
        'memory': {'compiled': compiled.memory(), 'process': measure.process_memory()},
    }
    return run_all, outputs, record


def _time_points(run_alls: dict, records: dict, repeats: int) -> dict:
    """Times every point's full pass round-robin `repeats` times; fills wall/per-token fields.

    Returns name -> array [repeats] of seconds per generated token.
    """
    from specjax.sampling.calibrate import interleaved_times

    times = interleaved_times(run_alls, repeats=repeats, warmup=0)
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
        )
    return per_token


def _alpha_columns(
    target, draft, prompts: Prompts, outputs, sampling, batch_size: int, vocab_ids=None
):
    """Per-row alpha sums and counts [N] over the generated positions of `outputs`."""
    alpha_sum = np.zeros(len(prompts))
    alpha_count = np.zeros(len(prompts), np.int64)
    for (rows, tokens, lengths), (_, out) in zip(prompts.batches(batch_size), outputs):
        # Whole (padded) batches: one compile for every batch.
        alpha, mask = st.alpha_of_sequences(
            target, draft, tokens, lengths, out.tokens, out.lengths, sampling, vocab_ids
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


def _evaluate_sampling(
    models, prompts, sampling, ks, cal, ev, *, seed, eos_id, mesh, rules, draft_rules
):
    """Autoregressive and speculative (every k) decoding for one sampling setting.

    Compiles and decodes every point once, then times all points round-robin, so load drift on
    a shared machine hits them alike; measured speedup is the median over repeats of the
    per-repeat ratio. Returns (runs, buckets, optimal-k record).
    """
    target, draft, t_graphdef, d_graphdef, t_params, d_params, ids = models
    label = report.sampling_label(sampling)
    batch, max_new = int(ev.batch_size), int(ev.max_new_tokens)
    # Compiles are most of this mode's time: every setting with temperature > 0 (top-p or not)
    # shares one program per k and one autoregressive program (dynamic_sampling). Greedy keeps
    # its own lean programs: deciding greediness at run time costs ~10% per greedy token here.
    common = dict(
        max_new_tokens=max_new,
        sampling=sampling,
        eos_id=eos_id,
        mesh=mesh,
        rules=rules,
        dynamic_sampling=not sampling.greedy,
    )
    run_alls, outputs, records = {}, {}, {}
    ar_fn = make_autoregressive_fn(t_graphdef, **common)
    if ids is not None:  # a reduced-vocabulary draft (its workdir's draft_vocab.json)
        common['draft_vocab_ids'] = tuple(ids)
    run_alls['ar'], outputs['ar'], records['ar'] = _compile_and_run(
        ar_fn, [t_params], prompts, batch, seed
    )
    for k in ks:
        fn = make_speculative_fn(
            t_graphdef,
            d_graphdef,
            num_draft_tokens=k,
            acceptance=_acceptance(ev),
            draft_rules=draft_rules,
            **common,
        )
        run_alls[k], outputs[k], records[k] = _compile_and_run(
            fn, [t_params, d_params], prompts, batch, seed
        )
    per_token = _time_points(run_alls, records, int(ev.timing_repeats))

    alpha_cols = _alpha_columns(
        target, draft, prompts, outputs['ar'], sampling, batch, common.get('draft_vocab_ids')
    )
    alpha = st.safe_ratio(alpha_cols[0].sum(), alpha_cols[1].sum())
    tags = dict(sampling=sampling.to_dict(), sampling_label=label, acceptance=_acceptance(ev).label)
    runs = [dict(records['ar'], method='autoregressive', k=None, alpha=alpha, **tags)]
    buckets = {name: [] for name in BUCKET_KEYS}
    logging.info('%s autoregressive: %.3f ms/token', label, 1e3 * records['ar']['time_per_token_s'])
    for k in ks:
        table = _spec_table(prompts, outputs[k], alpha_cols, ev)
        summary = pair_eval.point(table, k, cal)
        cost, predicted = summary['round_cost'], summary['predicted_speedup']
        measured = float(np.median(per_token['ar'] / per_token[k]))
        # A batch runs until its slowest row is done (padding rows included: they cost time).
        tau_batch = st.safe_ratio(
            sum(float(np.sum(o.lengths)) for _, o in outputs[k]),
            batch * sum(int(o.stats['batch_rounds']) for _, o in outputs[k]),
        )
        runs.append(
            dict(
                records[k],
                **summary,
                **tags,
                method='speculative',
                k=k,
                measured_speedup=measured,
                speedup_ratio=measured / predicted,
                batch_block_efficiency=tau_batch,
                predicted_speedup_batch=tau_batch / cost,
                speedup_ratio_batch=measured / (tau_batch / cost),
            )
        )
        for name, keys in BUCKET_KEYS.items():
            for key, b in st.bucket_stats(table, keys).items():
                buckets[name].append(dict(zip(keys, key), sampling_label=label, k=k, **b))
        logging.info(
            '%s k=%d: acceptance %.3f tau %.2f speedup %.2f (predicted %.2f)',
            label,
            k,
            summary['acceptance_rate'],
            summary['block_efficiency'],
            measured,
            predicted,
        )
    spec = runs[1:]
    finite_alpha = alpha if np.isfinite(alpha) else 0.0
    optimal = {
        'alpha': alpha,
        'predicted_optimal_k': st.optimal_k(finite_alpha, cal.c, cal.v),
        'predicted_speedups': st.predicted_speedups(finite_alpha, cal.c, cal.v),
        'best_measured_k': max(spec, key=lambda r: r['measured_speedup'])['k'],
        'best_measured_speedup': max(r['measured_speedup'] for r in spec),
    }
    return runs, buckets, optimal


def run(config, workdir: str) -> dict:
    """The spec_eval mode: see the module docstring. Returns the spec_eval.json dict."""
    started = time.perf_counter()
    workdir = workdir_lib.resolve(workdir)
    ev = config.eval
    samplings, ks = _check_eval(ev)
    check_lengths(ev, ks, model_max_lens(config))
    with workdir_lib.hold(workdir, 'spec_eval'):
        for name in ('results.json', 'spec_eval.json'):
            workdir_lib.check_results_owner(workdir, 'spec_eval', name)
        return _run(config, workdir, ev, samplings, ks, started)


def _run(config, workdir, ev, samplings, ks, started) -> dict:
    tok = build_tokenizer(config.data)
    mesh = make_mesh(config.mesh)
    rules, draft_rules = mesh_rules(config.mesh)
    target, draft, model_info = load_models(config, tok, mesh)
    prompts = make_prompts(
        config.data,
        tok,
        per_domain=int(ev.prompts_per_domain),
        min_len=int(ev.prompt_len_min),
        max_len=int(ev.prompt_len_max),
        seed=config.seed,
    )
    width, max_new = prompts.tokens.shape[1], int(ev.max_new_tokens)
    eos_id = tok.eos_id if ev.stop_at_eos else None
    t_graphdef, t_params = split(target)
    d_graphdef, d_params = split(draft)
    ids = None if config.random_init else draft_vocab_ids(config.draft_workdir)

    cal = calibrate(
        target,
        draft,
        batch_size=int(ev.batch_size),
        ks=ks,
        context_len=width,
        capacity=width + max_new + max(ks) + 1,
        iters=int(ev.calibration_iters),
        repeats=int(ev.calibration_repeats),
        draft_vocab_ids=ids,
    )
    logging.info('calibration: c=%.3f v=%s', cal.c, {k: round(v, 2) for k, v in cal.v.items()})

    runs, buckets, optimal = [], {name: [] for name in BUCKET_KEYS}, {}
    models = (target, draft, t_graphdef, d_graphdef, t_params, d_params, ids)
    for s_idx, (sampling, sampling_ks) in enumerate(samplings):
        seed = config.seed * 1000 + s_idx
        point_runs, point_buckets, optimal[report.sampling_label(sampling)] = _evaluate_sampling(
            models,
            prompts,
            sampling,
            sampling_ks,
            cal,
            ev,
            seed=seed,
            eos_id=eos_id,
            mesh=mesh,
            rules=rules,
            draft_rules=draft_rules,
        )
        runs += point_runs
        for name, entries in point_buckets.items():
            buckets[name] += entries

    result = {
        'mode': 'spec_eval',
        'config': config.to_dict(),
        'config_hash': workdir_lib.config_hash(config),
        'models': model_info,
        'tokenizer': tok.identity(),
        'prompts': {
            'count': len(prompts),
            'width': width,
            'max_new_tokens': max_new,
            'batch_size': int(ev.batch_size),
            'per_domain': {
                d: int((prompts.domains == d).sum()) for d in sorted(set(prompts.domains))
            },
        },
        'calibration': cal.to_dict(),
        'runs': runs,
        'buckets': buckets,
        'optimal_k': optimal,
        'environment': measure.environment(),
        'memory': measure.process_memory(),
        'wall_s': time.perf_counter() - started,
    }
    if is_main_process():  # results and reports from process 0 only
        jsonio.write_json(os.fspath(workdir_lib.path(workdir) / 'spec_eval.json'), result)
        headline_json = jsonio.jsonable(headline(result))  # NaN -> null, as before
        workdir_lib.write_results(workdir, 'spec_eval', headline_json, config, keep_previous=False)
        print(table_markdown(result), flush=True)
    return result


def headline(result: dict) -> dict:
    """results.json: numbers only, keys without dots (for sweep summaries)."""
    out = {'c': result['calibration']['c'], 'v': result['calibration']['v']}
    for r in result['runs']:
        node = out.setdefault(report.key_safe(r['sampling_label']), {})
        if r['method'] == 'autoregressive':
            node['autoregressive'] = {
                'time_per_token_s': r['time_per_token_s'],
                'alpha': r['alpha'],
            }
            continue
        node[f'k{r["k"]}'] = {
            name: r[name]
            for name in (
                'acceptance_rate',
                'accepted_fraction',
                'block_efficiency',
                'alpha',
                'expected_block_efficiency',
                'time_per_token_s',
                'measured_speedup',
                'predicted_speedup',
                'speedup_ratio',
            )
        }
    for label, o in result['optimal_k'].items():
        out[report.key_safe(label)]['optimal_k'] = {
            'predicted': o['predicted_optimal_k'],
            'best_measured': o['best_measured_k'],
        }
    spec = [r for r in result['runs'] if r['method'] == 'speculative']
    if len(spec) == 1:  # one (k, sampling): the same keys at every sweep point (k_temperature)
        r, v = spec[0], result['calibration']['v']
        node = out[report.key_safe(r['sampling_label'])]
        out['point'] = dict(
            node[f'k{r["k"]}'],
            k=r['k'],
            temperature=r['sampling']['temperature'],
            v_k=v.get(r['k'], v.get(str(r['k']))),
            autoregressive_time_per_token_s=node['autoregressive']['time_per_token_s'],
        )
    return out


def table_markdown(result: dict) -> str:
    """The printed summary: one row per (sampling, method, k)."""
    headers = [
        'sampling',
        'k',
        'acc. rate',
        'alpha',
        'tau',
        'E[tau](alpha)',
        'tau batch',
        'ms/token',
        'speedup',
        'predicted',
        'ratio',
        'ratio (tau batch)',
        'compile s',
    ]
    rows = []
    for r in result['runs']:
        spec = r['method'] == 'speculative'
        rows.append(
            [
                r['sampling_label'],
                r['k'] if spec else 'AR',
                r.get('acceptance_rate'),
                r.get('alpha'),
                r.get('block_efficiency'),
                r.get('expected_block_efficiency'),
                r.get('batch_block_efficiency'),
                1e3 * r['time_per_token_s'],
                r.get('measured_speedup'),
                r.get('predicted_speedup'),
                r.get('speedup_ratio'),
                r.get('speedup_ratio_batch'),
                r['compile_s'],
            ]
        )
    cal = result['calibration']
    v = ', '.join(f'{k}: {x:.2f}' for k, x in cal['v'].items())
    lines = [
        report.markdown_table(headers, rows),
        '',
        f'c = {cal["c"]:.3f}; v(k) = {{{v}}} (batch {cal["batch_size"]})',
    ]
    for label, o in result['optimal_k'].items():
        lines.append(
            f'{label}: optimal k predicted {o["predicted_optimal_k"]} '
            f'(alpha {report.fmt(o["alpha"])}), best measured {o["best_measured_k"]}'
        )
    return '\n'.join(lines)
