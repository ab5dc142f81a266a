"""Drafting a dynamic token tree (EAGLE-2, Li et al. EMNLP 2024) per round and row.

Given a `DynamicTree(depth=D, expand=m, nodes=N)` budget: after the catch-up the root's m most
probable draft tokens form depth 1; for each depth d < D the draft feeds the m frontier nodes of
depth d in one cached call (ancestor-only mask over the fed nodes, position = prefix length + d)
and each proposes its m most probable tokens; the m candidates of depth d + 1 with the highest
cumulative draft log-probability (the sum over the node's path) are the next frontier. Of all
M = m + (D - 1) m^2 candidates the N of highest cumulative log-probability are verified
(numbered by drafting order, so parents come before children; a child's score never exceeds its
parent's and ties keep the lower, earlier index, so the chosen set holds every chosen node's
ancestors). Each node's children are tested in order of decreasing score.

Scores are the draft's log-probabilities at the sampling temperature (1 when greedy), before
top-k / top-p. Every candidate and the whole selection are deterministic functions of the draft,
so the tree is verified with the multi-candidate `argmax_draft` rule (or `strict`), which keeps
the target's law for any draft-only choice of tree (specjax.sampling.tree_walk). Testing these
candidates with the p/q ratio, as if they had been sampled, is biased (the `ratio_test` negative
control). All shapes are static; rows differ only in values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import drafters, guards
from specjax.sampling.draft_vocab import DraftVocab
from specjax.sampling.siblings import top_ranked
from specjax.sampling.transforms import SamplingConfig, transform_logits
from specjax.sampling.tree import DynamicTree
from specjax.sampling.tree_walk import DraftedTree, tree_mask


def depths(spec: DynamicTree) -> np.ndarray:
    """int [M]: each candidate's depth, in drafting order."""
    m = spec.expand
    return np.array([1] * m + [d for d in range(2, spec.depth + 1) for _ in range(m * m)])


def draft_dynamic(dgd, dparams, state, active, *, spec: DynamicTree, sampling: SamplingConfig,
                  vocab: DraftVocab, check_finite: bool, keep_q: bool = False,
                  drafter=drafters.TOKEN_DRAFTER, con=None):  # fmt: skip
    """Catch-up and D - 1 level calls -> (DraftedTree with N nodes, draft cache with the F fed
    nodes written after the context and its lengths at the context, whether an active row's
    draft logits were non-finite). keep_q: also return q at the root and fed nodes (the
    negative control's ratio test reads it). Under a task (`con`, constrain.Constraint) each
    node's draft logits are masked at its automaton state, which the tree carries."""
    m, depth = spec.expand, spec.depth
    fed = spec.num_fed
    batch = active.shape[0]
    rows = jnp.arange(batch)[:, None]
    scale = sampling.temperature if sampling.temperature > 0 else 1.0
    logits, carry = drafter.catch_up(dgd, dparams, state, active, vocab)
    dcache, h_root = drafter.split_carry(carry)  # h: output states (feature drafts)
    bad = guards.any_nonfinite(logits, active, check_finite)
    base = dcache.lengths
    level = vocab.restrict(logits)[:, None]  # [B, 1, Vd]: the root
    task = con is not None
    if task:
        root_g = state.task.grammar[:, None]
        level = con.draft_logits(level, vocab, root_g, state.emitted[:, None])
    qs = [vocab.expand(transform_logits(level, sampling))] if keep_q else []
    score = jax.nn.log_softmax(level / scale, axis=-1)
    tok = top_ranked(score, m)[:, 0]  # [B, m] draft indices
    front_score = jnp.take_along_axis(score[:, 0], tok, axis=1)
    pool_tok, pool_score = [tok], [front_score]
    front_g = con.advance(jnp.repeat(root_g, m, axis=1), vocab.token(tok)) if task else None
    pool_g = [front_g]
    pool_parent = [jnp.zeros((batch, m), jnp.int32)]  # pool ids: 0 the root, candidate i at i+1
    first_fed = jnp.arange(m, dtype=jnp.int32) if depth > 1 else jnp.full((m,), -1, jnp.int32)
    pool_fed = [jnp.broadcast_to(first_fed, (batch, m))]
    front, front_tok = jnp.broadcast_to(jnp.arange(1, m + 1), (batch, m)), tok
    front_anc = jnp.broadcast_to(jnp.eye(m, fed, dtype=bool), (batch, m, fed))
    parent_h = None if h_root is None else jnp.repeat(h_root[:, None], m, axis=1)
    for d in range(1, depth):  # feed depth d's frontier, draft depth d + 1
        cache = dcache.replace(lengths=base + (d - 1) * m)
        mask = tree_mask(front_anc, base, dcache.capacity)
        positions = jnp.broadcast_to(base[:, None] - 1 + d, (batch, m))
        out, h, dcache = drafter.level(
            dgd, dparams, cache, vocab.token(front_tok), parent_h, positions, mask, vocab
        )
        bad = bad | guards.any_nonfinite(out, active, check_finite)
        level = vocab.restrict(out)  # [B, m, Vd]
        if task:
            level = con.draft_logits(level, vocab, front_g, state.emitted[:, None] + d)
        if keep_q:
            qs.append(vocab.expand(transform_logits(level, sampling)))
        score = jax.nn.log_softmax(level / scale, axis=-1)
        kids = top_ranked(score, m)  # [B, m, m]
        kid_score = front_score[:, :, None] + jnp.take_along_axis(score, kids, axis=-1)
        flat_score, flat_tok = kid_score.reshape(batch, m * m), kids.reshape(batch, m * m)
        if task:
            pool_g.append(con.advance(jnp.repeat(front_g, m, axis=1), vocab.token(flat_tok)))
        pool_tok.append(flat_tok)
        pool_score.append(flat_score)
        pool_parent.append(jnp.repeat(front, m, axis=1))
        start = 1 + m + (d - 1) * m * m  # pool id of this block's first candidate
        block_fed = -jnp.ones((batch, m * m), jnp.int32)
        if d + 1 < depth:
            front_score, sel = jax.lax.top_k(flat_score, m)  # ties: the lower index first
            slots = d * m + jnp.arange(m)
            block_fed = block_fed.at[rows, sel].set(slots[None])
            front, front_tok = start + sel, jnp.take_along_axis(flat_tok, sel, axis=1)
            front_g = jnp.take_along_axis(pool_g[-1], sel, axis=1) if task else None
            parent_anc = jnp.take_along_axis(front_anc, (sel // m)[:, :, None], axis=1)
            front_anc = parent_anc | (jnp.arange(fed)[None, None, :] == slots[None, :, None])
            if h is not None:
                parent_h = jnp.take_along_axis(h, (sel // m)[:, :, None], axis=1)
        pool_fed.append(block_fed)
    dcache = dcache.replace(lengths=base)
    cat = lambda xs: jnp.concatenate(xs, axis=1)
    tree, chosen = select(
        spec, cat(pool_tok), cat(pool_score), cat(pool_parent), cat(pool_fed), vocab
    )
    if task:  # the root's state, then each chosen node's
        chosen_g = jnp.take_along_axis(cat(pool_g), chosen, axis=1)
        tree = tree.replace(state_BN1=jnp.concatenate([root_g, chosen_g], axis=1))
    return tree.replace(q_BFV=cat(qs) if keep_q else None), dcache, bad


def select(spec: DynamicTree, tok_BM, score_BM, parent_BM, fed_BM, vocab: DraftVocab):
    """(The DraftedTree of the N highest-scoring of M candidates (draft indices tok_BM, pool-id
    parents parent_BM, fed slots fed_BM), int32 [B, N]: the candidates chosen, in node order)."""
    n, m = spec.nodes, spec.expand
    batch = tok_BM.shape[0]
    rows = jnp.arange(batch)[:, None]
    _, by_score = jax.lax.top_k(score_BM, n)  # [B, N] best first, ties: the lower index
    order = jnp.argsort(by_score, axis=1)
    chosen = jnp.take_along_axis(by_score, order, axis=1)  # drafting order: parents first
    priority = order  # node i + 1 is by_score[order[i]]: its rank by score is order[i]
    node_of = jnp.zeros((batch, score_BM.shape[1] + 1), jnp.int32)  # pool id -> node id (0 root)
    node_of = node_of.at[rows, chosen + 1].set(jnp.arange(1, n + 1)[None])
    parent = jnp.take_along_axis(node_of, jnp.take_along_axis(parent_BM, chosen, axis=1), axis=1)
    parent_BN1 = jnp.pad(parent, ((0, 0), (1, 0)))
    eye = jnp.eye(n + 1, dtype=bool)[None]
    ancestor = jnp.broadcast_to(eye, (batch, n + 1, n + 1))
    for _ in range(spec.depth):
        idx = jnp.broadcast_to(parent_BN1[:, :, None], ancestor.shape)
        ancestor = eye | jnp.take_along_axis(ancestor, idx, axis=1)
    is_child = parent[:, None, :] == jnp.arange(n + 1)[None, :, None]  # [B, N + 1, N]
    key = jnp.where(is_child, priority[:, None, :], n)
    neg, kids = jax.lax.top_k(-key, min(m, n))  # smallest rank first
    children = jnp.where(-neg < n, kids + 1, -1).astype(jnp.int32)
    depth = jnp.asarray(depths(spec), jnp.int32)[chosen]
    return DraftedTree(
        tokens_BN=vocab.token(jnp.take_along_axis(tok_BM, chosen, axis=1)),
        depth_BN1=jnp.pad(depth, ((0, 0), (1, 0))),
        ancestor_BNN=ancestor,
        children_BNR=children,
        fed_slot_BN1=jnp.pad(
            jnp.take_along_axis(fed_BM, chosen, axis=1), ((0, 0), (1, 0)), constant_values=-1
        ),  # fmt: skip
    ), chosen
