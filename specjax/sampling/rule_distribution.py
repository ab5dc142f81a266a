"""Exact output distributions of the acceptance rules, by enumeration (NumPy, float64), and each
rule's per-position acceptance probability.

Within a round every emitted token comes from the same one-step kernel of its context's p and q,
except the bonus after k kept proposals, which is a sample of p. So a rule's output is fixed by
`step_kernel` (the kept-proposal and replacement parts of one position's output) and the chain
length k, and `rule_joint` enumerates the joint of the first m tokens over every context from
per-context p and q alone. `tv_from_target` is the rules' distance from the target; for exact
rules it is 0 up to rounding, which the tests check against the target's own joint.

The kept part's mass is the rule's acceptance probability alpha (sum_x q(x) keep(x)):
`acceptance_probability` is that one function, for NumPy and for jax.numpy (jitted callers such
as stats.alpha_per_position), and every prediction from alpha (E[tau], speedup, optimal k) uses
it. Per rule: probabilistic sum min(p, q); argmax_draft p(argmax q); strict sum p q;
lenient(eps) sum min(p / eps, q); typical sum_x q(x) [p(x) > min(threshold, a exp(-H(p)))];
a cascade sum min(pi, q), pi its law (specjax.sampling.cascade.target_law, read here from the same
p and q: the sampler's rule reads the T = 1 laws, the same ones at T = 1 without top-k / top-p).
A cascade's kernel and bonus both emit pi, so its joint is pi's chain rule, whatever k.
"""

from __future__ import annotations

import numpy as np

from specjax.sampling.acceptance import Acceptance, as_acceptance
from specjax.sampling.cascade import target_law

_EPS = 1e-7  # the samplers' residual fallback threshold (verify.RESIDUAL_EPS)


def _normalise_or(r, fallback):
    mass = r.sum(-1, keepdims=True)
    return np.where(mass >= _EPS, r / np.where(mass >= _EPS, mass, 1.0), fallback)


def _proposal_and_keep(p, q, acc: Acceptance, xp):
    """(q' [..., V] the distribution proposals are drawn from, keep [..., V] = P(keep | x)) of
    rule `acc`, in array module xp (numpy or jax.numpy); the sampler's side is
    acceptance.verify_rule (and speculative's argmax proposal)."""
    if acc.rule == 'argmax_draft':
        q = (xp.arange(q.shape[-1]) == xp.argmax(q, -1)[..., None]).astype(p.dtype)
    p = _law(p, q, acc, xp)  # a cascade: verified exactly against its pi
    safe_q = xp.where(q > 0, q, 1.0)
    if acc.rule in ('probabilistic', 'argmax_draft', 'lenient') or acc.cascade:
        eps = acc.lenience if acc.rule == 'lenient' else 1.0
        keep = xp.where(q > 0, xp.minimum(1.0, p / (eps * safe_q)), 0.0)
    elif acc.rule == 'strict':
        keep = p
    else:  # typical
        logp = xp.log(xp.where(p > 0, p, 1.0))
        ent = -(p * logp).sum(-1, keepdims=True)
        cut = xp.minimum(acc.typical_threshold, acc.typical_alpha * xp.exp(-ent))
        keep = (p > cut).astype(p.dtype)
    return q, keep


def _law(p, q, acc: Acceptance, xp=np):
    """The law a rule verifies against: a cascade's pi, else the target's p."""
    return target_law(acc.rule, acc.cascade_lenience, p, q, xp=xp) if acc.cascade else p


def acceptance_probability(p, q, acceptance: Acceptance | str = 'probabilistic', xp=np):
    """alpha [...]: P(a proposal is kept) at one position under `acceptance`, = step_kernel's
    kept.sum(-1). p, q [..., V] the transformed target and draft distributions (q as the draft
    samples from: argmax_draft takes its argmax here); xp: numpy (float64 in, float64 out) or
    jax.numpy (traceable: for jitted code). Clipped to [0, 1]: a rule that keeps every proposal
    (lenient, typical) sums q, which rounding can put a few ulp above 1."""
    acc = as_acceptance(acceptance)
    if xp is np:
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if p.shape != q.shape:
        raise ValueError(f'acceptance_probability: p {p.shape} and q {q.shape} differ in shape')
    q, keep = _proposal_and_keep(p, q, acc, xp)
    return xp.clip((q * keep).sum(-1), 0.0, 1.0)


def step_kernel(p, q, acceptance: Acceptance | str = 'probabilistic'):
    """One position's output split in two: (kept [..., V], replaced [..., V]), summing to a dist.

    kept[y] = P(the proposal is y and is kept); replaced[y] = P(a proposal is rejected and the
    replacement is y). p, q [..., V] are the transformed target and draft distributions.
    kept.sum(-1) is `acceptance_probability`.
    """
    acc = as_acceptance(acceptance)
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    q, keep = _proposal_and_keep(p, q, acc, np)
    kept = q * keep
    reject_x = q * (1.0 - keep)  # [..., V]: P(proposal x, rejected)
    if acc.rule == 'strict':
        # Rejected x emits y ~ p given y != x: sum_x q(x)(1 - p(x)) p(y)[y != x] / (1 - p(x)).
        replaced = p * (1.0 - q)
    elif acc.rule == 'typical':
        replaced = reject_x.sum(-1, keepdims=True) * p
    else:  # the residual; for argmax_draft (q one-hot) it is p without x, renormalised
        law = _law(p, q, acc)
        replaced = reject_x.sum(-1, keepdims=True) * _normalise_or(np.maximum(law - q, 0), law)
    return kept, replaced


def output_distribution(p, q, acceptance='probabilistic'):
    """[..., V]: the distribution of a token emitted by the one-step kernel (no bonus)."""
    kept, replaced = step_kernel(p, q, acceptance)
    return kept + replaced


def rule_joint(p_ctx, q_ctx, k: int, acceptance='probabilistic'):
    """Exact joint [V]*m of the first m tokens a chain of k proposals emits under `acceptance`.

    p_ctx, q_ctx: [V]*(m-1) + [m, V]; entry (t_1..t_{m-1}, i) is the distribution at position i
    after the prompt and t_1..t_i (later indices ignored), as `truth` in the tests builds it.
    The state carried along is how many proposals of the current round have been kept so far.
    """
    p_ctx, q_ctx = np.asarray(p_ctx, np.float64), np.asarray(q_ctx, np.float64)
    acc = as_acceptance(acceptance)
    m, vocab = p_ctx.shape[-2:]
    # mass[j]: [V]*i joint of the first i tokens with j proposals of the current round kept.
    mass = [np.ones(())] + [np.zeros(())] * k
    for i in range(m):
        index = (slice(None),) * i + (0,) * (m - 1 - i) + (i,)
        p, q = p_ctx[index], q_ctx[index]  # [V]*i + [V]
        kept, replaced = step_kernel(p, q, acc)
        new = [np.zeros((vocab,) * (i + 1)) for _ in range(k + 1)]
        for j in range(k + 1):
            if j == k:  # bonus token: a sample of p (a cascade's: of pi), the round ends
                new[0] = new[0] + mass[j][..., None] * _law(p, q, acc)
                continue
            new[j + 1] = new[j + 1] + mass[j][..., None] * kept
            new[0] = new[0] + mass[j][..., None] * replaced
        mass = new
    return sum(mass)


def tv_from_target(p_ctx, q_ctx, k: int, acceptance, target_joint=None):
    """Total-variation distance between the rule's joint of m tokens and the target's."""
    joint = rule_joint(p_ctx, q_ctx, k, acceptance)
    if target_joint is None:
        target_joint = target_joint_of(p_ctx)
    return 0.5 * float(np.abs(joint - target_joint).sum())


def target_joint_of(p_ctx):
    """The target's joint [V]*m from the same per-context table (chain rule)."""
    p_ctx = np.asarray(p_ctx, np.float64)
    m = p_ctx.shape[-2]
    joint = np.ones(())
    for i in range(m):
        index = (slice(None),) * i + (0,) * (m - 1 - i) + (i,)
        joint = joint[..., None] * p_ctx[index]
    return joint
