"""Acceptance rules for speculative verification: which proposals a round keeps, and what it emits.

Every rule is a per-position kernel: the draft proposes x from `proposal(q)`, the target keeps it
with some probability, and at the first rejection the round emits a replacement; after k kept
proposals it emits a bonus sample of p_{k+1}. p and q are the transformed (SamplingConfig)
float32 distributions.

- `probabilistic` (Leviathan et al. 2023, Alg. 1): x ~ q, keep with min(1, p(x)/q(x)), replace
  with norm(max(0, p - q)). Exact.
- `argmax_draft` (vLLM V1's draft-by-argmax): x = argmax q, i.e. q one-hot, so keep with p(x) and
  replace with p without x, renormalised. Exact; lower acceptance at T > 0.
- `strict`: x ~ q; the target draws its own y ~ p and keeps x iff y == x, emitting y otherwise.
  Exact (every emitted token is a fresh sample of p).
- `lenient` (DistillSpec, Zhou et al. ICLR 2024, Sec. 5 "lossy speculative decoding", after
  Leviathan et al. 2023 App. A.5): x ~ q, keep with min(1, f(p(x), eps) / q(x)) for the linear
  lenience f(p, eps) = p / eps, eps = `lenience` in (0, 1]; replace with norm(max(0, p - q)).
  eps = 1 is `probabilistic`; smaller eps keeps more and is lossy.
- `typical` (Medusa, Cai et al. ICML 2024, Sec. 2.3.1 "typical acceptance"): x ~ q, keep iff
  p(x) > min(threshold, alpha * exp(-H(p))); replace with a fresh sample of p. Lossy.
- `cascade_*` (speculative cascades, Narasimhan et al. ICLR 2025; specjax.sampling.cascade): exact
  speculative sampling against a law pi mixed from q and p by a deferral rule, `cascade_lenience`
  a in [-1, 1] from exact (-1) to the draft alone (1). Lossy by design; chains only.

At temperature 0 every rule reduces to greedy verification (keep while x == argmax p).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp

from specjax.sampling.cascade import CASCADE_RULES, check_lenience
from specjax.sampling.transforms import inverse_cdf
from specjax.sampling.verify import leading_true, residual, take_position

RULES = ('probabilistic', 'argmax_draft', 'strict', 'lenient', 'typical') + CASCADE_RULES
EXACT_RULES = ('probabilistic', 'argmax_draft', 'strict')


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """An acceptance rule by name and its parameters (only the named rule's are used).

    lenience: `lenient`'s eps in (0, 1] (1 = exact). typical_threshold in (0, 1] and
    typical_alpha > 0: `typical`'s hard threshold and entropy factor (Medusa's defaults).
    cascade_lenience in [-1, 1]: a cascade rule's knob (-1 = exact, 1 = the draft alone).
    """

    rule: str = 'probabilistic'
    lenience: float = 0.5
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3
    cascade_lenience: float = 0.0

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f'acceptance rule must be one of {RULES}, got {self.rule!r}')
        for name, lo, hi in (
            ('lenience', 0.0, 1.0),
            ('typical_threshold', 0.0, 1.0),
            ('typical_alpha', 0.0, float('inf')),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not lo < v <= hi:
                raise ValueError(f'Acceptance.{name} must be in ({lo}, {hi}], got {v!r}')
            object.__setattr__(self, name, float(v))
        a = check_lenience(self.cascade_lenience, 'Acceptance.cascade_lenience')
        object.__setattr__(self, 'cascade_lenience', a)

    @property
    def exact(self) -> bool:
        return self.rule in EXACT_RULES

    def without_lenience(self) -> Acceptance:
        """This rule with a cascade's lenience at 0: the compiled program's part (the
        samplers take a cascade's lenience as a run-time value)."""
        return dataclasses.replace(self, cascade_lenience=0.0) if self.cascade else self

    @property
    def cascade(self) -> bool:
        """A speculative cascade: verified by cascade.verify_round, k + 1 proposals a round."""
        return self.rule in CASCADE_RULES

    @property
    def label(self) -> str:
        if self.rule == 'lenient':
            return f'lenient(eps={self.lenience:g})'
        if self.rule == 'typical':
            return f'typical(eps={self.typical_threshold:g}, a={self.typical_alpha:g})'
        if self.cascade:
            return f'{self.rule}(a={self.cascade_lenience:g})'
        return self.rule


def as_acceptance(acceptance) -> Acceptance:
    """An Acceptance from a rule name, a dict of fields, or an Acceptance (checked here)."""
    if isinstance(acceptance, Acceptance):
        return acceptance
    if isinstance(acceptance, str):
        return Acceptance(acceptance)
    if isinstance(acceptance, dict) or hasattr(acceptance, 'items'):
        d = dict(acceptance)
        names = {f.name for f in dataclasses.fields(Acceptance)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f'Unknown Acceptance field(s) {unknown}; known: {sorted(names)}')
        return Acceptance(**d)
    raise ValueError(f'acceptance must be a rule name, dict or Acceptance, got {acceptance!r}')


def _at(a_BKV, x_BK):
    return jnp.take_along_axis(a_BKV, x_BK[..., None], axis=-1)[..., 0]


def entropy(p_V):
    """Shannon entropy (nats) over the last axis; 0 log 0 = 0."""
    return -jnp.sum(jnp.where(p_V > 0, p_V * jnp.log(jnp.where(p_V > 0, p_V, 1.0)), 0.0), -1)


def verify_rule(acc: Acceptance, uniform_BK, uniform_B, p_BKV, q_BKV, x_BK):
    """Stochastic verification of k proposals under rule `acc` -> (num_accepted [B], next [B]).

    p_BKV [B, k+1, V] target probs at positions 1..k+1; q_BKV [B, k, V] the draft probs x_BK
    was proposed from (one-hot for `argmax_draft`); uniform_BK, uniform_B independent U[0, 1).
    """
    if acc.cascade:
        raise ValueError(f'{acc.rule} verifies through specjax.sampling.cascade.verify_round')
    k = x_BK.shape[1]
    p_x, q_x = _at(p_BKV[:, :k], x_BK), _at(q_BKV, x_BK)
    if acc.rule == 'strict':
        y_BK = inverse_cdf(p_BKV[:, :k], uniform_BK)
        n = leading_true(y_BK == x_BK)
        bonus = inverse_cdf(p_BKV[:, k], uniform_B)
        stop = jnp.take_along_axis(y_BK, jnp.minimum(n, k - 1)[:, None], axis=1)[:, 0]
        return n, jnp.where(n < k, stop, bonus)
    if acc.rule == 'typical':
        p_k = p_BKV[:, :k]
        cut = jnp.minimum(acc.typical_threshold, acc.typical_alpha * jnp.exp(-entropy(p_k)))
        n = leading_true(p_x > cut)
        return n, inverse_cdf(take_position(p_BKV, n), uniform_B)
    eps = acc.lenience if acc.rule == 'lenient' else 1.0
    n = leading_true(uniform_BK * q_x * eps < p_x)
    at = jnp.minimum(n, k - 1)
    dist = jnp.where(
        (n < k)[:, None], residual(take_position(p_BKV, at), take_position(q_BKV, at)), p_BKV[:, k]
    )
    return n, inverse_cdf(dist, uniform_B)
