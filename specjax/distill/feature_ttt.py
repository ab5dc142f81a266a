"""Training-time test (EAGLE-3) for a feature draft (specjax.models.feature_draft): the unrolled
draft, its loss against the frozen target and the jitted training step. Pure functions.

Position convention (the feature sampler's): draft entry t pairs the context token c_t with the
fused target feature f_{t-1} (draft.fuse_features of the target's hidden states at t-1; zeros at
the start of each document, f_{-1} = 0) and predicts c_{t+1}: its target is the target model's
distribution at position t.

The unroll, `ttt_steps` = J steps j = 0..J-1: step 0 reads the true features, e^0_t = (c_t,
f_{t-1}); step j >= 1 reads step j-1's output state, e^j_t = (c_t, h^{j-1}_{t-1}). Query (j, t)
attends to e^0_s for s <= t-j and to e^i_{t-j+i} for i = 1..j (all in t's document): step j at t
is the draft after a true-feature prefix ending at t-j followed by j self-fed proposals, the
state speculative decoding puts it in at depth j. As a mask over the concatenation
[e^0; ...; e^{J-1}] (block-major, positions t for each e^i_t) this is `ttt_mask`; a block's
queries see only its own and earlier blocks, so every block's keys and values are the same in
every later step, for any number of draft layers. Step j therefore runs the draft on block j
alone (T entries), its queries attending, through the draft's KV cache (J T slots, block i at
slots iT..iT+T-1), to the keys and values steps 0..j-1 wrote there and its own: EAGLE-3's reuse
of the prefix's K/V, so step j costs one block, not j + 1.

The loss: at step j, position t, divergence(p_t || q^j_t) (specjax.distill.divergences, by name;
both over the draft's vocabulary: with a reduced map of N target ids the target's logits are
restricted to those ids and renormalised there), averaged over positions whose next token is a
training target (the batch's loss_mask, as the distill loss) and whose anchor t-j lies in t's
document; total = sum_j step_decay^j * loss_j (EAGLE-3's geometric weights, not normalised).

Where the target's side comes from (`targets`): online, the frozen target run on the batch in the
step (its logits and features, float32); cached, the batch's `target_logp` (the target's
log-softmax already restricted to the draft's vocabulary) and `features`, stored in bfloat16 by
specjax.distill.feature_cache and cast to float32 in the step. The divergence softmaxes the
target's side, which leaves log-probs as they are, so both give the same loss up to the cache's
rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.distill.divergences import get_divergence
from specjax.models import apply, init_cache
from specjax.parallel import replicated
from specjax.parallel.sharding import on_mesh

STEP_KEYS = ('tokens', 'positions', 'segment_ids', 'loss_mask')  # what a step reads
CACHED_KEYS = ('features', 'target_logp')  # ... and a cached step too (module docstring)


@dataclasses.dataclass(frozen=True)
class TTTSettings:
    """Static (hashable) description of the TTT loss (config.feature / config.distill)."""

    feature_layers: tuple[int, ...]  # target blocks whose outputs the draft fuses
    ttt_steps: int = 3  # J: unrolled draft steps (1 = true features only)
    step_decay: float = 0.8  # weight of step j: step_decay ** j
    divergence: str = 'fkl'  # a name of specjax.distill.divergences.DIVERGENCES
    beta: float = 0.5  # JSD(beta) weight (divergence 'jsd' only)
    freeze_embedding: bool = True  # the draft's (copied) embedding gets no gradient / update

    def weights(self) -> tuple[float, ...]:
        return tuple(float(self.step_decay) ** j for j in range(self.ttt_steps))


def previous_in_segment(x_BTE, segment_ids_BT):
    """x at t-1 where t-1 is in t's segment, zeros at each segment start: [B, T, E]."""
    prev = jnp.pad(x_BTE[:, :-1], ((0, 0), (1, 0), (0, 0)))
    same = jnp.pad(segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1], ((0, 0), (1, 0)))
    return jnp.where(same[..., None], prev, jnp.zeros_like(prev))


def ttt_structure(t: int, j: int) -> np.ndarray:
    """bool [(j+1)T, (j+1)T], segments aside: query (i, q) sees key (k, s) iff k = 0 and
    s <= q - i, or 1 <= k <= i and s - k = q - i (block-major: row i*T + q, column k*T + s)."""
    i, q = np.divmod(np.arange((j + 1) * t), t)
    k, s = np.divmod(np.arange((j + 1) * t), t)
    i, q, k, s = i[:, None], q[:, None], k[None, :], s[None, :]
    return ((k == 0) & (s <= q - i)) | ((k >= 1) & (k <= i) & (s - k == q - i))


def ttt_mask(segment_ids_BT, j: int):
    """bool [B, (j+1)T, (j+1)T]: ttt_structure within documents (segment ids equal; padding,
    segment 0, sees padding, as the Transformer's mask). Every query sees at least itself."""
    t = segment_ids_BT.shape[1]
    seg = jnp.tile(segment_ids_BT, (1, j + 1))
    same = seg[:, :, None] == seg[:, None, :]
    return jnp.asarray(ttt_structure(t, j))[None] & same


def anchored(loss_mask_BT, segment_ids_BT, j: int):
    """bool [B, T]: loss_mask at t and t - j >= 0 in t's segment (step j's scored positions)."""
    t = segment_ids_BT.shape[1]
    anchor = jnp.pad(segment_ids_BT[:, : t - j], ((0, 0), (j, 0)), constant_values=-1)
    return loss_mask_BT & (anchor == segment_ids_BT)


def unroll(draft, tokens_BT, fused_BTE, positions_BT, segment_ids_BT, steps: int):
    """[(logits_j [B, T, V_d], state_j [B, T, E]) for j = 0..steps-1] (module docstring);
    fused_BTE: f_t, draft.fuse_features of the target's features at t (shifted here)."""
    b, t = tokens_BT.shape
    mask = ttt_mask(segment_ids_BT, steps - 1)  # [B, JT, JT]: step j reads rows jT..jT+T-1
    key_positions = jnp.tile(positions_BT, (1, steps))
    decoder = draft.config.decoder  # slots hold positions < T: the RoPE bound is T, not J T
    decoder = dataclasses.replace(decoder, max_len=max(decoder.max_len, steps * t))
    cache = init_cache(decoder, b, steps * t)
    feats, outs = previous_in_segment(fused_BTE, segment_ids_BT), []
    for j in range(steps):
        if j:
            feats = previous_in_segment(outs[-1][1], segment_ids_BT)
        logits, state, cache = draft.decode(
            tokens_BT, feats, t, cache, positions=positions_BT,
            mask=mask[:, j * t : (j + 1) * t], key_positions=key_positions,
        )  # fmt: skip
        outs.append((logits, state))
    return outs


def on_draft_vocab(logits_BTV, ids_N):
    """The target's logits over the draft's vocabulary: all V, or the N ids (renormalised by
    the divergence's softmax: p~_i = p(ids[i]) / sum_j p(ids[j]))."""
    return logits_BTV if ids_N is None else jnp.take(logits_BTV, jnp.asarray(ids_N), axis=-1)


def ttt_loss(draft, target_logits_BTV, target_features_BTNE, batch, s: TTTSettings, ids_N=None):
    """(loss, metrics): the weighted TTT loss (module docstring); metrics per step j: kd_step{j}
    (its divergence), alpha_step{j} (mean sum min(p, q)), tokens_step{j} (positions scored).

    batch: tokens / positions / segment_ids int32 [B, T], loss_mask bool [B, T-1] (predicting
    tokens[:, 1:], specjax.distill.sources); target_*: the frozen target on batch['tokens'].
    """
    seg = batch['segment_ids']
    fused = draft.fuse_features(target_features_BTNE)
    outs = unroll(draft, batch['tokens'], fused, batch['positions'], seg, s.ttt_steps)
    p = jax.lax.stop_gradient(on_draft_vocab(target_logits_BTV, ids_N))
    loss_mask = jnp.pad(batch['loss_mask'], ((0, 0), (0, 1)))  # the last position: no target
    div = get_divergence(s.divergence, beta=s.beta)
    total, metrics = jnp.float32(0.0), {}
    for j, ((logits, _), w) in enumerate(zip(outs, s.weights(), strict=True)):
        value, m = div(p, logits, anchored(loss_mask, seg, j))
        total = total + w * value
        metrics.update({f'kd_step{j}': value, f'alpha_step{j}': m['alpha']})
        metrics[f'tokens_step{j}'] = m['tokens']
    metrics['loss'] = total
    return total, metrics


def _is_embedding(path) -> bool:
    return getattr(path[0], 'key', None) == 'embed'


def frozen_embedding(tx) -> optax.GradientTransformation:
    """`tx`, then the embedding's update set to zero (weight decay included), so it never moves.
    (Its gradient is stopped in the loss; its moments stay allocated, the optimizer state
    keeping the params' structure for state_shardings.)"""

    def update(updates, state, params=None):
        del params
        zero = lambda path, u: jnp.zeros_like(u) if _is_embedding(path) else u
        return jax.tree_util.tree_map_with_path(zero, updates), state

    return optax.chain(tx, optax.GradientTransformation(lambda _: optax.EmptyState(), update))


def target_forward(teacher_gd, teacher_params, batch, feature_layers):
    """(logits [B, T, V], features [B, T, n, E]) of the frozen target, stop-gradient."""
    out = apply(
        teacher_gd,
        teacher_params,
        batch['tokens'],
        batch['positions'],
        batch['segment_ids'],
        feature_layers=feature_layers,
    )
    return jax.lax.stop_gradient(out)


def targets(teacher_gd, teacher_params, batch, s: TTTSettings, ids_N, cached: bool):
    """(the target's logits or log-probs, features [B, T, n, E], the ids restricting the
    former): online, the frozen target on `batch` (logits [B, T, V], ids_N); cached, the
    batch's target_logp [B, T, N] (already over the draft's vocabulary: ids None) and features,
    float32 (teacher_params unused)."""
    if cached:
        f32 = lambda key: jax.lax.stop_gradient(batch[key].astype(jnp.float32))
        return f32('target_logp'), f32('features'), None
    logits, features = target_forward(teacher_gd, teacher_params, batch, s.feature_layers)
    return logits, features, ids_N


def draft_loss(
    draft_gd, params, teacher_gd, teacher_params, batch, s: TTTSettings, ids_N, cached=False
):
    """ttt_loss of the draft `params` against the target (`targets`) on `batch`."""
    logits, features, ids = targets(teacher_gd, teacher_params, batch, s, ids_N, cached)
    if s.freeze_embedding:
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.lax.stop_gradient(x) if _is_embedding(path) else x, params
        )
    return ttt_loss(nnx.merge(draft_gd, params), logits, features, batch, s, ids)


def feature_step(
    draft_gd, teacher_gd, state, teacher_params, batch, *, tx, schedule, s, ids_N, cached=False
):
    """TrainState of the draft + frozen target params + batch -> (state, metrics)."""
    grad_fn = jax.value_and_grad(draft_loss, argnums=1, has_aux=True)
    (_, metrics), grads = grad_fn(
        draft_gd, state.params, teacher_gd, teacher_params, batch, s, ids_N, cached
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
    rng, _ = jax.random.split(state.rng)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng), metrics


def jit_feature_step(draft_gd, teacher_gd, tx, schedule, s, ids_N, shardings, mesh, cached=False):
    """feature_step jitted once; shardings: (state, teacher params, batch); state donated.
    cached: the batch carries CACHED_KEYS and the target is not run (its params are unused)."""
    fn = functools.partial(
        feature_step,
        draft_gd,
        teacher_gd,
        tx=tx,
        schedule=schedule,
        s=s,
        ids_N=ids_N,
        cached=cached,
    )
    return jax.jit(
        on_mesh(fn, mesh),
        in_shardings=shardings,
        out_shardings=(shardings[0], replicated(mesh)),
        donate_argnums=0,
    )


def jit_eval(draft_gd, teacher_gd, s, ids_N, shardings, mesh, cached=False):
    """(draft params, target params, batch) -> ttt_loss metrics; shardings: those three."""
    fn = lambda p, tp, b: draft_loss(draft_gd, p, teacher_gd, tp, b, s, ids_N, cached)[1]
    return jax.jit(on_mesh(fn, mesh), in_shardings=shardings, out_shardings=replicated(mesh))
