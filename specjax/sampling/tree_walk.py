"""Verifying a drafted token tree: the per-row tree a round drafted, its attention mask, the
verification walk of every exact tree rule, and the KV compaction of the accepted path.

A `DraftedTree` is what a round's drafting hands to verification, the same for static trees
(specjax.sampling.tree: the shape fixed, every row alike) and dynamic ones
(specjax.sampling.dynamic_tree: the shape chosen per round and row from the draft's
confidence). Nodes are numbered 1..N with every parent before its children; 0 is the root (the
context's last token).

The walk (SpecInfer, Miao et al. ASPLOS 2024, Alg. 2, the tree form of Leviathan et al. 2023)
starts at the root; at node u with target distribution p = p_u it tests u's children in their
order; the first accepted child becomes u and the walk descends; when every child is rejected the
round emits a sample of the last residual p (at a node without children, a sample of p_u: the
bonus token). Per rule, child c with token x:
- 'probabilistic': x was drawn from the draft's q_u (siblings i.i.d. or without replacement,
  specjax.sampling.siblings); accepted with min(1, p(x) / q(x)); on rejection p <- norm(max(0,
  p - q)) and, without replacement, q <- q without x renormalised (recursive rejection sampling).
- 'argmax_draft': the children are a deterministic function of the draft (its top-ranked
  tokens, distinct); accepted with probability p(x); on rejection p <- p without x renormalised.
  Testing c_1, c_2, ... this way and emitting a sample of the last p is sequential sampling from
  p_u, so the emitted token follows p_u whatever the draft (multi-candidate `argmax_draft`).
- 'strict': the target draws y ~ p_u once per node and descends into the child whose token is
  y, else emits y: the emitted token is a fresh sample of p_u.
Greedy (T = 0): descend into the child equal to argmax p_u, else emit argmax p_u. Below the
accepted child the tree is a function of the prefix alone, so by induction every emitted token
follows the target's law.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.kv_cache import gather_window, map_layers
from specjax.sampling import siblings as sib
from specjax.sampling.transforms import inverse_cdf
from specjax.sampling.verify import residual

TREE_RULES = ('probabilistic', 'argmax_draft', 'strict')


@struct.dataclass
class DraftedTree:
    """One round's tree per row (B rows, N nodes, R = most children a node may have, F = the
    draft's fed nodes).

    tokens_BN int32 [B, N]: node i + 1's token (target ids). depth_BN1 int32 [B, N + 1]: each
    node's depth (root 0). ancestor_BNN bool [B, N + 1, N + 1]: [b, i, j] iff j is i or one of
    its ancestors. children_BNR int32 [B, N + 1, R]: each node's children in test order (-1
    padded). fed_slot_BN1 int32 [B, N + 1]: the draft-cache slot (entry base + slot) of the
    node's own entry, -1 when the draft did not feed it (root: -1). q_BFV [B, F + 1, V] or None:
    the draft's distribution at the root (index 0) and at fed slot s (index s + 1), over the
    target vocabulary; only 'probabilistic' verification reads it. state_BN1 int32 [B, N + 1] or
    None: under a grammar, each node's automaton state after its path (the root's: the row's).
    """

    tokens_BN: jax.Array
    depth_BN1: jax.Array
    ancestor_BNN: jax.Array
    children_BNR: jax.Array
    fed_slot_BN1: jax.Array
    q_BFV: Any = None
    state_BN1: Any = None


def tree_mask(ancestor_BNM, lengths_B, capacity: int):
    """[B, N, capacity]: query node i of row b sees the committed prefix (keys < lengths[b]) and
    the key at lengths[b] + j iff ancestor[b, i, j] (its ancestors and itself). ancestor_BNM is
    per row [B, N, M] or one table [N, M] for every row."""
    batch = lengths_B.shape[0]
    anc = jnp.asarray(ancestor_BNM)
    if anc.ndim == 2:
        anc = jnp.broadcast_to(anc, (batch, *anc.shape))
    n, m = anc.shape[1:]
    rel = jnp.arange(capacity)[None, :] - lengths_B[:, None]  # [B, C]
    inside = (rel >= 0) & (rel < m)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, m - 1)[:, None, :], (batch, n, capacity))
    tree_part = jnp.take_along_axis(anc, idx, axis=2)  # [B, N, C]
    return (rel < 0)[:, None, :] | (inside[:, None, :] & tree_part)


def walk(tree: DraftedTree, p_BNV, uniform_BN1, uniform_B, *, depth: int, greedy: bool,
         rule: str, siblings: str = 'without_replacement', bug=None):  # fmt: skip
    """The verification walk -> (path [B, D] accepted node ids (0 past the end), accepted [B],
    next token [B], tested [B, D] whether depth d + 1 was tested).

    p_BNV: target distributions at the root and every node [B, N + 1, V] (logits when greedy).
    uniform_BN1 [B, N + 1]: column c tests child c (column u is node u's own draw under
    'strict'); uniform_B draws the emitted token. `bug` (negative controls of the
    'probabilistic' rule): 'stale_residual', 'unmodified_p' or 'fixed_q'
    (specjax.sampling.tree_speculative).
    """
    batch = p_BNV.shape[0]
    rows = jnp.arange(batch)
    node = jnp.zeros((batch,), jnp.int32)
    alive = jnp.ones((batch,), bool)
    stop = jnp.zeros(p_BNV.shape[::2], p_BNV.dtype)  # [B, V]: the emitting distribution
    best = jnp.argmax(p_BNV, -1).astype(jnp.int32)
    stop_tok = jnp.zeros((batch,), jnp.int32)
    tok = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tree.tokens_BN], axis=1)
    draw = lambda at: inverse_cdf(p_BNV[rows, at], uniform_BN1[rows, at])  # 'strict': y ~ p_at
    path, tested = [], []
    for _ in range(depth):
        kids = tree.children_BNR[rows, node]  # [B, R]
        tested.append(alive & (kids[:, 0] >= 0))
        p_u = p_BNV[rows, node]
        p_cur, found, chosen = p_u, jnp.zeros_like(alive), node
        if rule == 'probabilistic' and not greedy:
            q_u = q_cur = tree.q_BFV[rows, tree.fed_slot_BN1[rows, node] + 1]
        y = best[rows, node] if greedy else draw(node) if rule == 'strict' else None
        for r in range(kids.shape[1]):
            c = kids[:, r]
            valid = alive & ~found & (c >= 0)
            x = tok[rows, jnp.maximum(c, 0)]
            u = uniform_BN1[rows, jnp.maximum(c, 0)]
            if y is not None:
                ok = x == y
            elif rule == 'argmax_draft':
                ok = u < p_cur[rows, x]
                rejected = (valid & ~ok)[:, None]
                p_cur = jnp.where(rejected, sib.remaining(p_cur, x, 'without_replacement'), p_cur)
            else:
                valid = valid & sib.has_mass(q_cur)  # an exhausted q proposes nothing
                p_test = p_cur if bug in (None, 'fixed_q') else p_u
                ok = u * q_cur[rows, x] < p_test[rows, x]
                rejected = (valid & ~ok)[:, None]
                if bug in (None, 'fixed_q'):
                    p_cur = jnp.where(rejected, residual(p_cur, q_cur), p_cur)
                elif bug == 'stale_residual':
                    p_cur = jnp.where(rejected, residual(p_u, q_u), p_cur)
                if bug != 'fixed_q':
                    q_cur = jnp.where(rejected, sib.remaining(q_cur, x, siblings), q_cur)
            chosen = jnp.where(valid & ok, c, chosen)
            found = found | (valid & ok)
        stopping = alive & ~found
        stop = jnp.where(stopping[:, None], p_cur, stop)
        if y is not None:
            stop_tok = jnp.where(stopping, y, stop_tok)
        alive, node = alive & found, jnp.where(found, chosen, node)
        path.append(jnp.where(alive, node, 0))
    stop = jnp.where(alive[:, None], p_BNV[rows, node], stop)  # bonus past a depth-D leaf
    if greedy:
        stop_tok = jnp.where(alive, best[rows, node], stop_tok)
    elif rule == 'strict':
        stop_tok = jnp.where(alive, draw(node), stop_tok)
    path = jnp.stack(path, axis=1)
    accepted = jnp.sum(path > 0, axis=1).astype(jnp.int32)
    nxt = stop_tok if greedy or rule == 'strict' else inverse_cdf(stop, uniform_B)
    return path, accepted, nxt, jnp.stack(tested, axis=1)


def compact(cache, starts_B, order_BW):
    """Rewrites each row's W entries from starts[b] as starts[b] + order[b, :] (kv_cache)."""
    return map_layers(lambda c, axis: gather_window(c, starts_B, order_BW, axis), cache)
