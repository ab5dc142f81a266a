"""Where a speculative round's time goes (not a test): the chain sampler's loop body in pieces.

  python -m benchmarks.round_profile --workdir=workdirs/quickstart [--draft=draft_distilled]
      [--batch_sizes=1,8] [--temperatures=1.0] [--k=4] [--prompt_len=32] [--max_new=48]
      [--repeats=7] [--iters=16] [--out=PATH]

On a trained pair (<workdir>/target and <workdir>/<draft>, docs/quickstart.md; a reduced-
vocabulary draft reads its ids from <workdir>/<draft>/draft_vocab.json, as benchmarks/trees.py
does) or, with --workdir='', the random-init pair --preset=default|tiny (its independent draft),
every piece of `speculative_sample`'s round runs `iters` times inside one jitted `lax.fori_loop`
at the sampler's cache capacity (prompt_len + max_new + k + 1), cache lengths reset after each
call, the way `calibrate` measures c and v(k). Token drafts only (a feature draft's calls are not
plain cached calls). V: the target's vocabulary, N: the draft's proposable tokens (N = V unless
the draft has a reduced vocabulary).

  target step, draft step  1-token cached calls at prompt_len + max_new // 2 (c = draft / target)
  verify call              the (k + 1)-token target call there (v(k) = it / target step)
  catch-up                 `drafter.catch_up` (token draft: a lax.cond over 1- or 2-token calls;
                           1 taken)
  draft sample             one draw as `proposals.propose` makes it: a draft logits row
                           restricted to [B, N] (`DraftVocab.restrict`), argmax at T = 0, else
                           transform_logits + inverse_cdf and q expanded to [B, V] (`.expand`)
  verify rule              transform_logits of [B, k + 1, V] + the acceptance rule on q
                           [B, k, V] (greedy: verify_greedy on the logits)
  propose                  `proposals.propose`: the whole draft phase (catch-up, k - 1 draft
                           steps, k draws)
  round                    the whole loop body (`speculative._round`)

catch-up, propose and round run on the sampler's own state before its first round
(`speculative.initial_state`: caches filled with a random prompt_len prompt, so at
position prompt_len - 1; attention masks the whole capacity, so the position does not change a
call's cost). And the sampler itself: (wall - prefill) / rounds, its measured round. The
prediction behind "predicted speedup" is k * draft step + verify call; the table shows how far
each level is above it. Times are CPU seconds of this process (time.process_time; wall time
swings several-fold on a shared machine, CPU time barely moves), minimum over `repeats`
interleaved runs of each; only ratios within one run count.
"""

from __future__ import annotations

import functools
import os
import time

from benchmarks import cli
from specjax import jsonio


def _looped(fn, iters):
    """jit((params, carry) -> carry) running fn(params, carry) `iters` times in a fori_loop;
    the parameters are arguments, as in the sampler and `calibrate` (closed over, XLA would fold
    them as constants: e.g. transpose a tied embedding once at compile time)."""
    import jax

    loop = lambda params, carry: jax.lax.fori_loop(0, iters, lambda _, c: fn(params, c), carry)
    return jax.jit(loop)


def _sampler(tgd, dgd, *, k, max_new, sampling, draft_vocab_ids):
    """The chain sampler profiled (make_speculative_fn caches it: pieces and profile share it)."""
    from specjax.sampling import make_speculative_fn

    return make_speculative_fn(tgd, dgd, num_draft_tokens=k, max_new_tokens=max_new,
                               sampling=sampling, draft_vocab_ids=draft_vocab_ids)  # fmt: skip


def _initial_state(spec, tgd, dgd, tparams, dparams, prompts, lengths):
    """The sampler's SpeculativeState before its first round (`speculative.initial_state` with
    the settings of `spec`'s core)."""
    import jax

    from specjax.sampling import speculative

    kw = {n: spec.core.keywords[n] for n in ('k', 'max_new', 'vocab', 'layout', 'drafter')}
    build = lambda tp, dp, p, n: speculative.initial_state(tgd, dgd, tp, dp, p, n, **kw)
    return jax.jit(build)(tparams, dparams, prompts, lengths)


def pieces(target, draft, *, batch, k, width, max_new, sampling, iters, seed=0,
           draft_vocab_ids=None):  # fmt: skip
    """name -> zero-argument call running that piece `iters` times (see module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.models import apply_cached, init_cache, split
    from specjax.sampling import common, drafters, proposals, speculative
    from specjax.sampling.acceptance import verify_rule
    from specjax.sampling.transforms import inverse_cdf, is_greedy, transform_logits
    from specjax.sampling.verify import verify_greedy

    (tgd, tp), (dgd, dp) = split(target), split(draft)
    spec = _sampler(tgd, dgd, k=k, max_new=max_new, sampling=sampling,
                    draft_vocab_ids=draft_vocab_ids)  # fmt: skip
    # the sampler's own settings: its drafter, vocabulary map and acceptance rule
    drafter, vocab, acc = (spec.core.keywords[n] for n in ('drafter', 'vocab', 'acc'))
    if not isinstance(drafter, drafters.TokenDrafter):
        raise ValueError('round_profile times token drafts only, got a feature draft')
    t_vocab, d_vocab = target.config.vocab_size, common.config_of(dgd).vocab_size
    values = spec.values  # (TracedSampling, emit.Stop): what the sampler's round reads
    greedy = is_greedy(values[0])
    capacity = width + max_new + k + 1
    context = width + max_new // 2  # a mid-run cache position
    rng = np.random.default_rng(seed)
    toks = lambda n, v=t_vocab: jnp.asarray(rng.integers(3, v, (batch, n)), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    cache = lambda model: init_cache(model.config, batch, capacity, lengths=lengths)
    ones = jnp.ones((batch,), jnp.int32)
    key = jax.random.key(seed)
    width_B = jnp.full((batch,), width, jnp.int32)
    state0 = _initial_state(spec, tgd, dgd, tp, dp, toks(width), width_B)
    settings = dict(k=k, sampling=values[0], acc=acc, vocab=vocab, bug=None)
    best = lambda logits: vocab.token(jnp.argmax(vocab.restrict(logits), -1).astype(jnp.int32))

    def call(gd, which):  # which: 0 the target's params, 1 the draft's
        def body(params, carry):
            tokens, c = carry
            logits, new = apply_cached(gd, params[which], tokens, ones, c)
            nxt = jnp.argmax(logits, -1).astype(jnp.int32)  # in the model's own vocabulary
            return nxt, new.replace(lengths=c.lengths)

        return body

    def rolled_back(state, new_dcache, last):
        return state.replace(dcache=new_dcache.replace(lengths=state.dcache.lengths), last=last)

    def catch_up(params, state):
        logits, carry = drafter.catch_up(dgd, params[1], state, ~state.done, vocab)
        return rolled_back(state, drafter.split_carry(carry)[0], best(logits))

    def draft_sample(_, carry):  # as proposals.propose draws (argmax_draft aside)
        logits_BN, u, q_BV = carry
        restricted = vocab.restrict(logits_BN)
        if greedy:
            x = jnp.argmax(restricted, -1)
        else:
            q = transform_logits(restricted, values[0])
            x, q_BV = inverse_cdf(q, u), vocab.expand(q)
        x = vocab.token(x.astype(jnp.int32))
        return logits_BN.at[:, 0].add(x.astype(logits_BN.dtype) * 1e-9), u, q_BV

    def verify_piece(_, carry):  # as speculative._round verifies
        logits_BKV, q_BKV, x_BK = carry
        if greedy:
            n, nxt = verify_greedy(logits_BKV, x_BK)
        else:
            p = transform_logits(logits_BKV, values[0])
            u = jnp.full((batch, k), 0.5)
            n, nxt = verify_rule(acc, u, u[:, 0], p, q_BKV, x_BK)
        return logits_BKV.at[:, 0, 0].add((n + nxt).astype(logits_BKV.dtype) * 1e-9), q_BKV, x_BK

    def propose_call(params, state):
        u = jnp.full((batch, k), 0.5)
        return proposals.propose(drafter, dgd, params[1], state, u, ~state.done, **settings)

    def propose(params, carry):  # q in the carry, as verification keeps it alive in the sampler
        state, _ = carry
        x_BK, q, _, _, dcarry, _ = propose_call(params, state)
        return rolled_back(state, drafter.split_carry(dcarry)[0], x_BK[:, -1]), q

    def round_(params, state):
        new = speculative._round(tgd, dgd, *params, key, state, stop=values[1], drafter=drafter,
                                 **settings)  # fmt: skip
        return new.replace(
            tcache=new.tcache.replace(lengths=state.tcache.lengths),
            dcache=new.dcache.replace(lengths=state.dcache.lengths),
            emitted=state.emitted, done=state.done,
        )  # fmt: skip

    q0 = jax.eval_shape(propose_call, (tp, dp), state0)[1]
    logits_BN = jnp.asarray(rng.normal(size=(batch, d_vocab)) * 3, jnp.float32)
    u_B = jnp.full((batch,), 0.37)
    logits_BKV = jnp.asarray(rng.normal(size=(batch, k + 1, t_vocab)) * 3, jnp.float32)
    q_BKV = jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, k, t_vocab)) * 3), -1)
    specs = {
        'target step': (call(tgd, 0), (toks(1), cache(target))),
        'draft step': (call(dgd, 1), (toks(1, d_vocab), cache(draft))),
        'verify call': (call(tgd, 0), (toks(k + 1), cache(target))),
        'catch-up': (catch_up, state0),
        'draft sample': (draft_sample, (logits_BN, u_B, jnp.zeros((batch, t_vocab)))),
        'verify rule': (verify_piece, (logits_BKV, q_BKV, toks(k))),
        'propose': (propose, (state0, jnp.zeros(q0.shape, q0.dtype))),
        'round': (round_, state0),
    }
    out = {}
    for name, (fn, carry) in specs.items():
        out[name] = functools.partial(_looped(fn, iters), (tp, dp), carry)
    return out


def profile(target, draft, *, batch, k, width, max_new, sampling, iters, repeats,
            draft_vocab_ids=None):  # fmt: skip
    import jax
    import numpy as np

    from specjax.models import split
    from specjax.sampling import make_autoregressive_fn
    from specjax.sampling import stats as st
    from specjax.sampling.calibrate import interleaved_times, timed_call

    calls = pieces(target, draft, batch=batch, k=k, width=width, max_new=max_new,
                   sampling=sampling, iters=iters, draft_vocab_ids=draft_vocab_ids)  # fmt: skip
    (tgd, tp), (dgd, dp) = split(target), split(draft)
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, target.config.vocab_size, (batch, width)).astype(np.int32)
    lengths = np.full((batch,), width, np.int32)
    key = jax.random.key(0)
    spec = _sampler(tgd, dgd, k=k, max_new=max_new, sampling=sampling,
                    draft_vocab_ids=draft_vocab_ids)  # fmt: skip
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
        draft_vocab_size=None if draft_vocab_ids is None else len(draft_vocab_ids),
        tau_per_batch=tau_batch, c=c, v=v, ms={n: 1e3 * t for n, t in per.items()},
        predicted_round_ms=1e3 * predicted, measured_speedup=measured_speedup,
        predicted_speedup=predicted_speedup,
        measured_over_predicted=measured_speedup / predicted_speedup,
    )  # fmt: skip


def run(args) -> dict:
    from specjax.evaluation.pairs import draft_vocab_ids
    from specjax.sampling import SamplingConfig

    started = time.perf_counter()
    vocab_ids = None
    if args.workdir:
        target, draft = cli.load_pair(args.workdir, args.draft)
        vocab_ids = draft_vocab_ids(os.path.join(args.workdir, args.draft))  # reduced drafts
    else:
        target, drafts = cli.build_models(args.preset)
        draft = drafts['independent']
    result = dict(
        workdir=args.workdir, draft=args.draft if args.workdir else 'independent',
        draft_vocab_size=None if vocab_ids is None else len(vocab_ids), repeats=args.repeats,
        iters=args.iters, prompt_len=args.prompt_len, max_new=args.max_new, points=[],
    )  # fmt: skip
    for b in args.batch_sizes:
        for t in args.temperatures:
            point = profile(
                target, draft, batch=b, k=args.k, width=args.prompt_len, max_new=args.max_new,
                sampling=SamplingConfig(t), iters=args.iters, repeats=args.repeats,
                draft_vocab_ids=vocab_ids,
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

    vocab = lambda p: f', draft vocab {n}' if (n := p.get('draft_vocab_size')) else ''
    lines = []
    for p in points:
        pred = p['predicted_round_ms']
        rows = [[n, p['ms'][n], p['ms'][n] / pred] for n in ROWS]
        rows.append(['predicted k·draft step + verify call', pred, 1.0])
        lines.append(
            f'B={p["batch_size"]}, T={p["temperature"]}, k={p["k"]}{vocab(p)}: tau/batch '
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
