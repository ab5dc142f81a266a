"""The online draft's programs: its alpha on what was served, and a distillation step on the buffer.

Where the target's distributions come from. The chain sampler computes the target's logits
inside its compiled loop; asked with `target_logprobs=True` it returns their log-softmax at every
emitted position (specjax.sampling.verified: [B, N, V], the distributions it verified with), and
`rescore_program(..., served=True)` then runs only the draft over prompt + served tokens (its
output head at the served positions only), for the draft's acceptance probability
alpha_t = sum_v min(p_v, q_v) at every served position (what the buffer selects by), and
`served_entries` takes the selected positions' log-probs from the sampler's. Without them
(`served=False`) the target runs there too, in one batched forward: the same distributions up
to float rounding between the cached and the uncached forward (the measurement of the arms
that do not learn). Costs: docs/findings.md.

`online_step` is `specjax.distill.steps.draft_update` (the distill mode's update, with its
divergence from `specjax.distill.divergences`) on N rows of the buffer: a row is one request's
longest buffered prefix (one forward serves every entry of a request, instead of one forward
per entry), and the draft's logits are taken at its entries' positions only, [N, E, V] against
their stored target log-probabilities [N, E, V] (E: the most tokens a request is served), not at
all L positions of the row: the output head and the divergence, most of a small draft's step
over a large vocabulary, run on E rows instead of L. A divergence over blocks of consecutive
positions (`expected_accepted_length`) sees a request's entries in position order.
`online_steps` runs an update's steps as one compiled scan over batches stacked on the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

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
    (seq int32 [B, W], mask bool [B, W-1], alpha float32 [B, W-1], logp), W = P + N: position
    t of mask/alpha predicts seq[:, t + 1]; mask marks the served tokens. Without `served_logp`
    the target runs too, and logp is its log-softmax at temperature 1, float32 [B, W-1, V]
    (None unless with_logp). With `served_logp` [B, N, V] (the sampler's, per served token)
    only the draft runs, its logits taken at the served positions alone, and logp is None: the
    entries come from `served_entries`."""
    batch = assemble(prompts, prompt_lengths, tokens, lengths)
    args = (batch['tokens'], batch['positions'], batch['segment_ids'])
    logp = None
    if served_logp is None:
        d_logits = apply(dgd, dparams, *args)[:, :-1]
        t_logits = apply(tgd, tparams, *args)[:, :-1]
        alpha = alpha_per_position(t_logits, d_logits, sampling)
        if with_logp:
            logp = jax.nn.log_softmax(t_logits.astype(jnp.float32), axis=-1)
    else:  # served token j of row b sits at seq[b, P_b + j]: predicted at position P_b + j - 1
        at = _served_positions(prompt_lengths, served_logp.shape[1])
        d_logits = apply(dgd, dparams, *args, logits_at=at)  # [B, N, V]
        alpha_BN = alpha_per_position(served_logp, d_logits, sampling)
        rows = jnp.arange(at.shape[0])[:, None]
        alpha = jnp.zeros(batch['loss_mask'].shape, jnp.float32).at[rows, at].set(alpha_BN)
    return batch['tokens'], batch['loss_mask'], alpha, logp


def _served_positions(prompt_lengths_B, n: int):
    """int32 [B, n]: the position predicting served token j of row b, P_b - 1 + j."""
    return jnp.asarray(prompt_lengths_B, jnp.int32)[:, None] - 1 + jnp.arange(n)[None]


def served_entries(served_logp_BNV, prompt_lengths_B, rows_M, cols_M) -> np.ndarray:
    """The sampler's log-probs (SampleOutput.target_logprobs [B, N, V]) at M positions of the
    scored rows (rows, cols: `select`'s, position cols predicting token cols + 1) -> float32
    [M, V], gathered on the host (M changes every round: no program per M)."""
    rows = np.asarray(rows_M, np.int64)
    j = np.asarray(cols_M, np.int64) - (np.asarray(prompt_lengths_B, np.int64)[rows] - 1)
    return np.asarray(served_logp_BNV)[rows, j]


@functools.lru_cache(maxsize=16)
def rescore_program(tgd, dgd, sampling: SamplingConfig, mesh, with_logp: bool,
                    served: bool = False):  # fmt: skip
    """jit of (tparams, dparams, prompts, prompt_lengths, tokens, lengths[, served_logp]) ->
    _rescore's tuple; with_logp False (measuring alpha only) leaves the [B, W-1, V]
    log-probabilities out; `served`: the target's log-probs come from the sampler
    (SampleOutput.target_logprobs), only the draft runs, and the entries' log-probs are
    `served_entries` of them."""
    fn = functools.partial(_rescore, tgd, dgd, sampling=sampling, with_logp=with_logp)
    if not served:
        fn = functools.partial(fn, served_logp=None)
    return jax.jit(on_mesh(fn, mesh))


def rows_batch(tokens_NL, length_N, at_NE, mask_NE):
    """The buffer's training rows (OnlineBuffer.sample) -> the step's batch: row n is its
    longest prefix (segment 1 up to length_N[n], 0 after); the logits are taken at at_NE only
    and the loss mask mask_NE selects the entries among them."""
    n, width = tokens_NL.shape
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    return {
        'tokens': tokens_NL,
        'positions': jnp.broadcast_to(j, (n, width)),
        'segment_ids': (j < length_N[:, None]).astype(jnp.int32),
        'logits_at': at_NE,
        'loss_mask': mask_NE,
        'ce_mask': jnp.zeros(mask_NE.shape, bool),
    }


def online_step(dgd, state, tokens_NL, length_N, at_NE, mask_NE, teacher_NEV, *, tx, loss):
    """TrainState of the draft + N buffer rows -> (state, metrics): one draft_update toward the
    stored target log-probs teacher_NEV [N, E, V] at the masked entries' positions at_NE."""
    batch = rows_batch(tokens_NL, length_N, at_NE, mask_NE)
    params, opt_state, metrics = draft_update(
        dgd, state.params, state.opt_state, teacher_NEV, batch, tx=tx, loss=loss
    )
    rng, _ = jax.random.split(state.rng)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    return new, metrics


STEP_KEYS = ('tokens', 'length', 'at', 'mask', 'teacher')  # OnlineBuffer.sample's, in order


def online_steps(dgd, state, tokens_SNL, length_SN, at_SNE, mask_SNE, teacher_SNEV, *, tx, loss):
    """S online_steps in one program, batch s taken from index s of every leading axis ->
    (state after the S steps, each step's loss float32 [S]). One dispatch for an update
    instead of S: the same steps in the same order as S calls of `online_step`. Only the loss
    leaves the program, so the step's other metrics (alpha, the gradient's norm: passes over
    [N, E, V]) are not computed."""

    def body(st, batch):
        st, metrics = online_step(dgd, st, *batch, tx=tx, loss=loss)
        return st, metrics['loss']

    return jax.lax.scan(body, state, (tokens_SNL, length_SN, at_SNE, mask_SNE, teacher_SNEV))


def update_batches(buffer, steps: int, n: int, *, per_row: int, seed: int, update: int) -> dict:
    """An update's batches: `buffer.sample(n, ...)` for step 0 .. steps - 1, each STEP_KEYS
    array stacked on a leading [steps] axis (online_steps' input)."""
    batches = [
        buffer.sample(n, per_row=per_row, seed=seed, update=update, step=step)
        for step in range(steps)
    ]
    return {k: np.stack([b[k] for b in batches]) for k in STEP_KEYS}


def jit_online_steps(dgd, tx, loss: LossSettings, state_shardings, batch_sharding, mesh):
    """-> (online_steps jitted with explicit shardings, the stacked batches' sharding: [S]
    replicated, then `batch_sharding`'s layout, to place them with); the draft's state is
    donated."""
    stacked = NamedSharding(mesh, PartitionSpec(None, *batch_sharding.spec))
    return jax.jit(
        on_mesh(functools.partial(online_steps, dgd, tx=tx, loss=loss), mesh),
        in_shardings=(state_shardings, *(stacked,) * len(STEP_KEYS)),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=0,
    ), stacked


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
