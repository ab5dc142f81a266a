"""The online draft's programs: its alpha on what was served, and a distillation step on the buffer.

Where the target's distributions come from. The chain sampler computes the target's logits
inside its compiled loop; asked with `target_logprobs=True` it returns their log-softmax at every
emitted position (specjax.sampling.verified: [B, N, V], the distributions it verified with), and
`rescore_program(..., served=True)` then runs only the draft over prompt + served tokens, for the
draft's acceptance probability alpha_t = sum_v min(p_v, q_v) at every served position (what the
buffer selects by). Without them (`served=False`) the target runs there too, in one batched
forward: the same distributions up to float rounding between the cached and the uncached
forward (the measurement of the arms that do not learn). Costs: docs/findings.md.

`online_step` is `specjax.distill.steps.draft_update` (the distill mode's update, with its
divergence from `specjax.distill.divergences`) on N rows of the buffer: a row is one request's
longest buffered prefix, its entries' stored target log-probabilities sit at their positions of
a [N, L, V] teacher tensor and the loss mask selects those positions (one forward serves every
entry of a request, instead of one forward per entry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.distill.sources import assemble
from specjax.distill.steps import LossSettings, draft_update
from specjax.models import apply
from specjax.parallel import replicated
from specjax.parallel.sharding import on_mesh
from specjax.sampling import SamplingConfig
from specjax.sampling.stats import alpha_per_position


def _rescore(tgd, dgd, tparams, dparams, prompts, prompt_lengths, tokens, lengths,
             served_logp=None, *, sampling, with_logp):  # fmt: skip
    """prompts int32 [B, P] (lengths [B]) + served tokens int32 [B, N] (lengths [B]) ->
    (seq int32 [B, W], mask bool [B, W-1], alpha float32 [B, W-1], logp float32 [B, W-1, V]
    or None), W = P + N: position t of mask/alpha/logp predicts seq[:, t + 1]; mask marks the
    served tokens; logp is the target's log-softmax at temperature 1: from `served_logp`
    [B, N, V] (the sampler's, per served token) where given, else from a target forward."""
    batch = assemble(prompts, prompt_lengths, tokens, lengths)
    args = (batch['tokens'], batch['positions'], batch['segment_ids'])
    d_logits = apply(dgd, dparams, *args)[:, :-1]
    if served_logp is None:
        t_logits = apply(tgd, tparams, *args)[:, :-1]
    else:  # served token j of row b sits at seq[b, P_b + j]: predicted at position P_b + j - 1
        n = served_logp.shape[1]
        at = jnp.asarray(prompt_lengths, jnp.int32)[:, None] - 1 + jnp.arange(n)[None]
        rows = jnp.arange(at.shape[0])[:, None]
        blank = jnp.zeros(d_logits.shape[:2] + served_logp.shape[2:], jnp.float32)
        t_logits = blank.at[rows, at].set(served_logp, mode='drop')
    alpha = alpha_per_position(t_logits, d_logits, sampling)
    logp = None
    if with_logp:  # the sampler's entries are log-probs already (zeros off the served tokens)
        normalize = lambda lg: jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)
        logp = t_logits if served_logp is not None else normalize(t_logits)
    return batch['tokens'], batch['loss_mask'], alpha, logp


@functools.lru_cache(maxsize=16)
def rescore_program(tgd, dgd, sampling: SamplingConfig, mesh, with_logp: bool,
                    served: bool = False):  # fmt: skip
    """jit of (tparams, dparams, prompts, prompt_lengths, tokens, lengths[, served_logp]) ->
    _rescore's tuple; with_logp False (measuring alpha only) leaves the [B, W-1, V]
    log-probabilities out; `served`: the target's log-probs come from the sampler
    (SampleOutput.target_logprobs) and only the draft runs."""
    fn = functools.partial(_rescore, tgd, dgd, sampling=sampling, with_logp=with_logp)
    if not served:
        fn = functools.partial(fn, served_logp=None)
    return jax.jit(on_mesh(fn, mesh))


def rows_batch(tokens_NL, length_N, mask_NL1):
    """The buffer's training rows (OnlineBuffer.sample) -> the step's batch: row n is its
    longest prefix (segment 1 up to length_N[n], 0 after); the loss mask mask_NL1 [N, L - 1]
    selects the positions whose target law the buffer holds."""
    n, width = tokens_NL.shape
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    return {
        'tokens': tokens_NL,
        'positions': jnp.broadcast_to(j, (n, width)),
        'segment_ids': (j < length_N[:, None]).astype(jnp.int32),
        'loss_mask': mask_NL1,
        'ce_mask': jnp.zeros((n, width - 1), bool),
    }


def online_step(dgd, state, tokens_NL, length_N, mask_NL1, teacher_NLV, *, tx, loss):
    """TrainState of the draft + N buffer rows -> (state, metrics): one draft_update toward the
    stored target log-probs teacher_NLV [N, L, V] at the masked positions."""
    batch = rows_batch(tokens_NL, length_N, mask_NL1)
    params, opt_state, metrics = draft_update(
        dgd, state.params, state.opt_state, teacher_NLV, batch, tx=tx, loss=loss
    )
    rng, _ = jax.random.split(state.rng)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    return new, metrics


STEP_KEYS = ('tokens', 'length', 'mask', 'teacher')  # OnlineBuffer.sample's arrays, in order


def jit_online_step(dgd, tx, loss: LossSettings, state_shardings, batch_sharding, mesh):
    """online_step jitted once with explicit shardings; the draft's state is donated."""
    return jax.jit(
        on_mesh(functools.partial(online_step, dgd, tx=tx, loss=loss), mesh),
        in_shardings=(state_shardings, *(batch_sharding,) * len(STEP_KEYS)),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=0,
    )


def loss_settings(online) -> LossSettings:
    """config.online's divergence fields as the distill step's LossSettings (no CE term)."""
    return LossSettings(
        divergence=online.divergence,
        beta=float(online.beta),
        temperature=float(online.loss_temperature),
        scale_by_t2=bool(online.scale_by_t2),
        kd_weight=1.0,
        ce_weight=0.0,
    )
