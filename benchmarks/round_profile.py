"""Where a speculative round's time goes (not a test): the chain sampler's loop body in pieces.

  python -m benchmarks.round_profile --workdir=workdirs/quickstart [--batch_sizes=1,8]
      [--temperatures=1.0] [--k=4] [--repeats=7] [--iters=16] [--out=PATH]

On the trained quickstart pair (docs/quickstart.md; with --workdir='' the random-init pair
--preset=default|tiny, whose independent draft is profiled), every piece
of `speculative_sample`'s round runs `iters` times inside one jitted `lax.fori_loop` at the
sampler's cache capacity and a fixed cache position (lengths reset after each call), the way
`calibrate` measures c and v(k):

  target step, draft step  1-token cached calls (c = draft / target)
  verify call              the (k + 1)-token target call (v(k) = it / target step)
  catch-up                 `draft_catch_up` (a lax.cond over 1- or 2-token calls; 1 taken)
  draft sample             transform_logits + inverse_cdf of one [B, V] draft row (argmax at T = 0)
  verify rule              transform_logits of [B, k + 1, V] + the acceptance rule (greedy:
                           verify_greedy on the logits)
  propose                  the whole draft phase (catch-up, k - 1 draft steps, k samples)
  round                    the whole loop body (`speculative._round`) on a live state

and the sampler itself: (wall - prefill) / rounds, its measured round. The prediction behind
"predicted speedup" is k * draft step + verify call; the table shows how far each level is
above it. Times are CPU seconds of this process (time.process_time; wall time swings several-fold
on a shared machine, CPU time barely moves), minimum over `repeats` interleaved runs of each;
only ratios within one run count.
"""

from __future__ import annotations

import functools
import time

from benchmarks import cli
from specjax import jsonio


def _looped(fn, iters):
    """jit(carry -> carry) running fn `iters` times in a fori_loop."""
    import jax

    return jax.jit(lambda carry: jax.lax.fori_loop(0, iters, lambda _, c: fn(c), carry))


def pieces(target, draft, *, batch, k, width, max_new, sampling, iters, seed=0):
    """name -> zero-argument call running that piece `iters` times (see module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.models import apply_cached, init_cache, split
    from specjax.sampling import common, speculative
    from specjax.sampling.acceptance import as_acceptance, verify_rule
    from specjax.sampling.draft_vocab import check_draft_vocab
    from specjax.sampling.transforms import inverse_cdf, transform_logits
    from specjax.sampling.verify import verify_greedy

    (tgd, tp), (dgd, dp) = split(target), split(draft)
    vocab_size = target.config.vocab_size
    capacity = width + max_new + k + 1
    context = width + max_new // 2  # a mid-run cache position
    rng = np.random.default_rng(seed)
    toks = lambda n: jnp.asarray(rng.integers(3, vocab_size, (batch, n)), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    cache = lambda model: init_cache(model.config, batch, capacity, lengths=lengths)
    ones = jnp.ones((batch,), jnp.int32)
    acc = as_acceptance('probabilistic')
    vocab = check_draft_vocab(None, vocab_size, vocab_size)
    key = jax.random.key(seed)

    def call(gd, params):
        def body(carry):
            tokens, c = carry
            logits, new = apply_cached(gd, params, tokens, ones, c)
            nxt = jnp.argmax(logits, -1).astype(jnp.int32)
            return nxt, new.replace(lengths=c.lengths)

        return body

    def catch_up(carry):
        last, c = carry
        pending = ones
        logits, new = common.draft_catch_up(dgd, dp, c, last, last, pending, ones > 0)
        return jnp.argmax(logits, -1).astype(jnp.int32), new.replace(lengths=c.lengths)

    def draft_sample(carry):  # as speculative._propose draws: argmax when greedy
        logits_BV, u = carry
        if sampling.greedy:
            x = jnp.argmax(logits_BV, -1)
        else:
            x = inverse_cdf(transform_logits(logits_BV, sampling), u)
        return logits_BV.at[:, 0].add(x.astype(logits_BV.dtype) * 1e-9), u

    def verify_piece(carry):  # as speculative._round verifies
        logits_BKV, q_BKV, x_BK = carry
        if sampling.greedy:
            n, nxt = verify_greedy(logits_BKV, x_BK)
        else:
            p = transform_logits(logits_BKV, sampling)
            u = jnp.full((batch, k), 0.5)
            n, nxt = verify_rule(acc, u, u[:, 0], p, q_BKV, x_BK)
        return logits_BKV.at[:, 0, 0].add((n + nxt).astype(logits_BKV.dtype) * 1e-9), q_BKV, x_BK

    state0 = _state(tgd, dgd, tp, dp, toks(width), batch, context, capacity, k, max_new)
    kw = dict(k=k, max_new=max_new, sampling=sampling, eos_id=None, acc=acc, vocab=vocab, bug=None)

    def propose(carry):
        state, x = carry
        act = ones > 0
        u = jnp.full((batch, k), 0.5)
        x_BK, q, dc, _ = speculative._propose(dgd, dp, state.replace(last=x), u, act, **{
            n: kw[n] for n in ('k', 'sampling', 'acc', 'vocab', 'bug')})  # fmt: skip
        return state.replace(dcache=dc.replace(lengths=state.dcache.lengths)), x_BK[:, -1]

    def round_(state):
        new = speculative._round(tgd, dgd, tp, dp, key, state, **kw)
        return new.replace(
            tcache=new.tcache.replace(lengths=state.tcache.lengths),
            dcache=new.dcache.replace(lengths=state.dcache.lengths),
            emitted=state.emitted, done=state.done,
        )  # fmt: skip

    logits_BV = jnp.asarray(rng.normal(size=(batch, vocab_size)) * 3, jnp.float32)
    logits_BKV = jnp.asarray(rng.normal(size=(batch, k + 1, vocab_size)) * 3, jnp.float32)
    q_BKV = jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, k, vocab_size)) * 3), -1)
    specs = {
        'target step': (call(tgd, tp), (toks(1), cache(target))),
        'draft step': (call(dgd, dp), (toks(1), cache(draft))),
        'verify call': (call(tgd, tp), (toks(k + 1), cache(target))),
        'catch-up': (catch_up, (toks(1)[:, 0], cache(draft))),
        'draft sample': (draft_sample, (logits_BV, jnp.full((batch,), 0.37))),
        'verify rule': (verify_piece, (logits_BKV, q_BKV, toks(k))),
        'propose': (propose, (state0, toks(1)[:, 0])),
        'round': (round_, state0),
    }
    out = {}
    for name, (fn, carry) in specs.items():
        out[name] = functools.partial(_looped(fn, iters), carry)
    return out


def _state(tgd, dgd, tp, dp, prompt, batch, context, capacity, k, max_new):
    """A live SpeculativeState with both caches filled to `context` (prompt tiled)."""
    import jax.numpy as jnp

    from specjax.models import apply_cached, init_cache
    from specjax.sampling import common
    from specjax.sampling.speculative import SpeculativeState

    filled = jnp.tile(prompt, (1, -(-context // prompt.shape[1])))[:, :context]
    lengths = jnp.full((batch,), context, jnp.int32)
    tcache = init_cache(common.config_of(tgd), batch, capacity)
    dcache = init_cache(common.config_of(dgd), batch, capacity)
    _, tcache = apply_cached(tgd, tp, filled, lengths, tcache)
    _, dcache = apply_cached(dgd, dp, filled, lengths, dcache)
    zeros = jnp.zeros((batch,), jnp.int32)
    return SpeculativeState(
        tcache=tcache, dcache=dcache, last=filled[:, -1], prev=zeros, draft_pending=zeros + 1,
        out=jnp.zeros((batch, max_new + k + 1), jnp.int32), emitted=zeros,
        done=jnp.zeros((batch,), bool), round=jnp.int32(0), row_rounds=zeros,
        row_examined_per_position=jnp.zeros((batch, k), jnp.int32),
        row_accepted_per_position=jnp.zeros((batch, k), jnp.int32),
    )  # fmt: skip


def profile(target, draft, *, batch, k, width, max_new, sampling, iters, repeats):
    import jax
    import numpy as np

    from specjax.models import split
    from specjax.sampling import make_autoregressive_fn, make_speculative_fn
    from specjax.sampling import stats as st
    from specjax.sampling.calibrate import interleaved_times, timed_call

    calls = pieces(target, draft, batch=batch, k=k, width=width, max_new=max_new,
                   sampling=sampling, iters=iters)  # fmt: skip
    (tgd, tp), (dgd, dp) = split(target), split(draft)
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, target.config.vocab_size, (batch, width)).astype(np.int32)
    lengths = np.full((batch,), width, np.int32)
    key = jax.random.key(0)
    spec = make_speculative_fn(tgd, dgd, num_draft_tokens=k, max_new_tokens=max_new,
                               sampling=sampling)  # fmt: skip
    ar = make_autoregressive_fn(tgd, max_new_tokens=max_new, sampling=sampling)
    capacity = width + max_new + k + 1
    calls['sampler'] = lambda: spec(tp, dp, prompts, lengths, key)
    calls['autoregressive'] = lambda: ar(tp, prompts, lengths, key)
    pre = dict(batch_size=batch, num_tokens=width, context_len=0, capacity=capacity, iters=iters)
    calls['target prefill'] = timed_call(target, **pre)
    calls['draft prefill'] = timed_call(draft, **pre)
    for fn in calls.values():
        jax.block_until_ready(fn())
    times = interleaved_times(calls, repeats, warmup=0, clock=time.process_time)
    best = {n: float(np.min(t)) for n, t in times.items()}
    per = {n: best[n] / iters for n in calls if n not in ('sampler', 'autoregressive')}
    out = spec(tp, dp, prompts, lengths, key)
    stats = {n: np.asarray(v) for n, v in out.stats.items()}
    rounds = int(stats['batch_rounds'])
    prefill = per['target prefill'] + per['draft prefill']
    per['sampler round'] = (best['sampler'] - prefill) / rounds
    per['autoregressive token'] = (best['autoregressive'] - per['target prefill']) / max_new
    # the round-cost model k c + v(k), here in seconds: k draft steps + one verification call
    predicted = st.round_cost(k, per['draft step'], per['verify call'])
    tau_batch = float(stats['emitted']) / (batch * rounds)
    c = per['draft step'] / per['target step']
    v = per['verify call'] / per['target step']
    measured_speedup = best['autoregressive'] / best['sampler']
    predicted_speedup = st.predicted_speedup(tau_batch, k, c, v)
    return dict(
        batch_size=batch, k=k, temperature=sampling.temperature, rounds=rounds,
        tau_per_batch=tau_batch, c=c, v=v, ms={n: 1e3 * t for n, t in per.items()},
        predicted_round_ms=1e3 * predicted, measured_speedup=measured_speedup,
        predicted_speedup=predicted_speedup,
        measured_over_predicted=measured_speedup / predicted_speedup,
    )  # fmt: skip


def run(args) -> dict:
    from specjax.sampling import SamplingConfig

    started = time.perf_counter()
    if args.workdir:
        target, draft = cli.load_pair(args.workdir, args.draft)
    else:
        target, drafts = cli.build_models(args.preset)
        draft = drafts['independent']
    result = dict(workdir=args.workdir, repeats=args.repeats, iters=args.iters, points=[])
    for b in args.batch_sizes:
        for t in args.temperatures:
            point = profile(
                target, draft, batch=b, k=args.k, width=args.prompt_len, max_new=args.max_new,
                sampling=SamplingConfig(t), iters=args.iters, repeats=args.repeats,
            )  # fmt: skip
            result['points'].append(point)
            print(table([point]), flush=True)
    result['wall_s'] = time.perf_counter() - started
    jsonio.write_json(args.out, result)
    print(f'\nwrote {args.out} ({result["wall_s"]:.0f} s)')
    return result


ROWS = ('target step', 'draft step', 'verify call', 'catch-up', 'draft sample', 'verify rule',
        'propose', 'round', 'sampler round', 'autoregressive token')  # fmt: skip


def table(points) -> str:
    from specjax.evaluation.tables import markdown_table

    lines = []
    for p in points:
        pred = p['predicted_round_ms']
        rows = [[n, p['ms'][n], p['ms'][n] / pred] for n in ROWS]
        rows.append(['predicted k·draft step + verify call', pred, 1.0])
        lines.append(
            f'B={p["batch_size"]}, T={p["temperature"]}, k={p["k"]}: tau/batch '
            f'{p["tau_per_batch"]:.2f}, c {p["c"]:.3f}, v {p["v"]:.2f}, measured speedup '
            f'{p["measured_speedup"]:.2f}, predicted {p["predicted_speedup"]:.2f}, ratio '
            f'{p["measured_over_predicted"]:.2f}\n\n'
            + markdown_table(['piece', 'ms', '÷ predicted round'], rows)
        )
    return '\n\n'.join(lines)


def parser():
    p = cli.parser(
        __doc__,
        out='/tmp/specjax/bench_round_profile.json',
        preset='default',  # the random-init pair when --workdir=''
        repeats=7,
        compilation_cache=True,
    )
    cli.add_workdir_pair(p)
    p.add_argument('--batch_sizes', default='1,8', type=cli.ints)
    p.add_argument('--temperatures', default='1.0', type=cli.floats)
    p.add_argument('--k', default=4, type=int)
    p.add_argument('--prompt_len', default=32, type=int)
    p.add_argument('--max_new', default=48, type=int)
    p.add_argument('--iters', default=16, type=int)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    cli.setup_cache(args)
    return run(args)


if __name__ == '__main__':
    main()
