"""A chain round's proposals: the draft's catch-up, then up to k draws, each fed back.

`propose` draws x_1 from the catch-up's logits and feeds x_1..x_{m-1} to get q_2..q_m, one
single-token draft call each (through a drafter, specjax.sampling.drafters). m = k unless
`stop_below` h is set: then a row stops proposing after the first x_i whose probability under the
draft's own model distribution (softmax of its logits, the same at every temperature) is below h
(x_i is still proposed), and the loop ends when every active row has stopped (SpecDec++ / EAGLE-2
style confidence stopping). The number of proposals is a stopping time of the draft's draws, so
the sampler's output law is unchanged when verification treats m as the row's k (speculative.py).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from specjax.sampling import guards
from specjax.sampling.transforms import branch, inverse_cdf, is_greedy, transform_logits


def check_stop_below(stop_below) -> float | None:
    """None (always k proposals) or a probability h in [0, 1]; ValueError naming it otherwise."""
    if stop_below is None:
        return None
    if isinstance(stop_below, bool) or not isinstance(stop_below, numbers.Real):
        raise ValueError(f'stop_below must be None or a number in [0, 1], got {stop_below!r}')
    if not 0.0 <= stop_below <= 1.0:
        raise ValueError(f'stop_below must lie in [0, 1], got {stop_below!r}')
    return float(stop_below)


def propose(
    drafter, dgd, dparams, state, uniform_BK, active, *, k, sampling, acc, vocab, bug,
    check_finite=True, stop_below=None, con=None,
):  # fmt: skip
    """Catch-up then the proposals -> (x [B, k], q [B, k, V] they were drawn from, m [B] the
    proposals each row makes (k without stop_below; entries past m are unused), fed (int32
    scalar: proposals fed to the draft, k - 1 without stop_below), the drafter's carry after
    them, whether a draft logit of an active row was non-finite).

    x_m is left for the next round's catch-up. With `argmax_draft` x_i is q_i's argmax and the
    returned q_i its one-hot. x and q are in the target's vocabulary. Greedy: x_i is the argmax
    and q zeros (greedy verification ignores it; a [B, k, 1] placeholder when greediness is
    static). `con` (a constrain.Constraint): each q_i is masked at the grammar state after
    x_1..x_{i-1} (the state advanced along the proposals), so q is the constrained q~. A cascade
    rule's q is [B, k, 2, V]: q_i and the draft's T = 1 law (softmax of its logits; one-hots'
    placeholder zeros at greedy in q_i), which the rule reads (specjax.sampling.cascade).
    """
    act = active.astype(jnp.int32)
    nonfinite = lambda lg: guards.any_nonfinite(lg, active, check_finite)
    logits, carry = drafter.catch_up(dgd, dparams, state, active, vocab)
    greedy = is_greedy(sampling)
    q_width = 1 if greedy is True else vocab.target_vocab  # static greedy: a placeholder q

    def argmax(uniform_B, logits):  # as inverse_cdf of the one-hot would draw; q is unused
        x = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return x, jnp.zeros((x.shape[0], q_width), jnp.float32)

    def sample(uniform_B, logits):
        q = transform_logits(logits, sampling)
        if acc.rule == 'argmax_draft':
            x = jnp.argmax(q, axis=-1).astype(jnp.int32)
            return x, vocab.expand(jax.nn.one_hot(x, q.shape[-1], dtype=q.dtype))
        if bug == 'bf16_draft':
            # reduce_precision: XLA may elide a bf16 round trip (excess precision).
            bf16 = jax.lax.reduce_precision(logits, exponent_bits=8, mantissa_bits=7)
            return inverse_cdf(transform_logits(bf16, sampling), uniform_B), vocab.expand(q)
        return inverse_cdf(q, uniform_B), vocab.expand(q)

    def draw(uniform_B, logits, g_B=None, i=0):
        """-> (target id [B], q [B, V], whether the row goes on proposing after it); g_B: the
        grammar state before the draw, i its index in the round."""
        restricted = free = vocab.restrict(logits)
        if con is not None:
            restricted = con.draft_logits(restricted, vocab, g_B, state.emitted + i)
        x, q = branch(greedy, argmax, sample, uniform_B, restricted)
        if bug == 'unmasked_q':  # wrong: x ~ q~, but the ratio and residual read the unmasked q
            q = vocab.expand(transform_logits(free, sampling))
        if acc.cascade:  # [B, 2, V]: q and the T = 1 law the cascade's rule reads
            law = vocab.expand(jax.nn.softmax(restricted, axis=-1))
            q = jnp.stack([jnp.broadcast_to(q, law.shape), law], axis=1)
        if stop_below is None:
            return vocab.token(x), q, jnp.ones(x.shape, bool)
        confidence = jnp.take_along_axis(jax.nn.softmax(restricted, -1), x[:, None], 1)[:, 0]
        return vocab.token(x), q, confidence >= stop_below

    g = () if con is None else state.task.grammar
    x1, q1, going = draw(uniform_BK[:, 0], logits, g)
    going = going & active
    xs = jnp.zeros((len(act), k), jnp.int32).at[:, 0].set(x1)
    qs = jnp.zeros((len(act), k, *q1.shape[1:]), q1.dtype).at[:, 0].set(q1)

    def more(loop):
        i, going = loop[0], loop[5]
        return (i < k) & jnp.any(going)

    def step(loop):
        i, xs, qs, carry, m, going, bad, g = loop
        logits, carry = drafter.step(dgd, dparams, carry, xs[:, i - 1], act, vocab)
        g = g if con is None else con.advance(g, xs[:, i - 1])
        x, q, goes = draw(jnp.take(uniform_BK, i, axis=1), logits, g, i)
        xs = jax.lax.dynamic_update_index_in_dim(xs, x, i, axis=1)
        qs = jax.lax.dynamic_update_index_in_dim(qs, q, i, axis=1)
        m = m + going.astype(jnp.int32)
        return i + 1, xs, qs, carry, m, going & goes, bad | nonfinite(logits), g

    m = jnp.ones((len(act),), jnp.int32)
    loop = (jnp.int32(1), xs, qs, carry, m, going, nonfinite(logits), g)
    if stop_below is None:  # a fixed count: the same steps, unrolled by nothing, no early exit
        loop = jax.lax.fori_loop(1, k, lambda _, lp: step(lp), loop)
    else:
        loop = jax.lax.while_loop(more, step, loop)
    i, xs, qs, carry, m, going, bad, _ = loop
    if bug == 'stop_drops_proposal':  # wrong: the low-confidence x_m is not proposed after all
        m = jnp.where(active & ~going & (m < k), m - 1, m)
    return xs, qs, m, i - 1, carry, bad
