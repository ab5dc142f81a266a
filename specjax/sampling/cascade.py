"""Speculative cascades (Narasimhan et al., ICLR 2025): a deferral rule inside speculative decoding.

Not exact by design: the output follows a law pi that mixes the draft's q and the target's p, not
the target's. Each rule defines pi per position from q and p, then ordinary exact speculative
sampling runs against pi: x ~ q is kept with min(1, pi(x) / q(x)), at the first rejection the
round emits a sample of norm(max(0, pi - q)) (pi itself when that mass is below 1e-7).

The rule reads the distributions at T = 1 (softmax of the logits: q1, p1; under a grammar the
masked logits'), while pi mixes the transformed distributions tokens are sampled from (q, p of
SamplingConfig). With lenience a in [-1, 1] (the knob):
- `cascade_chow`: pi = q if max q1 >= 1 - a, else p (the draft's own confidence);
- `cascade_diff`: pi = q if max q1 >= max p1 - a, else p;
- `cascade_opt`: pi = q if max q1 >= max p1 - a TV(q1, p1), else p;
- token-specific, with an accepted set A: pi(v) = q(v) [v in A] + (sum_{u not in A} q(u)) p(v);
  `cascade_token_v1`: A = {v: q1(v) >= max p1 - a}; `cascade_token_v2`: A = {v: p1(v) >= max p1 -
  a}; `cascade_token_v3`: A = {v: p1(v) >= (1 - a) max p1}.
a = -1 is exact speculation (pi = p) and a = 1 the draft alone (pi = q), for every rule; both
ends are set exactly (no floating-point tie moves them). Greedy (T = 0): q and p are the one-hots
of the draft's and the target's argmax, so a round keeps x while pi is x's one-hot (the rule
defers to the draft, or x is in A, or the target's argmax is x) and emits pi's token otherwise.

A chain round drafts k + 1 tokens (k + 1 draft calls, the catch-up included) while the target
scores k + 1 positions as in exact speculation: pi at position k + 1 needs q_{k+1}, and x_{k+1}
tested against pi_{k+1} is the round's last token when x_1..x_k are all kept (a sample of
pi_{k+1}: at a = 1 the draft's own x_{k+1}, so the output is the draft's). Chains only: trees
take exact rules. `make_speculative_fn` binds a as a run-time value: `with_lenience` gives the
same compiled program at another a.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling.transforms import branch, inverse_cdf, is_greedy, transform_logits
from specjax.sampling.verify import leading_true, residual, take_position

DEFERRAL_RULES = ('cascade_chow', 'cascade_diff', 'cascade_opt')
TOKEN_RULES = ('cascade_token_v1', 'cascade_token_v2', 'cascade_token_v3')
CASCADE_RULES = DEFERRAL_RULES + TOKEN_RULES
EXACT_END, DRAFT_END = -1.0, 1.0  # the knob's ends: pi = p, pi = q


def check_lenience(lenience, where: str = 'cascade_lenience') -> float:
    """a as a float in [-1, 1]; ValueError naming `where` otherwise."""
    ok = isinstance(lenience, numbers.Real) and not isinstance(lenience, bool)
    if not ok or not EXACT_END <= lenience <= DRAFT_END:
        raise ValueError(
            f'{where} must be a number in [-1, 1] (-1: exact speculation, 1: the draft alone), '
            f'got {lenience!r}'
        )
    return float(lenience)


def target_law(rule: str, lenience, p, q, p1=None, q1=None, xp=jnp):
    """pi [..., V]: the law rule `rule` at lenience a makes the round sample from.

    p, q [..., V]: the target's and the draft's transformed distributions (what pi mixes); p1,
    q1 [..., V]: the same at T = 1 (what the rule reads; default p, q). xp: jax.numpy (traced a
    allowed) or numpy.
    """
    if rule not in CASCADE_RULES:
        raise ValueError(f'target_law: rule must be one of {CASCADE_RULES}, got {rule!r}')
    p1, q1, a = (p if p1 is None else p1), (q if q1 is None else q1), lenience
    max_p, max_q = p1.max(-1, keepdims=True), q1.max(-1, keepdims=True)
    if rule in DEFERRAL_RULES:
        if rule == 'cascade_chow':
            bar = 1.0 - a
        elif rule == 'cascade_diff':
            bar = max_p - a
        else:
            bar = max_p - a * 0.5 * xp.abs(p1 - q1).sum(-1, keepdims=True)
        pi = xp.where(max_q >= bar, q, p)
    else:
        accepted = {
            'cascade_token_v1': lambda: q1 >= max_p - a,
            'cascade_token_v2': lambda: p1 >= max_p - a,
            'cascade_token_v3': lambda: p1 >= (1.0 - a) * max_p,
        }[rule]()
        outside = xp.where(accepted, 0.0, q).sum(-1, keepdims=True)
        pi = xp.where(accepted, q, 0.0) + outside * p
    return xp.where(a <= EXACT_END, p, xp.where(a >= DRAFT_END, q, pi))


def verify_round(rule: str, lenience, logits_BKV, q_BK2V, x_BK, noise_BK, sampling):
    """One chain round of K = k + 1 proposals against pi -> (num_accepted [B] in [0, k], next
    token [B]).

    logits_BKV [B, K, V]: the target's logits at positions 1..K; q_BK2V [B, K, 2, V]: per
    proposal the transformed q it was drawn from and the draft's T = 1 law (proposals.propose);
    x_BK [B, K]; noise_BK [B, K + 1] U[0, 1): K acceptance tests, then the residual's draw.
    lenience: a, a traced float32 scalar (the program's run-time value) or a number.
    """
    p1 = jax.nn.softmax(logits_BKV, axis=-1)
    q1 = q_BK2V[:, :, 1]

    def against(p, q, noise):
        pi = target_law(rule, lenience, p, q, p1, q1)
        at = lambda a_BKV: jnp.take_along_axis(a_BKV, x_BK[..., None], axis=-1)[..., 0]
        k = x_BK.shape[1] - 1
        n = leading_true(noise[:, : k + 1] * at(q) < at(pi))
        stop = jnp.minimum(n, k)
        drawn = inverse_cdf(residual(take_position(pi, stop), take_position(q, stop)), noise[:, -1])
        return stop, jnp.where(n > k, x_BK[:, k], drawn)

    def sampled(logits):
        return against(transform_logits(logits, sampling), q_BK2V[:, :, 0], noise_BK)

    def greedy(logits):  # one-hot p and q; noise 0: keep iff pi(x) > 0, emit pi's token
        vocab = logits.shape[-1]
        p = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
        return against(p, jax.nn.one_hot(x_BK, vocab, dtype=jnp.float32), 0.0 * noise_BK)

    return branch(is_greedy(sampling), greedy, sampled, logits_BKV)


def with_lenience(sampler, lenience):
    """A cascade sampler from make_speculative_fn at lenience a instead: the same jit and
    compiled programs (a is a run-time value). ValueError for a sampler of another rule."""
    a = check_lenience(lenience, 'with_lenience: lenience')
    values = getattr(sampler, 'values', None)
    if not isinstance(values, tuple) or len(values) != 4:
        raise ValueError('with_lenience: needs a sampler of a cascade acceptance rule')
    return sampler.with_values((*values[:3], np.float32(a)))


def bind_lenience(program, lenience: float):
    """make_speculative_fn's cascade program with a bound after its sampling, Stop and task
    values (the task None when there is none)."""
    sampling, stop, *task = program.values
    return program.with_values((sampling, stop, task[0] if task else None, np.float32(lenience)))


def lenience_of(values):
    """The lenience a cascade sampler's bound values carry (ValueError when missing)."""
    if len(values) != 4:
        raise ValueError('a cascade sampler needs its lenience bound (cascade.bind_lenience)')
    return values[3]
