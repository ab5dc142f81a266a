"""Token-tree speculative sampling: one jitted lax.while_loop; per round a draft tree, one target
call scoring every node, exact multi-candidate verification, and per-row KV compaction.

Per round and row: the draft catches up on the 1-2 tokens it has not consumed (giving q at the
root) and expands the tree level by level, one cached call per depth < D over that depth's nodes
(ancestor-only mask, position = prefix length + depth), which gives q at every node with
children. Children are drawn from their parent's q without replacement (default) or i.i.d.
(`siblings`, specjax.sampling.siblings); at T = 0 they are the draft's top-ranked tokens in rank
order. The target scores the root token and all N nodes in
one (N + 1)-token cached call with the same mask and positions.

Verification (SpecInfer, Miao et al. ASPLOS 2024, Alg. 2 "multi-step speculative sampling";
the tree form of Leviathan et al. 2023): at node u with target dist p = p_u and draft dist q_u,
test its children c_1, c_2, ... in rank order; child c_i is accepted with probability
min(1, p(c_i) / q_u(c_i)); on rejection p <- norm(max(0, p - q_u)) before testing c_{i+1}; the
first accepted child becomes u and the walk descends; if every child is rejected the round emits
a sample of the last p (a node without children emits a sample of p_u: the bonus token). With
i.i.d. siblings each test is one step of speculative sampling from q_u towards the current p,
whose rejection law is exactly the next residual, so by induction the emitted token follows p_u
exactly (SpecInfer Thm. 4.2); without replacement q_u is replaced by the sibling's own q_r
(recursive rejection sampling, specjax.sampling.siblings). Greedy: descend into the first child
equal to argmax p_u, else emit argmax p_u.

The target keeps the root token and the accepted path's entries (gathered into place per row);
the draft keeps the accepted nodes it fed; everything else is rolled back by row lengths.
Cache invariant at the start of a round as in speculative.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.models import apply_cached, init_cache, split
from specjax.models.kv_cache import gather_window
from specjax.sampling import common, drafters, guards
from specjax.sampling import siblings as sib
from specjax.sampling import tree as tr
from specjax.sampling.speculative import SpeculativeState
from specjax.sampling.transforms import SamplingConfig, inverse_cdf, transform_logits
from specjax.sampling.verify import residual

# Deliberately wrong sibling rules for the negative-control tests (private `_bug`):
# 'stale_residual': siblings tested against p_u itself, emit norm(max(0, p_u - q_u)) if all fail;
# 'unmodified_p': siblings tested against p_u, emit a sample of p_u if all fail;
# 'fixed_q': siblings drawn without replacement but tested against the fixed q_u (the iid rule).
_BUGS = (None, 'stale_residual', 'unmodified_p', 'fixed_q')


def tree_speculative_sample(
    target, draft, prompts, prompt_lengths, *, tree, max_new_tokens: int,
    sampling: SamplingConfig, rng, eos_id=None, mesh=None, rules=None, draft_rules=None,
    check_finite: bool = True, siblings: str = 'without_replacement',
) -> common.SampleOutput:  # fmt: skip
    """Samples max_new_tokens per row from `target`'s distribution with a draft token `tree`.

    Same arguments and output as `speculative_sample`, with `tree` (see specjax.sampling.tree)
    in place of num_draft_tokens; stats are per depth (k = D) and `drafted` counts N nodes a
    round. `mesh`, `rules` and `draft_rules` as in `speculative_sample`, and so are the guards
    (prompt ids, plus child ranks >= vocab_size, refused before compiling; non-finite logits
    raise guards.NonFiniteLogitsError naming the model; `check_finite`). `siblings`:
    'without_replacement' (distinct siblings, recursive rejection sampling) or 'iid'.
    """
    fn = make_tree_speculative_fn(
        split(target)[0], split(draft)[0], tree=tree, max_new_tokens=max_new_tokens,
        sampling=sampling, eos_id=eos_id, mesh=mesh, rules=rules, draft_rules=draft_rules,
        check_finite=check_finite, siblings=siblings,
    )  # fmt: skip
    return fn(split(target)[1], split(draft)[1], prompts, prompt_lengths, rng)


def make_tree_speculative_fn(
    target_graphdef, draft_graphdef, *, tree, max_new_tokens: int, sampling: SamplingConfig,
    eos_id=None, mesh=None, rules=None, draft_rules=None, check_finite: bool = True,
    siblings: str = 'without_replacement', _bug=None,
):  # fmt: skip
    """fn(target_params, draft_params, prompts, prompt_lengths, rng) -> SampleOutput (cached)."""
    tree, siblings = tr.check_tree(tree), sib.check_siblings(siblings)
    if drafters.drafter_for(
        target_graphdef, draft_graphdef, 'tree_speculative_sample'
    ).feature_layers:
        raise ValueError('tree_speculative_sample: a feature draft drafts chains only for now '
                         '(speculative_sample); token trees take a token draft')  # fmt: skip
    max_new = common.check_positive_int('max_new_tokens', max_new_tokens)
    common.check_sampling(sampling)
    t_vocab = common.config_of(target_graphdef).vocab_size
    d_vocab = common.config_of(draft_graphdef).vocab_size
    if t_vocab != d_vocab:
        raise ValueError(f'target vocab_size={t_vocab} differs from draft vocab_size={d_vocab}')
    eos_id = common.check_eos(eos_id, t_vocab)
    if _bug not in _BUGS:
        raise ValueError(f'_bug must be one of {_BUGS}, got {_bug!r}')
    guards.check_tree_ranks(tree, t_vocab)
    mesh = common.default_mesh() if mesh is None else mesh
    rules = common.normalize_rules(rules)
    return _cached_fn(
        target_graphdef, draft_graphdef, tree, max_new, sampling, eos_id, mesh, rules,
        common.normalize_draft_rules(draft_rules, rules), _bug, bool(check_finite), siblings,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _cached_fn(
    tgd, dgd, tree, max_new, sampling, eos_id, mesh, rules, draft_rules, bug, check, siblings
):  # fmt: skip
    n = len(tree)

    def fits(width):
        for name, graphdef in (('target', tgd), ('draft', dgd)):
            cfg = common.config_of(graphdef)
            common.check_fits(
                cfg, width, max_new, n + 1, f'tree_speculative_sample {name} ({n}-node tree)'
            )

    core = functools.partial(
        _tree_core, tgd, dgd, tree=tree, max_new=max_new, sampling=sampling, eos_id=eos_id,
        bug=bug, layout=(mesh, rules, draft_rules), check_finite=check, siblings=siblings,
    )  # fmt: skip
    models = (('target', tgd, rules, 'rules'), ('draft', dgd, draft_rules, 'draft_rules'))
    return common.ShardedSampler(core, mesh, rules, fits, models, name='tree_speculative_sample')


def _tree_core(tgd, dgd, tparams, dparams, prompts, prompt_lengths, rng, *, tree, layout, **kw):
    t = tr.tables(tree)
    batch, width = prompts.shape
    prompts = guards.clean_padding(prompts, prompt_lengths)  # nothing past a row's length
    capacity = width + kw['max_new'] + t.num_nodes + 1
    mesh, rules, draft_rules = layout
    tcache, dcache = common.shard_caches(mesh, (
        (init_cache(common.config_of(tgd), batch, capacity), rules),
        (init_cache(common.config_of(dgd), batch, capacity), draft_rules),
    ))  # fmt: skip
    _, tcache = apply_cached(tgd, tparams, prompts, prompt_lengths - 1, tcache)
    _, dcache = apply_cached(dgd, dparams, prompts, prompt_lengths - 1, dcache)
    zeros = jnp.zeros((batch,), jnp.int32)
    d = t.max_depth
    out = jnp.zeros((batch, kw['max_new'] + d + 1), jnp.int32)
    state = SpeculativeState(
        tcache=tcache, dcache=dcache, last=prompts[jnp.arange(batch), prompt_lengths - 1],
        prev=zeros, draft_pending=zeros + 1, out=out,
        emitted=zeros, done=jnp.zeros((batch,), bool), round=jnp.int32(0), row_rounds=zeros,
        row_examined_per_position=jnp.zeros((batch, d), jnp.int32),
        row_accepted_per_position=jnp.zeros((batch, d), jnp.int32), **guards.initial_flags(),
    )  # fmt: skip
    body = functools.partial(_round, tgd, dgd, tparams, dparams, rng, t=t, **kw)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return common.SampleOutput(
        tokens=common.finish_tokens(state.out, state.emitted, kw['max_new']),
        lengths=state.emitted,
        stats=_stats(state, t),
    )


def tree_mask(ancestor_NM, lengths_B, capacity: int):
    """[B, N, capacity]: query node i of row b sees the committed prefix (keys < lengths[b]) and
    the key at lengths[b] + j iff ancestor_NM[i, j] (its ancestors and itself)."""
    m = ancestor_NM.shape[1]
    rel = jnp.arange(capacity)[None, :] - lengths_B[:, None]  # [B, C]
    inside = (rel >= 0) & (rel < m)
    tree_part = jnp.asarray(ancestor_NM)[:, jnp.clip(rel, 0, m - 1)]  # [N, B, C]
    return (rel < 0)[:, None, :] | (inside[:, None, :] & jnp.swapaxes(tree_part, 0, 1))


def _children(q_BWV, logits_BWV, parents, ranks, uniform_BC, sampling, top, siblings):
    """Tokens [B, C] of C children whose parents index the W nodes of q_BWV / logits_BWV."""
    if sampling.greedy:
        return _top_ranked(logits_BWV, top)[:, parents, ranks]
    return sib.draw_children(q_BWV, parents, ranks, uniform_BC, siblings)


def _top_ranked(logits_BWV, top: int):
    """int32 [B, W, top]: the `top` largest logits' indices, largest first, ties by lower index
    (lax.top_k's order). `top` argmax passes: XLA's CPU top_k sorts the whole vocabulary."""
    ranked, logits = [], logits_BWV
    for _ in range(top):
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        ranked.append(best)
        logits = jnp.where(jnp.arange(logits.shape[-1]) == best[..., None], -jnp.inf, logits)
    return jnp.stack(ranked, axis=-1)


def _draft_tree(dgd, dparams, state, uniform_BN, active, t, sampling, check_finite, siblings):
    """Catch-up, then one draft call per depth < D -> (node tokens [B, N], q [B, F + 1, V] at the
    root and the fed nodes, draft cache with the F fed nodes written after the context, whether
    the draft's logits of an active row were non-finite)."""
    act = active.astype(jnp.int32)
    logits, dcache = common.draft_catch_up(
        dgd, dparams, state.dcache, state.last, state.prev, state.draft_pending, active
    )
    logits = logits[:, None]  # [B, 1, V]: the root
    bad = guards.any_nonfinite(logits, active, check_finite)
    base = dcache.lengths  # the context; fed node i sits at base + i - 1
    fed_ancestor = t.ancestor[1 : t.num_fed + 1, 1 : t.num_fed + 1]
    qs, tokens = [transform_logits(logits, sampling)], []
    level_logits, level_q, first = logits, qs[0], 0  # nodes [first, first + W) of this level
    for d in range(t.max_depth):
        s, e = t.level_start[d], t.level_end[d]
        parents = t.parent[s:e] - first
        toks = _children(
            level_q, level_logits, parents, t.rank[s:e], uniform_BN[:, s - 1 : e - 1], sampling,
            t.top, siblings,
        )  # fmt: skip
        tokens.append(toks)
        if d == t.max_depth - 1:
            break
        mask = tree_mask(fed_ancestor[s - 1 : e - 1], base, dcache.capacity)
        positions = base[:, None] - 1 + jnp.asarray(t.depth[s:e])[None, :]
        cache = dcache.replace(lengths=base + s - 1)
        level_logits, dcache = apply_cached(dgd, dparams, toks, act * 0, cache, positions, mask)
        bad = bad | guards.any_nonfinite(level_logits, active, check_finite)
        level_q, first = transform_logits(level_logits, sampling), s
        qs.append(level_q)
    dcache = dcache.replace(lengths=base)
    return jnp.concatenate(tokens, axis=1), jnp.concatenate(qs, axis=1), dcache, bad


def _walk(t, p_BNV, q_BFV, tok_BN, uniform_BN, uniform_B, greedy, bug, siblings):
    """Verification walk -> (path [B, D] accepted node ids (0 past the end), accepted [B],
    next token [B], tested [B, D] whether depth d + 1 was tested)."""
    batch = p_BNV.shape[0]
    rows = jnp.arange(batch)
    node = jnp.zeros((batch,), jnp.int32)
    alive = jnp.ones((batch,), bool)
    stop = jnp.zeros(p_BNV.shape[::2], p_BNV.dtype)  # [B, V]: the emitting distribution
    best = jnp.argmax(p_BNV, -1).astype(jnp.int32)
    stop_tok = jnp.zeros((batch,), jnp.int32)
    tok = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tok_BN], axis=1)  # node-indexed
    children = jnp.asarray(t.children)
    path, tested = [], []
    for _ in range(t.max_depth):
        kids = children[node]  # [B, R]
        tested.append(alive & (kids[:, 0] >= 0))
        p_u = p_BNV[rows, node]
        q_u = q_BFV[rows, jnp.minimum(node, q_BFV.shape[1] - 1)]
        p_cur, q_cur, found, chosen = p_u, q_u, jnp.zeros_like(alive), node
        for r in range(children.shape[1]):
            c = kids[:, r]
            valid = alive & ~found & (c >= 0)
            x = tok[rows, jnp.maximum(c, 0)]
            if greedy:
                ok = x == best[rows, node]
            else:
                valid = valid & sib.has_mass(q_cur)  # an exhausted q proposes nothing
                p_test = p_cur if bug in (None, 'fixed_q') else p_u
                u = uniform_BN[rows, jnp.maximum(c, 1) - 1]
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
        stop_tok = jnp.where(stopping, best[rows, node], stop_tok)
        alive, node = alive & found, jnp.where(found, chosen, node)
        path.append(jnp.where(alive, node, 0))
    stop = jnp.where(alive[:, None], p_BNV[rows, node], stop)  # bonus past a depth-D leaf
    stop_tok = jnp.where(alive, best[rows, node], stop_tok)
    path = jnp.stack(path, axis=1)
    accepted = jnp.sum(path > 0, axis=1).astype(jnp.int32)
    nxt = stop_tok if greedy else inverse_cdf(stop, uniform_B)
    return path, accepted, nxt, jnp.stack(tested, axis=1)


def _round(
    tgd, dgd, tparams, dparams, rng, state, *, t, max_new, sampling, eos_id, bug, check_finite,
    siblings,
):  # fmt: skip
    active = ~state.done
    act = active.astype(jnp.int32)
    n, depth = t.num_nodes, t.max_depth
    noise = jax.random.uniform(jax.random.fold_in(rng, state.round), (len(act), 2 * n + 1))
    tok_BN, q_BFV, dcache, draft_bad = _draft_tree(
        dgd, dparams, state, noise[:, :n], active, t, sampling, check_finite, siblings
    )

    tcache = state.tcache
    base = tcache.lengths  # the root token `last` goes here, node i at base + i
    tokens = jnp.concatenate([state.last[:, None], tok_BN], axis=1)
    positions = base[:, None] + jnp.asarray(t.depth)[None, :]
    mask = tree_mask(t.ancestor, base, tcache.capacity)
    logits, tcache = apply_cached(tgd, tparams, tokens, act * 0, tcache, positions, mask)
    # Greedy walks only need argmax p = argmax of the logits (transform_logits is a one-hot).
    p_BNV = logits if sampling.greedy else transform_logits(logits, sampling)
    path, num_acc, next_token, tested = _walk(
        t, p_BNV, q_BFV, tok_BN, noise[:, n:-1], noise[:, -1], sampling.greedy, bug, siblings
    )

    # Emit the path's tokens and the replacement/bonus, cut at eos and at max_new_tokens.
    tok = jnp.concatenate([jnp.zeros_like(state.last[:, None]), tok_BN], axis=1)
    path_tok = jnp.take_along_axis(tok, path, axis=1)
    count, hit_eos, emitted, out = common.emit_round(
        path_tok, num_acc, next_token, state.out, state.emitted, act, max_new=max_new, eos_id=eos_id
    )
    i = jnp.arange(depth)[None, :]
    counted = (i < count[:, None]) & active[:, None]
    examined = tested & counted
    accepted = (i < num_acc[:, None]) & counted

    # Keep the accepted path: target entries root + path at base..; draft its fed nodes.
    order_t = jnp.concatenate([jnp.zeros_like(path[:, :1]), path], axis=1)  # slot = node id
    order_t = jnp.where(jnp.arange(depth + 1)[None] <= num_acc[:, None], order_t, 0)
    order_t = jnp.pad(order_t, ((0, 0), (0, n - depth)))
    tcache = _compact(tcache, base, order_t)
    d_keep = jnp.minimum(num_acc, depth - 1)
    if t.num_fed:
        order_d = jnp.where(i[:, : depth - 1] < d_keep[:, None], path[:, : depth - 1] - 1, 0)
        order_d = jnp.pad(order_d, ((0, 0), (0, t.num_fed - (depth - 1))))
        dcache = _compact(dcache, dcache.lengths, order_d)
    keep = lambda new, old: jnp.where(active, new, old)
    return SpeculativeState(
        tcache=tcache.replace(lengths=keep(base + 1 + num_acc, base)),
        dcache=dcache.replace(lengths=keep(dcache.lengths + d_keep, state.dcache.lengths)),
        last=keep(next_token, state.last),
        prev=keep(path_tok[:, -1], state.prev),
        draft_pending=keep(1 + (num_acc == depth).astype(jnp.int32), state.draft_pending),
        out=jnp.where(active[:, None], out, state.out),
        emitted=emitted,
        done=state.done | (active & ((emitted >= max_new) | hit_eos)),
        round=state.round + 1,
        row_rounds=state.row_rounds + act,
        row_examined_per_position=state.row_examined_per_position + examined,
        row_accepted_per_position=state.row_accepted_per_position + accepted,
        nonfinite_target=state.nonfinite_target
        | guards.any_nonfinite(logits, active, check_finite),
        nonfinite_draft=state.nonfinite_draft | draft_bad,
    )


def _compact(cache, starts_B, order_BW):
    move = lambda c: gather_window(c, starts_B, order_BW)
    return cache.replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def _stats(state, t):
    """Per-row counts and totals as `SampleOutput`, per depth; drafted = N nodes per round."""
    rounds = state.row_rounds
    rows = dict(
        row_examined_per_position=state.row_examined_per_position,
        row_accepted_per_position=state.row_accepted_per_position,
        row_examined=state.row_examined_per_position.sum(-1),
        row_accepted=state.row_accepted_per_position.sum(-1),
        row_drafted=t.num_nodes * rounds,
        row_emitted=state.emitted,
        row_rounds=rounds,
        row_target_calls=rounds + 1,
        row_draft_calls=t.max_depth * rounds + 1,
    )
    totals = {name[4:]: value.sum(0) for name, value in rows.items()}
    flags = {name: getattr(state, name) for name in guards.FLAG_STATS}
    return {**totals, **rows, 'batch_rounds': state.round, **flags}
