"""Autoregressive sampling: one token per cached call, all steps in one jitted lax.while_loop.

The baseline speculative sampling must match in distribution (and token for token when greedy).
Rows are ragged (own prompt length, own eos); finished rows stay inert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.models import apply_cached, init_cache, split
from specjax.sampling import common, constrain, emit, guards, task
from specjax.sampling.transforms import (
    SamplingConfig,
    branch,
    is_greedy,
    sample_from_probs,
    transform_logits,
)


def autoregressive_sample(
    model,
    prompts,
    prompt_lengths,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    rng,
    eos_id=None,
    mesh=None,
    rules=None,
    check_finite: bool = True,
    grammar=None,
    stops=None,
) -> common.SampleOutput:
    """Samples max_new_tokens per row from `model` (prompts int32 [B, P], lengths int32 [B]).

    Returns tokens [B, max_new_tokens] (PAD_ID after each row's end: eos, which is kept, or
    max_new_tokens), lengths [B], finish_reason [B] and stats (`SampleOutput`): one round per
    generated token. `stops` (a Stops, or one per row) and `grammar` (a Grammar) end rows and
    constrain the law (specjax.sampling.task, constrain; docs/design.md).
    Prompt ids outside [0, vocab_size) raise ValueError before compiling; non-finite logits
    raise guards.NonFiniteLogitsError after the call (specjax.sampling.guards; stats
    `nonfinite_target`). `check_finite=False` turns the in-loop check off (cost measurement).
    """
    graphdef, params = split(model)
    fn = make_autoregressive_fn(
        graphdef,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_id=eos_id,
        mesh=mesh,
        rules=rules,
        check_finite=check_finite,
        grammar=grammar,
        stops=stops,
    )
    return fn(params, prompts, prompt_lengths, rng)


def make_autoregressive_fn(
    graphdef,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_id=None,
    mesh=None,
    rules=None,
    dynamic_sampling: bool = False,
    check_finite: bool = True,
    grammar=None,
    stops=None,
):
    """fn(params, prompts, prompt_lengths, rng) -> SampleOutput; cached, and sharing compiled
    programs between settings, eos ids and token limits (`fn.with_max_new`) like
    make_speculative_fn (`dynamic_sampling` and the guards included). Stops and grammar tables
    are jit arguments too: tasks of the same shapes share a program."""
    max_new = common.check_positive_int('max_new_tokens', max_new_tokens)
    common.check_sampling(sampling)
    vocab = common.config_of(graphdef).vocab_size
    eos_id = common.check_eos(eos_id, vocab)
    tables = task.build(grammar, stops, vocab, 'autoregressive_sample')
    mesh = common.default_mesh() if mesh is None else mesh
    rules = common.normalize_rules(rules)
    program = _cached_fn(graphdef, max_new, mesh, rules, bool(check_finite))
    return program.with_sampling(sampling, dynamic_sampling, eos_id).with_task(tables)


@functools.lru_cache(maxsize=64)
def _cached_fn(graphdef, max_new, mesh, rules, check_finite):
    def check(width):
        common.check_fits(
            common.config_of(graphdef), width, max_new, 1, 'autoregressive_sample model'
        )

    core = functools.partial(
        _autoregressive_core, graphdef, max_new=max_new, layout=(mesh, rules),
        check_finite=check_finite,
    )  # fmt: skip
    models = (('model', graphdef, rules, 'rules'),)
    return common.ShardedSampler(
        core, mesh, rules, check, models, takes_values=True, name='autoregressive_sample',
        max_new_tokens=max_new,
    )  # fmt: skip


def _autoregressive_core(
    graphdef, params, prompts, prompt_lengths, rng, values, *, max_new, layout, check_finite=True,
):  # fmt: skip
    """The sampler's body; values (sampling, stop[, task]): a TracedSampling (or a static
    SamplingConfig: same tokens), an emit.Stop (max_new: the buffer's size at most) and an
    optional task.TaskTables."""
    batch, width = prompts.shape
    vocab = common.config_of(graphdef).vocab_size
    sampling, stop, con = constrain.unpack(values, batch, vocab)
    prompts = guards.clean_padding(prompts, prompt_lengths)  # nothing past a row's length
    cache = init_cache(common.config_of(graphdef), batch, width + max_new + 1)
    (cache,) = common.shard_caches(layout[0], ((cache, layout[1]),))
    _, cache = apply_cached(graphdef, params, prompts, prompt_lengths - 1, cache)
    zeros = jnp.zeros((batch,), jnp.int32)
    state = dict(
        cache=cache,
        last=prompts[jnp.arange(batch), prompt_lengths - 1],
        out=jnp.zeros((batch, max_new + 1), jnp.int32),
        emitted=zeros,
        done=jnp.zeros((batch,), bool),
        step=jnp.int32(0),
        nonfinite=jnp.zeros((), bool),
        task=con.initial() if con is not None else (),
    )

    def body(state):
        active = ~state['done']
        act = active.astype(jnp.int32)
        logits, cache = apply_cached(graphdef, params, state['last'][:, None], act, state['cache'])
        scores = logits[:, 0]
        if con is not None:  # the constrained law: disallowed tokens at -inf
            g, n = state['task'].grammar[:, None], state['emitted'][:, None]
            scores = con.logits(logits, g, n)[:, 0]
        # Greedy: argmax of the logits, transform_logits' one-hot without building it.
        argmax = lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)
        sample = lambda lg: sample_from_probs(
            jax.random.fold_in(rng, state['step']), transform_logits(lg, sampling)
        )
        token = branch(is_greedy(sampling), argmax, sample, scores)
        emitted = state['emitted'] + act
        finished = (emitted >= stop.max_new) | (token == stop.eos_id)
        tstate = state['task']
        if con is not None:
            after = con.advance(tstate.grammar, token)[:, None]
            count, reason, new = con.cut(tstate, token[:, None], act, state['emitted'], after)
            finished = (emitted >= stop.max_new) | (reason != task.FinishReason.LENGTH)
            tstate = con.keep(active, new, tstate)
        out = emit.write_rows(state['out'], token[:, None], state['emitted'])
        return dict(
            task=tstate,
            cache=cache,
            last=jnp.where(active, token, state['last']),
            out=jnp.where(active[:, None], out, state['out']),
            emitted=emitted,
            done=state['done'] | (active & finished),
            step=state['step'] + 1,
            nonfinite=state['nonfinite'] | guards.any_nonfinite(logits, active, check_finite),
        )

    state = jax.lax.while_loop(lambda s: ~jnp.all(s['done']), body, state)
    lengths = state['emitted']
    tokens = emit.finish_tokens(state['out'], lengths, max_new)
    finish, extra = constrain.outputs(con, state['task'], tokens, lengths, stop.eos_id)
    return common.SampleOutput(
        tokens=tokens,
        lengths=lengths,
        finish_reason=finish,
        stats=dict(
            emitted=lengths.sum(),
            rounds=lengths.sum(),
            target_calls=(lengths + 1).sum(),
            row_emitted=lengths,
            row_rounds=lengths,
            row_target_calls=lengths + 1,
            batch_rounds=state['step'],
            nonfinite_target=state['nonfinite'],
            nonfinite_draft=jnp.zeros((), bool),
            **extra,
        ),
    )
