"""How a token tree's siblings are drawn at T > 0 and what each sibling is tested against.

Children of one node are drawn from the node's draft distribution q in rank order, either
- 'iid': independently, with replacement (SpecInfer): every child is tested against the same q,
  so a node with three children often spends two on the same token; or
- 'without_replacement' (the default): child r is drawn from q with the tokens of children
  0..r-1 removed and renormalised (q_r), so siblings are distinct. Verification is then recursive
  rejection sampling (Jeon et al. 2024): child r, drawn from q_r, is accepted with probability
  min(1, p_r(x) / q_r(x)) where p_r is the residual after the rejected siblings, and on
  rejection p_{r+1} = norm(max(0, p_r - q_r)). Given the earlier siblings, child r's law is q_r
  whatever they were, so each test is one exact speculative step from q_r towards p_r and by
  induction the emitted token follows p. A child whose q_r has no mass left (q's support is
  exhausted, e.g. top-k below the sibling count) is never tested.
Testing without-replacement siblings against the fixed q is biased (tests/test_tree.py's negative
control). At T = 0 siblings are the draft's top-ranked tokens either way (`top_ranked`), and so
they are at every T under the `argmax_draft` rule and in dynamic trees.
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.sampling.transforms import inverse_cdf

SIBLING_RULES = ('without_replacement', 'iid')
_EMPTY = 1e-12  # a q_r with less mass than this is exhausted


def check_siblings(siblings: str) -> str:
    if siblings not in SIBLING_RULES:
        raise ValueError(f'siblings must be one of {SIBLING_RULES}, got {siblings!r}')
    return siblings


def draw_children(q_BWV, parents, ranks, uniform_BC, siblings: str):
    """Tokens [B, C] of one level's C children; parents / ranks (numpy [C]) index the W nodes of
    q_BWV and give each child's rank among its siblings."""
    if siblings == 'iid':
        return inverse_cdf(q_BWV[:, parents], uniform_BC)
    batch = q_BWV.shape[0]
    used = jnp.zeros(q_BWV.shape, bool)  # [B, W, V]: tokens taken by earlier siblings
    tokens = jnp.zeros(uniform_BC.shape, jnp.int32)
    for r in range(int(ranks.max()) + 1):
        (idx,) = (ranks == r).nonzero()  # one child per parent at each rank
        q_r = jnp.where(used[:, parents[idx]], 0.0, q_BWV[:, parents[idx]])
        x = inverse_cdf(q_r, uniform_BC[:, idx])
        tokens = tokens.at[:, idx].set(x)
        used = used.at[jnp.arange(batch)[:, None], parents[idx][None, :], x].set(True)
    return tokens


def remaining(q_BV, x_B, siblings: str):
    """The next sibling's proposal distribution after x was tested and rejected: q itself for
    'iid', q without x renormalised for 'without_replacement' (zeros if nothing is left)."""
    if siblings == 'iid':
        return q_BV
    q = jnp.where(jnp.arange(q_BV.shape[-1])[None, :] == x_B[:, None], 0.0, q_BV)
    mass = q.sum(-1, keepdims=True)
    return jnp.where(mass > _EMPTY, q / jnp.where(mass > _EMPTY, mass, 1.0), 0.0)


def has_mass(q_BV):
    """[B]: whether q_BV can still propose (an exhausted without-replacement q cannot)."""
    return q_BV.sum(-1) > _EMPTY


def top_ranked(logits_BWV, top: int):
    """int32 [B, W, top]: the `top` largest logits' indices, largest first, ties by lower index
    (lax.top_k's order). `top` argmax passes: XLA's CPU top_k sorts the whole vocabulary."""
    ranked, logits = [], logits_BWV
    for _ in range(top):
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        ranked.append(best)
        logits = jnp.where(jnp.arange(logits.shape[-1]) == best[..., None], -jnp.inf, logits)
    return jnp.stack(ranked, axis=-1)
