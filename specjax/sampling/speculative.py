"""Speculative sampling (Leviathan et al. 2023): one jitted lax.while_loop over rounds.

Per round and row: the draft catches up on the 1-2 tokens it has not consumed and proposes k
tokens (k single-token cached calls in all), the target scores the pending token and the k
proposals in one (k+1)-token cached call, `verify` accepts a prefix and draws the replacement or
bonus token, and both caches roll back by lowering row lengths. Rows are ragged (own prompt
length, own acceptance, own eos) and finished rows stay inert; nothing returns to the host until
every row is done.

Cache invariant at the start of a round: the target has consumed the context except its last
token `last`. The draft is a token draft or a feature draft (EAGLE-3 style, reading the target's
hidden states); specjax.sampling.drafters says what each has consumed and catches it up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.models import init_cache, split
from specjax.sampling import (
    common,
    constrain,
    drafters,
    emit,
    guards,
    proposals,
    task,
    verified,
    widths,
)
from specjax.sampling import stats as st
from specjax.sampling.acceptance import as_acceptance, verify_rule
from specjax.sampling.cascade import bind_lenience, lenience_of, verify_round
from specjax.sampling.draft_vocab import check_draft_vocab
from specjax.sampling.state import SpeculativeState
from specjax.sampling.transforms import (
    SamplingConfig,
    branch,
    inverse_cdf,
    is_greedy,
    transform_logits,
)
from specjax.sampling.verify import stop_at, take_position, verify, verify_greedy

# Deliberately wrong variants, selectable only through the private `_bug` argument, so the
# exactness tests can show their statistics reject them (negative controls); under a grammar
# 'unmasked_q' draws from q~ tested against the unmasked q; 'ngram_soft_q' verifies an n-gram
# draft against a smoothed q.
_BUGS = (None, 'bonus_from_q', 'residual_untransformed', 'bf16_draft', 'stop_drops_proposal',
         'unmasked_q', 'ngram_soft_q')  # fmt: skip


def speculative_sample(
    target,
    draft,
    prompts,
    prompt_lengths,
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
    rng,
    eos_id=None,
    mesh=None,
    rules=None,
    acceptance='probabilistic',
    draft_vocab_ids=None,
    draft_rules=None,
    check_finite: bool = True,
    stop_below: float | None = None,
    grammar=None,
    stops=None,
) -> common.SampleOutput:
    """Samples max_new_tokens per row from `target`'s distribution, proposed by `draft`.

    prompts int32 [B, P] right-padded with lengths int32 [B] in [1, P]. Returns tokens
    [B, max_new_tokens] (PAD_ID after each row's end: eos, which is kept, or max_new_tokens),
    lengths [B] and acceptance stats (see `SampleOutput`). `acceptance`: a rule name, dict or
    `Acceptance` (specjax.sampling.acceptance; exact ones keep the target's distribution).
    `draft_vocab_ids` int [N]: the draft proposes only these target tokens (see `DraftVocab`).
    `mesh` / `rules`: where the target's parameters, the batch and both KV caches lie (default:
    one device, DEFAULT_RULES); `draft_rules` (None = `rules`; pairs or a preset name such as
    'data_parallel') shard the draft's parameters and cache differently, e.g. replicated.
    Prompt ids outside [0, vocab_size) raise ValueError before compiling; non-finite logits of
    either model raise guards.NonFiniteLogitsError naming it after the call (stats
    `nonfinite_target` / `nonfinite_draft`; specjax.sampling.guards). `check_finite=False`
    turns the in-loop check off (cost measurement only). `stop_below` h in [0, 1]: a row stops
    proposing in a round after a proposal its draft gives probability < h (at most k;
    specjax.sampling.proposals); the output law is unchanged. `stops` / `grammar` as in
    autoregressive_sample: both models' distributions are masked at the grammar state along the
    drafted prefix and verification is exact for the constrained target law; `finish_reason`.
    A cascade rule (`cascade_*`, specjax.sampling.cascade) is lossy by design: a token draft,
    chains without stop_below only.
    """
    target_graphdef, target_params = split(target)
    draft_graphdef, draft_params = drafters.split_draft(draft)
    fn = make_speculative_fn(
        target_graphdef, draft_graphdef, num_draft_tokens=num_draft_tokens,
        max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, mesh=mesh, rules=rules,
        acceptance=acceptance, draft_vocab_ids=draft_vocab_ids, draft_rules=draft_rules,
        check_finite=check_finite, stop_below=stop_below, grammar=grammar, stops=stops,
    )  # fmt: skip
    return fn(target_params, draft_params, prompts, prompt_lengths, rng)


def make_speculative_fn(
    target_graphdef,
    draft_graphdef,
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_id=None,
    mesh=None,
    rules=None,
    acceptance='probabilistic',
    draft_vocab_ids=None,
    draft_rules=None,
    dynamic_sampling: bool = False,
    check_finite: bool = True,
    stop_below: float | None = None,
    grammar=None,
    stops=None,
    target_logprobs: bool = False,
    _bug=None,
):
    """fn(target_params, draft_params, prompts, prompt_lengths, rng) -> SampleOutput.

    Cached on its arguments: the same static settings return the same jitted function, which
    compiles once per prompt shape. eos_id and the token limit (`fn.with_max_new(n)`, n <=
    max_new_tokens, the output buffer) are arguments of that function (`emit.Stop`), and so
    are `sampling`'s temperature and top_p (`SamplingConfig.traced`): settings of the same structure
    (top_k, greedy or not, top-p filtering or not) share one compiled program, and with
    `dynamic_sampling` every setting at one top_k does (greediness and top-p are then lax.conds:
    free for sampled settings, but greedy rounds then carry the sampled path's unused [B, k, V]
    q, so timed greedy runs keep it off; docs/performance.md has the measured cost).
    Arguments are checked here and in fn before any compile; fn raises NonFiniteLogitsError
    after a call with non-finite logits (`check_finite=False`: unchecked, to measure the cost).
    A cascade's lenience is a run-time value too: `cascade.with_lenience(fn, a)`.
    `target_logprobs`: the output's `target_logprobs` [B, max_new_tokens, V] holds the target's
    log-softmax at every emitted position (specjax.sampling.verified); the tokens are the same.
    """
    k = common.check_positive_int('num_draft_tokens', num_draft_tokens)
    max_new = common.check_positive_int('max_new_tokens', max_new_tokens)
    common.check_sampling(sampling)
    drafter = drafters.drafter_for(target_graphdef, draft_graphdef, 'speculative_sample')
    t_vocab = common.config_of(target_graphdef).vocab_size
    d_vocab = drafters.draft_vocab_size(draft_graphdef, t_vocab)
    vocab = check_draft_vocab(draft_vocab_ids, t_vocab, d_vocab)
    eos_id = common.check_eos(eos_id, t_vocab)
    tables = task.build(grammar, stops, t_vocab, 'speculative_sample')
    acc = as_acceptance(acceptance)
    stop_below = proposals.check_stop_below(stop_below)
    if _bug not in _BUGS:
        raise ValueError(f'_bug must be one of {_BUGS}, got {_bug!r}')
    if acc.cascade and (stop_below is not None or type(drafter) is not drafters.TokenDrafter):
        raise ValueError(f'acceptance {acc.rule!r} needs a token draft and stop_below=None')
    mesh = common.default_mesh() if mesh is None else mesh
    rules = common.normalize_rules(rules)
    program = _cached_fn(
        target_graphdef,
        draft_graphdef,
        k,
        max_new,
        mesh,
        rules,
        common.normalize_draft_rules(draft_rules, rules),
        acc.without_lenience(),  # a cascade's lenience: a run-time value
        vocab,
        _bug,
        bool(check_finite),
        drafter,
        stop_below,
        bool(target_logprobs),
    )
    program = program.with_sampling(sampling, dynamic_sampling, eos_id).with_task(tables)
    return bind_lenience(program, acc.cascade_lenience) if acc.cascade else program


@functools.lru_cache(maxsize=64)
def _cached_fn(
    target_graphdef, draft_graphdef, k, max_new, mesh, rules, draft_rules, acc, vocab, bug,
    check_finite, drafter, stop_below, keep_logp,
):  # fmt: skip
    draft_model = None if isinstance(drafter, drafters.NGramDrafter) else draft_graphdef
    models = (
        ('target', target_graphdef, rules, 'rules'),
        ('draft', draft_model, draft_rules, 'draft_rules'),
    )

    def check(width):
        for name, graphdef, _, _ in models:
            if graphdef is not None:
                cfg = common.config_of(graphdef)
                common.check_fits(cfg, width, max_new, k + 1, f'speculative_sample {name}')

    core = functools.partial(
        _speculative_core,
        target_graphdef,
        draft_graphdef,
        k=k,
        max_new=max_new,
        acc=acc,
        vocab=vocab,
        bug=bug,
        layout=(mesh, rules, draft_rules),
        check_finite=check_finite,
        drafter=drafter,
        stop_below=stop_below,
        keep_logp=keep_logp,
    )
    return common.ShardedSampler(
        core, mesh, rules, check, models, takes_values=True, name='speculative_sample',
        max_new_tokens=max_new,
    )  # fmt: skip


def _speculative_core(
    tgd, dgd, tparams, dparams, prompts, prompt_lengths, rng, values, *, k, max_new, acc, vocab,
    bug, layout, check_finite=True, drafter=drafters.TOKEN_DRAFTER, stop_below=None,
    keep_logp=False,
):  # fmt: skip
    """The sampler's body; values (sampling, stop[, task]): a TracedSampling (or a static
    SamplingConfig: same tokens), an emit.Stop (max_new: the buffer's size at most) and an
    optional task.TaskTables."""
    sampling, stop, con = constrain.unpack(values, prompts.shape[0], vocab.target_vocab)
    lenience = lenience_of(values) if acc.cascade else None
    state = initial_state(
        tgd, dgd, tparams, dparams, prompts, prompt_lengths, k=k, max_new=max_new, vocab=vocab,
        layout=layout, drafter=drafter, keep_logp=keep_logp,
    )  # fmt: skip
    state = state if con is None else state.replace(task=con.initial())
    body = functools.partial(
        _round, tgd, dgd, tparams, dparams, rng, k=k, stop=stop, sampling=sampling, acc=acc,
        vocab=vocab, bug=bug, check_finite=check_finite, drafter=drafter, stop_below=stop_below,
        con=con, lenience=lenience,
    )  # fmt: skip
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    tokens = emit.finish_tokens(state.out, state.emitted, max_new)
    finish, extra = constrain.outputs(con, state.task, tokens, state.emitted, stop.eos_id)
    calls = (state.row_drafted + 1) * int(not drafter.variable_length)  # n-gram: no model
    flags = {name: getattr(state, name) for name in guards.FLAG_STATS}
    stats = st.sampler_stats(state, state.row_drafted, calls, flags) | extra
    logp = verified.output(state.verified, max_new)
    return common.SampleOutput(tokens, state.emitted, stats, finish, logp)


def initial_state(
    tgd, dgd, tparams, dparams, prompts, prompt_lengths, *, k, max_new, vocab, layout,
    drafter=drafters.TOKEN_DRAFTER, keep_logp=False,
):  # fmt: skip
    """The SpeculativeState before the first round: both caches prefilled with the prompts up to
    their last token (which is `last`, fed by round one), nothing emitted; traced, jit it."""
    batch, width = prompts.shape
    prompts = guards.clean_padding(prompts, prompt_lengths)  # nothing past a row's length
    capacity = width + max_new + k + 1
    rows = jnp.arange(batch)
    mesh, rules, draft_rules = layout
    tcache, dcache = common.shard_caches(mesh, (
        (init_cache(common.config_of(tgd), batch, capacity), rules),
        (drafter.new_cache(dgd, batch, capacity), draft_rules),
    ))  # fmt: skip
    _, tcache, features = drafter.target_call(tgd, tparams, prompts, prompt_lengths - 1, tcache)
    dcache, dfeed = drafter.init(dgd, dparams, dcache, prompts, prompt_lengths, vocab, features, k)
    zeros = jnp.zeros((batch,), jnp.int32)
    return SpeculativeState(
        tcache=tcache, dcache=dcache, last=prompts[rows, prompt_lengths - 1], prev=zeros,
        draft_pending=zeros + 1, out=jnp.zeros((batch, max_new + k + 1), jnp.int32),
        emitted=zeros, done=jnp.zeros((batch,), bool), round=jnp.int32(0), row_rounds=zeros,
        row_drafted=zeros,
        row_examined_per_position=jnp.zeros((batch, k), jnp.int32),
        row_accepted_per_position=jnp.zeros((batch, k), jnp.int32),
        **guards.initial_flags(), dfeed=dfeed,
        verified=verified.initial(batch, capacity - width, vocab.target_vocab, keep_logp),
    )  # fmt: skip


def _round(
    tgd, dgd, tparams, dparams, rng, state, *, k, stop, sampling, acc, vocab, bug,
    check_finite=True, drafter, stop_below=None, con=None, lenience=None,
):  # fmt: skip
    active = ~state.done
    act = active.astype(jnp.int32)
    kd = k + acc.cascade  # proposals: a cascade also drafts x_{k+1} (specjax.sampling.cascade)
    # One draw per round; its disjoint slices are independent streams for the draft samples,
    # the acceptance tests and the residual/bonus draw.
    noise = jax.random.uniform(jax.random.fold_in(rng, state.round), (len(act), 2 * kd + 1))
    x_all, q_BKV, m, fed, dcarry, draft_bad = drafter.propose(
        dgd, dparams, state, noise[:, :kd], active, k=kd, sampling=sampling, acc=acc,
        vocab=vocab, bug=bug, check_finite=check_finite, stop_below=stop_below, con=con,
    )  # fmt: skip
    x_BK = x_all[:, :k]  # the proposals the target scores

    tokens = jnp.concatenate([state.last[:, None], x_BK], axis=1)
    variable = stop_below is not None or drafter.variable_length  # rows propose m <= k
    if variable:  # the narrowest verification that holds every row's proposals
        logits, tcache, features = widths.scored_call(
            drafter, tgd, tparams, tokens, m, active, state.tcache
        )
    else:
        logits, tcache, features = drafter.target_call(tgd, tparams, tokens, 0 * act, state.tcache)
    target_bad = guards.any_nonfinite(logits, active, check_finite)
    logp = verified.write(state.verified, logits, state.emitted, active)  # before any mask
    if con is not None:  # p~: masked at the grammar state along the drafted prefix
        g_BK1 = con.walk(state.task.grammar, x_BK)
        logits = con.logits(logits, g_BK1, state.emitted[:, None] + jnp.arange(k + 1)[None])
    greedy = is_greedy(sampling)

    def stopped(verified, bonus):  # rows that proposed m < k: bonus(p_{m+1} [B, V]) [B]
        if not variable:
            return verified
        return stop_at(*verified, m, bonus(take_position(logits, m)))

    def greedy_test(logits):
        best = lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)
        return stopped(verify_greedy(logits, x_BK), best)

    def test(logits):  # the acceptance rule on the transformed p and q
        p_BKV = transform_logits(logits, sampling)
        if bug in (None, 'stop_drops_proposal', 'unmasked_q', 'ngram_soft_q'):
            verified = verify_rule(acc, noise[:, k:-1], noise[:, -1], p_BKV, q_BKV, x_BK)
            draw = lambda lg: inverse_cdf(transform_logits(lg, sampling), noise[:, -1])
            return stopped(verified, draw)
        extra = {}
        if bug == 'residual_untransformed':
            extra['residual_p_BKV'] = jax.nn.softmax(logits / sampling.temperature, axis=-1)
        if bug == 'bonus_from_q':  # q_{k+1} from a throwaway draft call on x_k
            q_logits, _ = drafter.step(dgd, dparams, dcarry, x_BK[:, -1], act, vocab)
            extra['bonus_BV'] = vocab.expand(transform_logits(vocab.restrict(q_logits), sampling))
        return verify(noise[:, k:-1], noise[:, -1], p_BKV, q_BKV, x_BK, **extra)

    if acc.cascade:  # exact speculative sampling against the cascade's law pi
        args = (logits, q_BKV, x_all, noise[:, kd:], sampling)
        num_acc, next_token = verify_round(acc.rule, lenience, *args)
    else:  # greedy: argmax of the logits = argmax of transform_logits' one-hot
        num_acc, next_token = branch(greedy, greedy_test, test, logits)

    # Emit x_1..x_n and the replacement/bonus, cut at eos (or the task's stops) and max_new.
    count, hit_eos, emitted, out = emit.emit_round(
        x_BK, num_acc, next_token, state.out, state.emitted, act, max_new=stop.max_new,
        eos_id=stop.eos_id if con is None else None,
    )  # fmt: skip
    tstate = state.task
    if con is not None:
        count, hit_eos, tstate = con.cut_round(state, g_BK1, x_BK, num_acc, next_token, count)
        emitted = state.emitted + count * act

    # Proposals count as examined/accepted only where they sit inside the row's output.
    i = jnp.arange(k)[None, :]
    counted = (i < count[:, None]) & active[:, None]
    examined = (i < jnp.minimum(num_acc + 1, m)[:, None]) & counted
    accepted = (i < num_acc[:, None]) & counted

    # Roll back: the target keeps last + x_1..x_n; the drafter rolls its draft back.
    keep = lambda new, old: jnp.where(active, new, old)
    dcache, prev, draft_pending, dfeed = drafter.after_round(
        state, dcarry, drafter.fuse(dgd, dparams, features), fed=fed, x_BK=x_all,
        num_acc_B=num_acc, next_B=next_token, active_B=active,
    )  # fmt: skip
    return SpeculativeState(
        tcache=tcache.replace(lengths=keep(tcache.lengths + 1 + num_acc, tcache.lengths)),
        dcache=dcache,
        last=keep(next_token, state.last),
        prev=prev,
        draft_pending=draft_pending,
        out=jnp.where(active[:, None], out, state.out),
        emitted=emitted,
        done=state.done | (active & ((emitted >= stop.max_new) | hit_eos)),
        round=state.round + 1,
        row_rounds=state.row_rounds + act,
        row_drafted=state.row_drafted + m * act,
        row_examined_per_position=state.row_examined_per_position + examined,
        row_accepted_per_position=state.row_accepted_per_position + accepted,
        nonfinite_target=state.nonfinite_target | target_bad,
        nonfinite_draft=state.nonfinite_draft | draft_bad,
        dfeed=dfeed,
        task=tstate,
        verified=logp,
    )
