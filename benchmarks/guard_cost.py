"""Guard cost benchmark (not a test): the samplers' time per token with the non-finite check on/off.

  python -m benchmarks.guard_cost [--out=PATH] [--preset=tiny|default] [--batch_sizes=1,8]
      [--k=4] [--temperature=1.0] [--max_new=96] [--repeats=61]

For each batch size it times autoregressive_sample and speculative_sample (chain of --k, the
preset's independent draft, probabilistic acceptance) built with `check_finite=True` and with
`check_finite=False` (the internal switch of specjax.sampling.guards: the in-loop or-reduction
of ~isfinite over each round's logits and its flag in the loop state). On and off run back to
back within each repeat, in alternating order, and every repeat gives one ratio on / off per
sampler; the cost is the median ratio - 1 (with the lower and upper quartiles; and the ratio
of the fastest runs, which other processes' load disturbs least), per token
because both runs emit the same tokens (checked: the switch must not change outputs). Wall
and process CPU seconds are both recorded. The host-side id checks before the call
(prompt ids against the vocabulary) are the same on both sides; their own time per call is
reported separately. Because timings on a shared CPU swing by more than the guard costs, an
isolated estimate comes with them: the guard's checks alone, timed in a jitted loop of their
own (`guard_op_s`), times the rounds of a run, over the run's time. Random-init pairs
(benchmarks/cli.py --preset). Prints a markdown table and writes JSON (default
/tmp/specjax/bench_guard_cost.json).
"""

from __future__ import annotations

import sys
import time

from benchmarks import cli
from specjax import jsonio


def _timed(fn) -> tuple[float, float]:
    """(wall s, process CPU s) of one blocking call."""
    import jax

    w0, p0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - w0, time.process_time() - p0


def _quartiles(values) -> dict:
    import numpy as np

    q1, med, q3 = np.percentile(np.asarray(values, np.float64), [25, 50, 75])
    return dict(median=float(med), q1=float(q1), q3=float(q3))


def guard_op_s(shape, iters: int = 2000, repeats: int = 7) -> float:
    """Seconds per guard check (guards.any_nonfinite) of float32 logits `shape` [B, ...]: a
    jitted fori_loop of `iters` checks on loop-variant logits, minus the same loop without the
    check, fastest of `repeats` each (an isolated cost, free of the sampler's timing noise)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.sampling import guards

    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    active = jnp.ones(shape[:1], bool)

    def loop(check: bool):
        def body(i, carry):
            flag, acc = carry
            y = x + i.astype(jnp.float32)  # loop-variant: nothing is hoisted out of the loop
            flag = flag | guards.any_nonfinite(y, active) if check else flag
            return flag, acc + y.reshape(-1)[0]

        return jax.jit(lambda: jax.lax.fori_loop(0, iters, body, (jnp.bool_(False), 0.0)))

    fns = {check: loop(check) for check in (True, False)}
    best = {}
    for check, fn in fns.items():
        jax.block_until_ready(fn())
        best[check] = min(_timed(fn)[0] for _ in range(repeats))
    return max(0.0, float(np.float64(best[True] - best[False]) / iters))


def bench_batch(target, draft, *, batch_size, k, sampling, prompt_len, max_new, repeats):
    """Rows (one per sampler) of on/off times and cost ratios at one batch size."""
    import jax
    import numpy as np

    from specjax.models import split
    from specjax.sampling import guards, make_autoregressive_fn, make_speculative_fn

    rng = np.random.default_rng(batch_size)
    vocab = target.config.vocab_size
    prompts = rng.integers(3, vocab, (batch_size, prompt_len)).astype(np.int32)
    lengths = np.full((batch_size,), prompt_len, np.int32)
    key = jax.random.key(0)
    (tgd, tp), (dgd, dp) = split(target), split(draft)
    calls = {}
    for on in (True, False):
        kw = dict(max_new_tokens=max_new, sampling=sampling, check_finite=on)
        ar = make_autoregressive_fn(tgd, **kw)
        chain = make_speculative_fn(tgd, dgd, num_draft_tokens=k, **kw)
        calls[('autoregressive', on)] = lambda f=ar: f(tp, prompts, lengths, key)
        calls[(f'chain k={k}', on)] = lambda f=chain: f(tp, dp, prompts, lengths, key)
    first = {}
    for name, fn in calls.items():
        t0 = time.perf_counter()
        out = jax.device_get(jax.block_until_ready(fn()))
        first[name] = (time.perf_counter() - t0, out)
    samplers = sorted({name for name, _ in calls})
    for name in samplers:
        a, b = first[(name, True)][1], first[(name, False)][1]
        if not (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.lengths, b.lengths)):
            raise RuntimeError(f'{name}: check_finite changed the output tokens')
    times = {key_: {'wall': [], 'process': []} for key_ in calls}
    for r in range(repeats):
        for name in samplers:
            for on in (True, False) if r % 2 == 0 else (False, True):
                wall, proc = _timed(calls[(name, on)])
                times[(name, on)]['wall'].append(wall)
                times[(name, on)]['process'].append(proc)
    vocab_shape = lambda *mid: (batch_size, *mid, vocab)
    op_ar, op_draft = guard_op_s(vocab_shape(1)), guard_op_s(vocab_shape())
    op_target = guard_op_s(vocab_shape(k + 1))
    per_round = {'autoregressive': op_ar, f'chain k={k}': k * op_draft + op_target}
    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        guards.check_prompt_ids(prompts, lengths, vocab, 'benchmark target')
        host.append(time.perf_counter() - t0)
    rows = []
    for name in samplers:
        on, off = times[(name, True)], times[(name, False)]
        out = first[(name, True)][1]
        tokens = max_new  # per row: both runs emit the same tokens (checked above)
        row = dict(
            sampler=name,
            batch_size=batch_size,
            tokens_per_row=tokens,
            rounds=int(out.stats['batch_rounds']),
            first_call_s={'on': first[(name, True)][0], 'off': first[(name, False)][0]},
            host_check_s=float(np.median(host)),
            guard_ops_s_per_round=per_round[name],
        )
        for clock in ('wall', 'process'):
            ratio = np.asarray(on[clock]) / np.asarray(off[clock])
            row[clock] = dict(
                on_s_per_token=float(np.median(on[clock])) / tokens,
                off_s_per_token=float(np.median(off[clock])) / tokens,
                cost=_quartiles(ratio - 1.0),
                min_cost=float(np.min(on[clock]) / np.min(off[clock]) - 1.0),
                op_estimate=per_round[name] * row['rounds'] / float(np.median(off[clock])),
                on_s=on[clock],
                off_s=off[clock],
            )
        rows.append(row)
    return rows


def run(args) -> dict:
    import jax

    from specjax.evaluation import measure
    from specjax.sampling import SamplingConfig

    started = time.perf_counter()
    target, drafts = cli.build_models(args.preset, args.seed)
    sampling = SamplingConfig(args.temperature)
    result = {
        'environment': measure.environment(),
        'preset': args.preset,
        'target_params': target.config.num_params,
        'draft_params': drafts['independent'].config.num_params,
        'temperature': args.temperature,
        'k': args.k,
        'prompt_len': args.prompt_len,
        'max_new': args.max_new,
        'repeats': args.repeats,
        'rows': [],
    }
    for batch in args.batch_sizes:
        result['rows'] += bench_batch(
            target,
            drafts['independent'],
            batch_size=batch,
            k=args.k,
            sampling=sampling,
            prompt_len=args.prompt_len,
            max_new=args.max_new,
            repeats=args.repeats,
        )
        print(f'batch {batch} done at {time.perf_counter() - started:.0f}s', file=sys.stderr)
    result['wall_s'] = time.perf_counter() - started
    result['jax_devices'] = [str(d) for d in jax.devices()]
    jsonio.write_json(args.out, result)
    print(table(result))
    print(f'\nwrote {args.out} ({result["wall_s"]:.0f} s)')
    return result


def table(result: dict) -> str:
    from specjax.evaluation.tables import markdown_table

    rows = []
    for r in result['rows']:
        w, p = r['wall'], r['process']
        rows.append(
            [
                r['batch_size'],
                r['sampler'],
                1e3 * w['off_s_per_token'],
                1e3 * w['on_s_per_token'],
                100 * w['cost']['median'],
                f'{100 * w["cost"]["q1"]:.2f} .. {100 * w["cost"]["q3"]:.2f}',
                100 * w['min_cost'],
                100 * p['cost']['median'],
                f'{100 * p["cost"]["q1"]:.2f} .. {100 * p["cost"]["q3"]:.2f}',
                1e6 * r['guard_ops_s_per_round'],
                100 * w['op_estimate'],
                1e6 * r['host_check_s'],
            ]
        )
    head = (
        f'### Guard cost per token ({result["preset"]} preset, T={result["temperature"]:g}, '
        f'{result["max_new"]} new tokens, {result["repeats"]} interleaved repeats)'
    )
    return '\n\n'.join(
        [
            head,
            markdown_table(
                [
                    'B',
                    'sampler',
                    'off ms/token',
                    'on ms/token',
                    'cost % (wall, median)',
                    'wall quartiles %',
                    'cost % (wall, min / min)',
                    'cost % (CPU, median)',
                    'CPU quartiles %',
                    'guard ops us/round',
                    'isolated estimate %',
                    'host id check us/call',
                ],
                rows,
            ),
        ]
    )


def parser():
    p = cli.parser(
        __doc__,
        out='/tmp/specjax/bench_guard_cost.json',
        preset='tiny',
        seed=0,
        repeats=61,
        compilation_cache=True,
    )
    p.add_argument('--batch_sizes', default='1,8', type=lambda s: list(cli.ints(s)))
    p.add_argument('--k', default=4, type=int, help='draft tokens of the chain sampler')
    p.add_argument('--temperature', default=1.0, type=float, help='sampling temperature')
    p.add_argument('--prompt_len', default=16, type=int)
    p.add_argument('--max_new', default=96, type=int)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    cli.setup_cache(args)
    return run(args)


if __name__ == '__main__':
    main()
