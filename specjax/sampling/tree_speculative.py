"""Token-tree speculative sampling: one jitted lax.while_loop; per round a draft tree, one target
call scoring every node, exact multi-candidate verification, and per-row KV compaction.

The tree is static (a tuple of paths, specjax.sampling.tree: every row and round alike) or
dynamic (a `DynamicTree` budget: built per round and row from the draft's confidence,
specjax.sampling.dynamic_tree). Per round and row the draft catches up on the 1-2 tokens it has
not consumed (giving q at the root) and expands the tree level by level, one cached call per
depth < D over that depth's fed nodes (ancestor-only mask, position = prefix length + depth).
In a static tree children are drawn from their parent's q without replacement (default) or
i.i.d. (`siblings`, specjax.sampling.siblings), or are the draft's top-ranked tokens (at T = 0,
and at every T under `argmax_draft`). The target scores the root token and all N nodes in one
(N + 1)-token cached call with the same mask and positions, and specjax.sampling.tree_walk
verifies them with the chosen exact rule: `probabilistic` (SpecInfer's multi-step speculative
sampling; static trees' default), `argmax_draft` (deterministic candidates tested with the
current residual p; dynamic trees' default) or `strict`.

The target keeps the root token and the accepted path's entries (gathered into place per row);
the draft keeps the accepted nodes it fed; everything else is rolled back by row lengths. An
accepted node the draft did not feed (a leaf of a depth < D) is fed at the next catch-up with
the next token (draft_pending 2). Cache invariant at the start of a round as in speculative.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import init_cache, split
from specjax.sampling import common, constrain, drafters, emit, guards, task
from specjax.sampling import dynamic_tree as dyn
from specjax.sampling import ngram as ng
from specjax.sampling import siblings as sib
from specjax.sampling import stats as st
from specjax.sampling import tree as tr
from specjax.sampling.acceptance import as_acceptance
from specjax.sampling.draft_vocab import check_draft_vocab
from specjax.sampling.state import SpeculativeState
from specjax.sampling.transforms import SamplingConfig, transform_logits
from specjax.sampling.tree_walk import TREE_RULES, DraftedTree, compact, tree_mask, walk
from specjax.sampling.verify import leading_true

# Deliberately wrong sibling rules for the negative-control tests (private `_bug`):
# 'stale_residual': siblings tested against p_u itself, emit norm(max(0, p_u - q_u)) if all fail;
# 'unmodified_p': siblings tested against p_u, emit a sample of p_u if all fail;
# 'fixed_q': siblings drawn without replacement but tested against the fixed q_u (the iid rule);
# 'ratio_test': a dynamic tree's top-ranked candidates tested with min(1, p/q) as if drawn from q.
_BUGS = (None, 'stale_residual', 'unmodified_p', 'fixed_q', 'ratio_test')


def tree_speculative_sample(
    target, draft, prompts, prompt_lengths, *, tree, max_new_tokens: int,
    sampling: SamplingConfig, rng, eos_id=None, mesh=None, rules=None, draft_rules=None,
    check_finite: bool = True, siblings: str = 'without_replacement', acceptance=None,
    draft_vocab_ids=None, grammar=None, stops=None,
) -> common.SampleOutput:  # fmt: skip
    """Samples max_new_tokens per row from `target`'s distribution with a draft token `tree`.

    Same arguments and output as `speculative_sample`, with `tree` (paths, see
    specjax.sampling.tree, or a `DynamicTree` budget) in place of num_draft_tokens; stats are
    per depth (k = D) and `drafted` counts N nodes a round. `mesh`, `rules`, `draft_rules` and
    `draft_vocab_ids` as in `speculative_sample`, and so are the guards (prompt ids, plus child
    ranks >= the draft's vocabulary, refused before compiling; non-finite logits raise
    guards.NonFiniteLogitsError naming the model; `check_finite`). `siblings` (static trees at
    T > 0 under `probabilistic`): 'without_replacement' (distinct siblings, recursive rejection
    sampling) or 'iid'. `acceptance`: an exact rule of TREE_RULES (None: `probabilistic` for a
    static tree, `argmax_draft` for a dynamic one, whose candidates are not sampled).
    `stops` / `grammar` as in speculative_sample; every node carries its automaton state.
    """
    (tgd, tparams), (dgd, dparams) = split(target), drafters.split_draft(draft)
    fn = make_tree_speculative_fn(
        tgd, dgd, tree=tree, max_new_tokens=max_new_tokens,
        sampling=sampling, eos_id=eos_id, mesh=mesh, rules=rules, draft_rules=draft_rules,
        check_finite=check_finite, siblings=siblings, acceptance=acceptance,
        draft_vocab_ids=draft_vocab_ids, grammar=grammar, stops=stops,
    )  # fmt: skip
    return fn(tparams, dparams, prompts, prompt_lengths, rng)


def make_tree_speculative_fn(
    target_graphdef, draft_graphdef, *, tree, max_new_tokens: int, sampling: SamplingConfig,
    eos_id=None, mesh=None, rules=None, draft_rules=None, check_finite: bool = True,
    siblings: str = 'without_replacement', acceptance=None, draft_vocab_ids=None, grammar=None,
    stops=None, _bug=None,
):  # fmt: skip
    """fn(target_params, draft_params, prompts, prompt_lengths, rng) -> SampleOutput (cached;
    the task's tables are its jit argument)."""
    dynamic = isinstance(tree, tr.DynamicTree)
    tree, siblings = tree if dynamic else tr.check_tree(tree), sib.check_siblings(siblings)
    drafter = drafters.drafter_for(target_graphdef, draft_graphdef, 'tree_speculative_sample')
    max_new = common.check_positive_int('max_new_tokens', max_new_tokens)
    common.check_sampling(sampling)
    t_vocab = common.config_of(target_graphdef).vocab_size
    d_vocab = drafters.draft_vocab_size(draft_graphdef, t_vocab)
    vocab = check_draft_vocab(draft_vocab_ids, t_vocab, d_vocab)
    eos_id = common.check_eos(eos_id, t_vocab)
    tables = task.build(grammar, stops, t_vocab, 'tree_speculative_sample')
    ngram = ng.is_ngram(draft_graphdef)
    if ngram:
        if dynamic:
            raise ValueError('tree_speculative_sample: an n-gram draft fills static trees only '
                             '(ngram_tree_paths(branches, depth)), got a DynamicTree')  # fmt: skip
        ng.check_tree(tree, 'tree_speculative_sample')
        if by_n := draft_graphdef.proposals_by_n:
            raise ValueError('tree_speculative_sample: NGramDraft.proposals_by_n applies to '
                             f'chains (speculative_sample), got {by_n}')  # fmt: skip
    rule = _check_rule(acceptance, dynamic or ngram)
    bugs = (None, 'ratio_test') if dynamic else _BUGS[:-1]
    if _bug not in bugs:
        raise ValueError(f'_bug must be one of {bugs} for this tree, got {_bug!r}')
    proposable = t_vocab if vocab.ids is None else len(vocab.ids)
    if dynamic and tree.expand > proposable:
        raise ValueError(
            f'DynamicTree.expand={tree.expand} exceeds the {proposable} tokens the draft proposes'
        )
    if not dynamic:
        guards.check_tree_ranks(tree, proposable)
    mesh = common.default_mesh() if mesh is None else mesh
    rules = common.normalize_rules(rules)
    program = _cached_fn(
        target_graphdef, draft_graphdef, tree, max_new, sampling, eos_id, mesh, rules,
        common.normalize_draft_rules(draft_rules, rules), _bug, bool(check_finite), siblings,
        rule, vocab, drafter,
    )  # fmt: skip
    return program.with_task(tables)


def _check_rule(acceptance, dynamic: bool) -> str:
    if acceptance is None:
        return 'argmax_draft' if dynamic else 'probabilistic'
    rule = as_acceptance(acceptance).rule
    allowed = TREE_RULES[1:] if dynamic else TREE_RULES
    if rule not in allowed:
        why = (
            "a dynamic tree's (or an n-gram draft's) candidates are chosen by the draft, not "
            'samples of q'
            if dynamic and rule == 'probabilistic'
            else 'lossy rules verify chains only (speculative_sample)'
        )
        raise ValueError(f'tree acceptance must be one of {allowed}, got {rule!r}: {why}')
    return rule


def _sizes(tree, drafter=None) -> tuple[int, int, int]:
    """(N nodes verified, depth D, F nodes the draft feeds) of a static or dynamic tree (an
    n-gram draft feeds none)."""
    if isinstance(tree, tr.DynamicTree):
        return tree.nodes, tree.depth, tree.num_fed
    t = tr.tables(tree)
    fed = 0 if isinstance(drafter, ng.NGramDrafter) else t.num_fed
    return t.num_nodes, t.max_depth, fed


@functools.lru_cache(maxsize=64)
def _cached_fn(
    tgd, dgd, tree, max_new, sampling, eos_id, mesh, rules, draft_rules, bug, check, siblings,
    rule, vocab, drafter,
):  # fmt: skip
    n, _, fed = _sizes(tree, drafter)
    ngram = isinstance(drafter, ng.NGramDrafter)
    models = (('target', tgd, rules, 'rules'), ('draft', None if ngram else dgd, draft_rules,
                                                'draft_rules'))  # fmt: skip

    def fits(width):
        for name, graphdef, _, _ in models:
            if graphdef is None:
                continue
            cfg = common.config_of(graphdef)
            who = f'tree_speculative_sample {name} ({n}-node tree)'
            common.check_fits(cfg, width, max_new, max(n, fed) + 1, who)

    core = functools.partial(
        _tree_core, tgd, dgd, tree=tree, max_new=max_new, sampling=sampling, eos_id=eos_id,
        bug=bug, layout=(mesh, rules, draft_rules), check_finite=check, siblings=siblings,
        rule=rule, vocab=vocab, drafter=drafter,
    )  # fmt: skip
    return common.ShardedSampler(
        core, mesh, rules, fits, models, takes_values=True, name='tree_speculative_sample'
    )


def _tree_core(
    tgd, dgd, tparams, dparams, prompts, prompt_lengths, rng, values, *, tree, layout, vocab,
    drafter, **kw,
):  # fmt: skip
    """values: (task.TaskTables or None,)."""
    n, depth, fed = _sizes(tree, drafter)
    batch, width = prompts.shape
    eos = -1 if kw['eos_id'] is None else kw['eos_id']
    _, _, con = constrain.unpack((None, None, *values), batch, vocab.target_vocab, eos)
    prompts = guards.clean_padding(prompts, prompt_lengths)  # nothing past a row's length
    capacity = width + kw['max_new'] + max(n, fed) + 1
    mesh, rules, draft_rules = layout
    tcache, dcache = common.shard_caches(mesh, (
        (init_cache(common.config_of(tgd), batch, capacity), rules),
        (drafter.new_cache(dgd, batch, capacity), draft_rules),
    ))  # fmt: skip
    _, tcache, features = drafter.target_call(tgd, tparams, prompts, prompt_lengths - 1, tcache)
    dcache, dfeed = drafter.init(dgd, dparams, dcache, prompts, prompt_lengths, vocab, features,
                                 depth)  # fmt: skip
    zeros = jnp.zeros((batch,), jnp.int32)
    out = jnp.zeros((batch, kw['max_new'] + depth + 1), jnp.int32)
    state = SpeculativeState(
        tcache=tcache, dcache=dcache, last=prompts[jnp.arange(batch), prompt_lengths - 1],
        prev=zeros, draft_pending=zeros + 1, out=out,
        emitted=zeros, done=jnp.zeros((batch,), bool), round=jnp.int32(0), row_rounds=zeros,
        row_examined_per_position=jnp.zeros((batch, depth), jnp.int32),
        row_accepted_per_position=jnp.zeros((batch, depth), jnp.int32), **guards.initial_flags(),
        dfeed=dfeed, task=() if con is None else con.initial(),
    )  # fmt: skip
    keep_q = kw['rule'] == 'probabilistic' or kw['bug'] == 'ratio_test'
    opts = dict(
        sampling=kw['sampling'], vocab=vocab, check_finite=kw['check_finite'], drafter=drafter,
        con=con,
    )  # fmt: skip
    if isinstance(drafter, ng.NGramDrafter):
        t = tr.tables(tree)
        branches = ng.check_tree(tree, 'tree_speculative_sample')
        draft_fn = lambda dparams, state, _, active: (
            drafter.draft_tree(state, active, t=t, branches=branches, con=con), state.dcache, False
        )  # fmt: skip
    elif isinstance(tree, tr.DynamicTree):
        draft_fn = lambda dparams, state, _, active: dyn.draft_dynamic(
            dgd, dparams, state, active, spec=tree, keep_q=keep_q, **opts
        )  # fmt: skip
    else:
        draft_fn = functools.partial(
            _draft_static, dgd, t=tr.tables(tree), siblings=kw['siblings'], keep_q=keep_q,
            ranked=kw['rule'] == 'argmax_draft', **opts,
        )  # fmt: skip
    body = functools.partial(
        _round, tgd, dgd, tparams, dparams, rng, draft_fn=draft_fn, sizes=(n, depth, fed),
        drafter=drafter, con=con, **kw,
    )  # fmt: skip
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    tokens = emit.finish_tokens(state.out, state.emitted, kw['max_new'])
    finish, extra = constrain.outputs(con, state.task, tokens, state.emitted, eos)
    calls = (depth * state.row_rounds + 1) * int(not isinstance(drafter, ng.NGramDrafter))
    flags = {name: getattr(state, name) for name in guards.FLAG_STATS}
    stats = st.sampler_stats(state, n * state.row_rounds, calls, flags) | extra
    return common.SampleOutput(tokens, state.emitted, stats, finish)


def _draft_static(dgd, dparams, state, uniform_BN, active, *, t, sampling, vocab, check_finite,
                  siblings, ranked, keep_q, drafter, con=None):  # fmt: skip
    """Catch-up, then one draft call per depth < D -> (DraftedTree, draft cache with the F fed
    nodes written after the context and its lengths at the context, whether the draft's
    logits of an active row were non-finite). Children are top-ranked at T = 0 or when
    `ranked`, else drawn from their parent's q (`siblings`); under a task (`con`) each node's
    q is masked at its automaton state, which the tree carries."""
    logits, carry = drafter.catch_up(dgd, dparams, state, active, vocab)
    dcache, h_level = drafter.split_carry(carry)  # h: output states (feature drafts)
    bad = guards.any_nonfinite(logits, active, check_finite)
    level = vocab.restrict(logits)[:, None]  # [B, 1, Vd]: the root
    g_level = state.task.grammar[:, None] if con is not None else None  # [B, W] node states
    if con is not None:
        level = con.draft_logits(level, vocab, g_level, state.emitted[:, None])
    states = [g_level]
    h_level = None if h_level is None else h_level[:, None]
    base = dcache.lengths  # the context; fed node i sits at base + i - 1
    fed_ancestor = t.ancestor[1 : t.num_fed + 1, 1 : t.num_fed + 1]
    sampled = not (sampling.greedy or ranked)
    level_q = transform_logits(level, sampling) if sampled or keep_q else None
    qs, tokens, first = [level_q], [], 0  # nodes [first, first + W) of this level
    for d in range(t.max_depth):
        s, e = t.level_start[d], t.level_end[d]
        parents, ranks = t.parent[s:e] - first, t.rank[s:e]
        if sampled:
            uniform = uniform_BN[:, s - 1 : e - 1]
            toks = sib.draw_children(level_q, parents, ranks, uniform, siblings)
        else:
            toks = sib.top_ranked(level, t.top)[:, parents, ranks]
        tokens.append(toks)
        if con is not None:
            states.append(con.advance(g_level[:, parents], vocab.token(toks)))
        if d == t.max_depth - 1:
            break
        mask = tree_mask(fed_ancestor[s - 1 : e - 1], base, dcache.capacity)
        positions = jnp.broadcast_to(base[:, None] - 1 + t.depth[s:e][None, :], toks.shape)
        cache = dcache.replace(lengths=base + s - 1)
        parent_h = None if h_level is None else h_level[:, parents]
        out, h_level, dcache = drafter.level(
            dgd, dparams, cache, vocab.token(toks), parent_h, positions, mask, vocab
        )
        bad = bad | guards.any_nonfinite(out, active, check_finite)
        level, first = vocab.restrict(out), s
        if con is not None:
            g_level = states[-1]
            level = con.draft_logits(level, vocab, g_level, state.emitted[:, None] + d + 1)
        level_q = transform_logits(level, sampling) if sampled or keep_q else None
        qs.append(level_q)
    batch = active.shape[0]
    wide = lambda a: jnp.broadcast_to(jnp.asarray(a), (batch, *np.shape(a)))
    fed_slot = np.where((t.depth < t.max_depth) & (t.depth > 0), np.arange(-1, t.num_nodes), -1)
    tree = DraftedTree(
        tokens_BN=vocab.token(jnp.concatenate(tokens, axis=1)),
        depth_BN1=wide(t.depth), ancestor_BNN=wide(t.ancestor), children_BNR=wide(t.children),
        fed_slot_BN1=wide(fed_slot.astype(np.int32)),
        q_BFV=vocab.expand(jnp.concatenate(qs, axis=1)) if keep_q else None,
        state_BN1=None if con is None else jnp.concatenate(states, axis=1),
    )  # fmt: skip
    return tree, dcache.replace(lengths=base), bad


def _round(
    tgd, dgd, tparams, dparams, rng, state, *, draft_fn, sizes, max_new, sampling, eos_id, bug,
    check_finite, siblings, rule, drafter, con=None,
):  # fmt: skip
    active = ~state.done
    act = active.astype(jnp.int32)
    n, depth, fed = sizes
    noise = jax.random.uniform(jax.random.fold_in(rng, state.round), (len(act), 2 * n + 2))
    tree, dcache, draft_bad = draft_fn(dparams, state, noise[:, :n], active)

    tcache = state.tcache
    base = tcache.lengths  # the root token `last` goes here, node i at base + i
    tokens = jnp.concatenate([state.last[:, None], tree.tokens_BN], axis=1)
    positions = base[:, None] + tree.depth_BN1
    mask = tree_mask(tree.ancestor_BNN, base, tcache.capacity)
    logits, tcache, features = drafter.target_call(
        tgd, tparams, tokens, act * 0, tcache, positions, mask
    )
    target_bad = guards.any_nonfinite(logits, active, check_finite)
    if con is not None:  # p~ at every node's own automaton state
        logits = con.logits(logits, tree.state_BN1, state.emitted[:, None] + tree.depth_BN1)
    # Greedy walks only need argmax p = argmax of the logits (transform_logits is a one-hot).
    p_BNV = logits if sampling.greedy else transform_logits(logits, sampling)
    walk_rule, walk_siblings = (
        ('probabilistic', 'iid') if bug == 'ratio_test' else (rule, siblings)
    )  # fmt: skip
    path, num_acc, next_token, tested = walk(
        tree, p_BNV, noise[:, n:-1], noise[:, -1], depth=depth, greedy=sampling.greedy,
        rule=walk_rule, siblings=walk_siblings, bug=None if bug == 'ratio_test' else bug,
    )  # fmt: skip

    # Emit the path's tokens and the replacement/bonus, cut at eos and at max_new_tokens.
    tok = jnp.concatenate([jnp.zeros_like(state.last[:, None]), tree.tokens_BN], axis=1)
    path_tok = jnp.take_along_axis(tok, path, axis=1)
    count, hit_eos, emitted, out = emit.emit_round(
        path_tok, num_acc, next_token, state.out, state.emitted, act, max_new=max_new,
        eos_id=eos_id if con is None else None,
    )  # fmt: skip
    tstate = state.task
    if con is not None:  # the states along the path: the root's, then each path node's
        g_path = jnp.take_along_axis(tree.state_BN1, jnp.pad(path, ((0, 0), (1, 0))), axis=1)
        count, hit_eos, tstate = con.cut_round(state, g_path, path_tok, num_acc, next_token, count)
        emitted = state.emitted + count * act
    i = jnp.arange(depth)[None, :]
    counted = (i < count[:, None]) & active[:, None]
    examined = tested & counted
    accepted = (i < num_acc[:, None]) & counted

    # Keep the accepted path: target entries root + path at base..; draft the fed nodes on it.
    order_t = jnp.concatenate([jnp.zeros_like(path[:, :1]), path], axis=1)  # slot = node id
    order_t = jnp.where(jnp.arange(depth + 1)[None] <= num_acc[:, None], order_t, 0)
    tcache = compact(tcache, base, jnp.pad(order_t, ((0, 0), (0, n - depth))))
    keep = lambda new, old: jnp.where(active, new, old)
    if drafter.feature_layers:  # every node was self-fed: the path's true features are pending
        fused = drafter.fuse(dgd, dparams, features)  # [B, N + 1, E]
        fused = jnp.take_along_axis(fused, order_t[:, :, None], axis=1)  # last, path nodes
        dcache, prev, pending, dfeed = drafter.after_round(
            state, (dcache, None), fused, fed=0, x_BK=path_tok, num_acc_B=num_acc,
            next_B=next_token, active_B=active,
        )  # fmt: skip
    else:  # keep the fed nodes on the path; an unfed accepted leaf is pending with `last`
        slot_BD = jnp.take_along_axis(tree.fed_slot_BN1, path, axis=1)
        d_keep = leading_true((i < num_acc[:, None]) & (slot_BD >= 0))  # <= D - 1
        if fed:
            order_d = jnp.where(i[:, : depth - 1] < d_keep[:, None], slot_BD[:, : depth - 1], 0)
            order_d = jnp.pad(order_d, ((0, 0), (0, fed - depth + 1)))
            dcache = compact(dcache, dcache.lengths, order_d)
        rows = jnp.arange(len(act))
        dcache = dcache.replace(lengths=keep(dcache.lengths + d_keep, state.dcache.lengths))
        prev = keep(path_tok[rows, jnp.maximum(num_acc - 1, 0)], state.prev)
        pending, dfeed = keep(1 + num_acc - d_keep, state.draft_pending), ()
    return SpeculativeState(
        tcache=tcache.replace(lengths=keep(base + 1 + num_acc, base)),
        dcache=dcache,
        last=keep(next_token, state.last),
        prev=prev,
        draft_pending=pending,
        out=jnp.where(active[:, None], out, state.out),
        emitted=emitted,
        done=state.done | (active & ((emitted >= max_new) | hit_eos)),
        round=state.round + 1,
        row_rounds=state.row_rounds + act,
        row_examined_per_position=state.row_examined_per_position + examined,
        row_accepted_per_position=state.row_accepted_per_position + accepted,
        nonfinite_target=state.nonfinite_target | target_bad,
        nonfinite_draft=state.nonfinite_draft | draft_bad,
        dfeed=dfeed,
        task=tstate,
    )
