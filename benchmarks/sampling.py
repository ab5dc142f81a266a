"""Sampling benchmark (not a test): loop overhead, v(k), and measured vs predicted speedup.

  python -m benchmarks.sampling [--out=PATH] [--batch_sizes=1,8] [--ks=4]
      [--temperature=1.0] [--preset=default|tiny]
  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python -m benchmarks.sampling
  python -m benchmarks.xla_flags   # c and v(k) under each XLA CPU flag set

On the default preset (random-init float32 target ~21M params, draft ~2.7M; prompt 16, 48 new
tokens) it measures, for each batch size:
  1. loop overhead: autoregressive_sample's marginal time per token vs one cached target step
     (T = 1, no top-k/top-p); target < 10%.
  2. c and v(k) for k = 1..8 (specjax.sampling.calibrate).
  3. speculative vs autoregressive wall time (--temperature, k from --ks) for three drafts:
     'independent' (its own random init), 'truncated' (the target's first layer with its
     embedding and final norm: an early-exit draft, cheap and fairly agreeing at random init),
     'self' (draft = target: alpha = 1, c = 1). Measured speedup against tau / (k c + v(k)),
     and against the batch's tau (emitted / (B * batched rounds): a batch waits for its slowest
     row), plus the measured cost of one round in target steps.
Random-init pairs only (trained checkpoints go through the spec_eval mode). Random tied-embedding
models mostly echo their input token, so even independent random pairs accept often (alpha ~0.8
at T = 1). Prints markdown tables and writes JSON (default /tmp/specjax/bench_sampling.json).
About 2.5 minutes on the shared 2-core CPU with a warm compilation cache (--compilation_cache),
about 6 minutes cold. Timings there swing 20-40% between runs: compare ratios, rerun to check.
"""

from __future__ import annotations

import sys
import time

from benchmarks import cli, roofline
from specjax import jsonio


def bench_speculative(
    target, drafts, *, batch_size, ks, cals, prompt_len, max_new, repeats, temperature=1.0
):
    """Round-robin timed AR and speculative runs -> one row per (draft, k)."""
    import jax
    import numpy as np

    from specjax.models import split
    from specjax.sampling import (
        SamplingConfig,
        make_autoregressive_fn,
        make_speculative_fn,
        rescore,
    )
    from specjax.sampling import stats as st
    from specjax.sampling.calibrate import interleaved_times, timed_call

    sampling = SamplingConfig(temperature, 0, 1.0)
    rng = np.random.default_rng(batch_size)
    vocab = target.config.vocab_size
    prompts = rng.integers(3, vocab, (batch_size, prompt_len)).astype(np.int32)
    lengths = np.full((batch_size,), prompt_len, np.int32)
    key = jax.random.key(0)
    t_gd, t_params = split(target)
    ar = make_autoregressive_fn(t_gd, max_new_tokens=max_new, sampling=sampling)
    calls, outputs = {'ar': lambda: ar(t_params, prompts, lengths, key).tokens}, {}
    for name, draft in drafts.items():
        d_gd, d_params = split(draft)
        for k in ks:
            fn = make_speculative_fn(
                t_gd, d_gd, num_draft_tokens=k, max_new_tokens=max_new, sampling=sampling
            )
            calls[(name, k)] = (lambda f, dp: lambda: f(t_params, dp, prompts, lengths, key))(
                fn, d_params
            )
    # Prefills and the target step at the samplers' capacity, timed alongside (iters calls each).
    iters, capacity = 4, prompt_len + max_new + max(ks) + 1
    common = dict(batch_size=batch_size, capacity=capacity, iters=iters)
    calls['step'] = timed_call(
        target, num_tokens=1, context_len=prompt_len + max_new // 2, **common
    )
    calls['prefill_target'] = timed_call(target, num_tokens=prompt_len, context_len=0, **common)
    for name, draft in drafts.items():
        calls[('prefill', name)] = timed_call(draft, num_tokens=prompt_len, context_len=0, **common)
    compile_s = {}
    for name, fn in calls.items():
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        compile_s[name] = time.perf_counter() - t0
        if isinstance(name, tuple) and name[0] != 'prefill':
            outputs[name] = jax.device_get(out)
    times = {n: np.asarray(t) for n, t in interleaved_times(calls, repeats, warmup=0).items()}
    step, prefill_t = times['step'] / iters, times['prefill_target'] / iters
    ar_per_token = (times['ar'] - prefill_t) / max_new
    rows = []
    for (name, k), out in outputs.items():
        draft = drafts[name]
        cal = cals[name]
        alpha, mask = rescore.alpha_of_sequences(
            target, draft, prompts, lengths, out.tokens, out.lengths, sampling
        )
        totals = st.reduce_rows(st.row_table(out.stats, emitted=out.lengths))
        s = st.summarize(dict(totals, alpha_sum=float(alpha.sum()), alpha_count=int(mask.sum())))
        c, v_k = cal['c'], cal['v'][str(k)]
        cost = st.round_cost(k, c, v_k)  # k c + v(k)
        tau_batch = st.batch_block_efficiency(out.stats, batch_size)
        predicted = st.predicted_speedup(s['block_efficiency'], k, c, v_k)
        predicted_batch = st.predicted_speedup(tau_batch, k, c, v_k)
        measured = float(np.median(times['ar'] / times[(name, k)]))
        prefill_d = times[('prefill', name)] / iters
        round_s = (times[(name, k)] - prefill_t - prefill_d) / int(out.stats['batch_rounds'])
        rows.append(
            {
                'draft': name,
                'k': k,
                'batch_size': batch_size,
                'draft_params': draft.config.num_params,
                'acceptance_rate': s['acceptance_rate'],
                'alpha': s['alpha'],
                'block_efficiency': s['block_efficiency'],
                'batch_block_efficiency': tau_batch,
                'expected_block_efficiency': s['expected_block_efficiency'],
                'c': cal['c'],
                'v_k': cal['v'][str(k)],
                'round_cost': cost,
                'ar_s': float(np.median(times['ar'])),
                'spec_s': float(np.median(times[(name, k)])),
                'measured_speedup': measured,
                'predicted_speedup': predicted,
                'predicted_speedup_batch': predicted_batch,
                'ratio': measured / predicted,
                'ratio_batch': measured / predicted_batch,
                'first_call_s': compile_s[(name, k)],
                'step_s': float(np.median(step)),
                'ar_overhead': float(np.median(ar_per_token / step)) - 1.0,
                'round_s': float(np.median(round_s)),
                'measured_round_cost': float(np.median(round_s / step)),
                'round_overhead': float(np.median(round_s / step)) / cost - 1.0,
            }
        )
    return rows


def run(args) -> dict:
    import jax

    from specjax.evaluation import measure
    from specjax.models import split
    from specjax.sampling.calibrate import calibrate, cost_ratio, loop_overhead

    started = time.perf_counter()
    target, drafts = cli.build_models(args.preset)  # specjax.models.presets.PAIRS
    ks = tuple(range(1, 9))
    result = {
        'environment': measure.environment(),
        'preset': args.preset,
        'target_params': target.config.num_params,
        'draft_params': {n: d.config.num_params for n, d in drafts.items()},
        'loop_overhead': {},
        'bandwidth_bytes_per_s': roofline.bandwidth(),
        'target_weight_bytes': roofline.weight_bytes(split(target)[1]),
        'calibration': {},
        'speculative': [],
        'temperature': args.temperature,
    }
    for batch in args.batch_sizes:
        capacity = args.prompt_len + args.max_new + max(ks) + 1
        common = dict(
            batch_size=batch,
            context_len=args.prompt_len + args.max_new // 2,
            capacity=capacity,
            iters=args.iters,
            repeats=args.repeats,
        )
        base = calibrate(target, drafts['independent'], ks=ks, **common).to_dict()
        c_truncated = cost_ratio(drafts['truncated'], target, **common)
        cals = {
            'independent': base,
            'truncated': dict(base, c=c_truncated),
            'self': dict(base, c=1.0),
        }
        result['calibration'][str(batch)] = cals
        lo = loop_overhead(
            target,
            batch_size=batch,
            prompt_len=args.prompt_len,
            max_new_tokens=args.max_new,
            repeats=args.repeats,
            iters=args.iters,
        )
        lo['roofline'] = roofline.fraction(
            lo['tokens_per_s'],
            batch,
            result['target_weight_bytes'],
            result['bandwidth_bytes_per_s'],
        )
        result['loop_overhead'][str(batch)] = lo
        result['speculative'] += bench_speculative(
            target,
            drafts,
            batch_size=batch,
            ks=args.ks,
            cals=cals,
            prompt_len=args.prompt_len,
            max_new=args.max_new,
            temperature=args.temperature,
            repeats=args.repeats,
        )
        print(f'batch {batch} done at {time.perf_counter() - started:.0f}s', file=sys.stderr)
    result['wall_s'] = time.perf_counter() - started
    result['jax_devices'] = [str(d) for d in jax.devices()]
    jsonio.write_json(args.out, result)
    print(tables(result))
    print(f'\nwrote {args.out} ({result["wall_s"]:.0f} s)')
    return result


def tables(result: dict) -> str:
    from specjax.evaluation.tables import markdown_table

    lo_rows, vk_rows = [], []
    for b, lo in result['loop_overhead'].items():
        lo_rows.append(
            [
                b,
                1e3 * lo['step_s'],
                1e3 * lo['per_token_s'],
                lo['tokens_per_s'],
                lo['step_tokens_per_s'],
                100 * lo['overhead'],
                100 * lo['roofline'],
            ]
        )
    for b, cals in result['calibration'].items():
        for name in ('independent', 'truncated'):
            cal = cals[name]
            vk_rows.append(
                [b, name, 1e3 * cal['target_step_s'], cal['c']]
                + [cal['v'].get(str(k)) for k in range(1, 9)]
            )
    spec_rows = [
        [
            r['batch_size'],
            r['draft'],
            r['k'],
            r['acceptance_rate'],
            r['alpha'],
            r['block_efficiency'],
            r['batch_block_efficiency'],
            r['c'],
            r['v_k'],
            r['round_cost'],
            r['measured_round_cost'],
            r['measured_speedup'],
            r['predicted_speedup'],
            r['ratio'],
            r['predicted_speedup_batch'],
            r['ratio_batch'],
        ]
        for r in result['speculative']
    ]
    return '\n\n'.join(
        [
            '### Loop overhead (autoregressive_sample, T=1, no top-k/top-p)',
            markdown_table(
                [
                    'B',
                    'step ms',
                    'sampler ms/token',
                    'tokens/s',
                    '1/step tokens/s',
                    'overhead %',
                    '% of weight-read roofline',
                ],
                lo_rows,
            ),
            f'Roofline: tokens/s / B x target weight bytes '
            f'({result["target_weight_bytes"] / 2**20:.1f} MiB) / measured bandwidth '
            f'({result["bandwidth_bytes_per_s"] / 1e9:.1f} GB/s, benchmarks.roofline).',
            '### Cost ratios c and v(k) (target step = 1)',
            markdown_table(
                ['B', 'draft', 'target step ms', 'c'] + [f'v({k})' for k in range(1, 9)], vk_rows
            ),
            f'### Speculative (T={result["temperature"]:g}) vs autoregressive: speedups',
            markdown_table(
                [
                    'B',
                    'draft',
                    'k',
                    'acc. rate',
                    'alpha',
                    'tau',
                    'tau batch',
                    'c',
                    'v(k)',
                    'round cost kc+v(k)',
                    'round cost measured',
                    'measured',
                    'predicted',
                    'ratio',
                    'predicted (batch tau)',
                    'ratio (batch)',
                ],
                spec_rows,
            ),
        ]
    )


def parser():
    p = cli.parser(
        __doc__,
        out='/tmp/specjax/bench_sampling.json',
        preset='default',
        repeats=3,
        compilation_cache=True,
    )
    p.add_argument('--batch_sizes', default='1,8', type=lambda s: list(cli.ints(s)))
    p.add_argument('--ks', default='4', type=cli.ints)
    p.add_argument('--temperature', default=1.0, type=float, help='speculative runs (0: greedy)')
    p.add_argument('--prompt_len', default=16, type=int)
    p.add_argument('--max_new', default=48, type=int)
    p.add_argument('--iters', default=8, type=int)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    cli.setup_cache(args)
    return run(args)


if __name__ == '__main__':
    main()
