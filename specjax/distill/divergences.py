"""Distillation divergences between a target (teacher) p and a draft (student) q, from logits.

Every divergence is a pure function `fn(target_logits_BTV, draft_logits_BTV, mask_BT, *,
temperature=1.0, ...) -> (loss, metrics)`: both logits are divided by the loss `temperature`
(separate from the sampling temperature), turned into float32 log-probabilities, compared per
position, and averaged over the real tokens (mask_BT true). `metrics` holds the loss under the
divergence's name, the per-token acceptance α = Σ_v min(p_v, q_v) at the loss temperature and the
token count. Gradients are meant to flow into the draft logits; callers stop the target's.

Registry names (config.distill.divergence): 'fkl', 'rkl', 'jsd', 'tvd', 'neg_log_alpha',
'expected_accepted_length'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_BIG_LOG_RATIO = 20.0  # above this log-ratio the mixture is computed with logaddexp


def log_probs(logits_BTV, temperature: float = 1.0):
    """float32 log-softmax of logits / temperature, [B, T, V]."""
    return jax.nn.log_softmax(logits_BTV.astype(jnp.float32) / temperature, axis=-1)


def masked_mean(values_BT, mask_BT):
    """Mean of values over mask (0 when the mask is empty); returns (mean, count float32)."""
    mask = mask_BT.astype(jnp.float32)
    count = jnp.sum(mask)
    return jnp.sum(jnp.where(mask_BT, values_BT, 0.0)) / jnp.maximum(count, 1.0), count


def token_log_alpha(logp_BTV, logq_BTV):
    """log α per position, [B, T]: log Σ_v min(p_v, q_v) computed as a log-sum-exp."""
    return jax.nn.logsumexp(jnp.minimum(logp_BTV, logq_BTV), axis=-1)


def _finish(name, values_BT, mask_BT, logp, logq):
    loss, count = masked_mean(values_BT, mask_BT)
    alpha, _ = masked_mean(jnp.exp(token_log_alpha(logp, logq)), mask_BT)
    return loss, {name: loss, 'alpha': jax.lax.stop_gradient(alpha), 'tokens': count}


def _kl(logp_BTV, logq_BTV):
    """KL(p‖q) per position, [B, T] (0·log 0 = 0)."""
    p = jnp.exp(logp_BTV)
    return jnp.sum(jnp.where(p > 0, p * (logp_BTV - logq_BTV), 0.0), axis=-1)


def _log_mix_ratio(d_BTV, w: float):
    """log(w·e^d + 1 − w) for 0 < w < 1: log(m / q) where d = log p − log q, m = w·p + (1−w)·q.

    For moderate d uses log1p(w·expm1(d)), exact even for tiny w (where m ≈ q); for large d
    (q negligible against p) uses logaddexp. The unused branch sees a clamped input so neither
    overflows nor yields NaN gradients.
    """
    small = d_BTV < _BIG_LOG_RATIO
    d_small = jnp.where(small, d_BTV, 0.0)
    d_big = jnp.where(small, _BIG_LOG_RATIO, d_BTV)
    via_expm1 = jnp.log1p(w * jnp.expm1(d_small))
    via_lae = jnp.logaddexp(jnp.log(w) + d_big, jnp.log1p(-w))
    return jnp.where(small, via_expm1, via_lae)


def forward_kl(target_logits_BTV, draft_logits_BTV, mask_BT, *, temperature=1.0):
    """FKL = KL(p‖q) = Σ p (log p − log q): mass-covering; the classic distillation loss."""
    logp = log_probs(target_logits_BTV, temperature)
    logq = log_probs(draft_logits_BTV, temperature)
    return _finish('fkl', _kl(logp, logq), mask_BT, logp, logq)


def reverse_kl(target_logits_BTV, draft_logits_BTV, mask_BT, *, temperature=1.0):
    """RKL = KL(q‖p) = Σ q (log q − log p): mode-seeking."""
    logp = log_probs(target_logits_BTV, temperature)
    logq = log_probs(draft_logits_BTV, temperature)
    return _finish('rkl', _kl(logq, logp), mask_BT, logp, logq)


def jsd(target_logits_BTV, draft_logits_BTV, mask_BT, *, beta=0.5, temperature=1.0):
    """Generalized JSD(β) = β·KL(p‖m) + (1−β)·KL(q‖m), m = β·p + (1−β)·q (probability space).

    The mixture is formed in log space (stable for tiny β or 1−β). JSD(β) itself vanishes as
    β → 0 or 1 (JSD/β → FKL, JSD/(1−β) → RKL); like TRL's GKD, the endpoints are defined as
    β = 0 → FKL and β = 1 → RKL, so the loss scale JUMPS at the endpoints (from ~β·FKL to FKL).
    """
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f'config.distill.beta must be in [0, 1], got {beta!r}')
    if beta == 0.0:
        return _rename(
            forward_kl(target_logits_BTV, draft_logits_BTV, mask_BT, temperature=temperature),
            'fkl',
            'jsd',
        )
    if beta == 1.0:
        return _rename(
            reverse_kl(target_logits_BTV, draft_logits_BTV, mask_BT, temperature=temperature),
            'rkl',
            'jsd',
        )
    logp = log_probs(target_logits_BTV, temperature)
    logq = log_probs(draft_logits_BTV, temperature)
    d = logp - logq
    p, q = jnp.exp(logp), jnp.exp(logq)
    # log p − log m = −log(m/p) = −log((1−β)·e^{−d} + β); log q − log m = −log(β·e^d + 1 − β).
    kl_p_m = -jnp.sum(p * _log_mix_ratio(-d, 1.0 - beta), axis=-1)
    kl_q_m = -jnp.sum(q * _log_mix_ratio(d, beta), axis=-1)
    return _finish('jsd', beta * kl_p_m + (1.0 - beta) * kl_q_m, mask_BT, logp, logq)


def _rename(result, old, new):
    loss, metrics = result
    metrics = dict(metrics)
    metrics[new] = metrics.pop(old)
    return loss, metrics


def tvd(target_logits_BTV, draft_logits_BTV, mask_BT, *, temperature=1.0):
    """Total variation ½Σ|p − q| = 1 − α: tied to the acceptance rate in theory."""
    logp = log_probs(target_logits_BTV, temperature)
    logq = log_probs(draft_logits_BTV, temperature)
    values = 0.5 * jnp.sum(jnp.abs(jnp.exp(logp) - jnp.exp(logq)), axis=-1)
    return _finish('tvd', values, mask_BT, logp, logq)


def neg_log_alpha(target_logits_BTV, draft_logits_BTV, mask_BT, *, temperature=1.0):
    """−log α per position, α = Σ min(p, q) the speculative acceptance probability."""
    logp = log_probs(target_logits_BTV, temperature)
    logq = log_probs(draft_logits_BTV, temperature)
    return _finish('neg_log_alpha', -token_log_alpha(logp, logq), mask_BT, logp, logq)


def block_positions(mask_BT, block_size: int):
    """Cuts each row's runs of consecutive real positions into blocks of `block_size`.

    A run is a maximal stretch of mask-true positions (on generated data: the continuation,
    from the position predicting the first generated token up to eos; on packed data: one
    document). Within a run, positions 0..k−1 form block 1, k..2k−1 block 2, ...; a run's
    last block may be shorter. Returns (index_in_block [B, T] int32 in [0, k), block_start
    [B, T] bool: the first position of its block), both meaningful only where mask_BT is true.
    """
    mask = mask_BT.astype(bool)
    t = jnp.arange(mask.shape[1], dtype=jnp.int32)[None, :]
    prev = jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
    run_start = mask & ~prev
    last_start = jax.lax.cummax(jnp.where(run_start, t, -1), axis=1)
    index = (t - last_start) % block_size
    return index.astype(jnp.int32), mask & (index == 0)


def expected_accepted_length(
    target_logits_BTV, draft_logits_BTV, mask_BT, *, block_size=4, temperature=1.0
):
    """−E[accepted tokens] per drafted token, over blocks of k = block_size draft-sampled tokens.

    Blocks are cut by `block_positions` (consecutive real positions, from the first generated
    position, in chunks of k). A block's expected accepted length is Σ_{i≤k} Π_{j≤i} α_j (the
    draft proposes k tokens and the target accepts a prefix; α_j = Σ min(p_j, q_j)). The loss is
    −(Σ over blocks of that length) / (number of real tokens), in [−1, 0]; metrics also hold the
    mean per block (a run's shorter last block included) as
    `accepted_length_per_block`. Meaningful only on draft-sampled
    (on-policy) continuations, where α_j is the acceptance probability given the draft's prefix.
    """
    logp = log_probs(target_logits_BTV, temperature)
    logq = log_probs(draft_logits_BTV, temperature)
    log_alpha = jnp.where(mask_BT, token_log_alpha(logp, logq), 0.0)
    _, block_start = block_positions(mask_BT, block_size)
    inclusive = jnp.cumsum(log_alpha, axis=1)
    exclusive = inclusive - log_alpha
    t = jnp.arange(mask_BT.shape[1], dtype=jnp.int32)[None, :]
    start_idx = jax.lax.cummax(jnp.where(block_start, t, 0), axis=1)
    base = jnp.take_along_axis(exclusive, start_idx, axis=1)
    prefix_prob = jnp.where(mask_BT, jnp.exp(inclusive - base), 0.0)  # Π_{j≤i} α_j
    loss, count = masked_mean(-prefix_prob, mask_BT)
    num_blocks = jnp.sum(block_start.astype(jnp.float32))
    per_block = jnp.sum(prefix_prob) / jnp.maximum(num_blocks, 1.0)
    alpha, _ = masked_mean(jnp.exp(log_alpha), mask_BT)
    return loss, {
        'expected_accepted_length': loss,
        'accepted_length_per_block': jax.lax.stop_gradient(per_block),
        'alpha': jax.lax.stop_gradient(alpha),
        'tokens': count,
    }


DIVERGENCES = {
    'fkl': forward_kl,
    'rkl': reverse_kl,
    'jsd': jsd,
    'tvd': tvd,
    'neg_log_alpha': neg_log_alpha,
    'expected_accepted_length': expected_accepted_length,
}
ON_POLICY_ONLY = frozenset({'expected_accepted_length'})


def get_divergence(name: str, *, beta: float = 0.5, block_size: int = 4):
    """fn(target_logits_BTV, draft_logits_BTV, mask_BT, *, temperature) for a registry name."""
    if name not in DIVERGENCES:
        raise ValueError(
            f'config.distill.divergence={name!r} is not a known divergence; '
            f'known: {sorted(DIVERGENCES)}'
        )
    if name == 'jsd':
        if not 0.0 <= float(beta) <= 1.0:
            raise ValueError(f'config.distill.beta must be in [0, 1], got {beta!r}')
        return functools.partial(jsd, beta=float(beta))
    if name == 'expected_accepted_length':
        if int(block_size) < 1:
            raise ValueError(f'config.distill.block_size must be >= 1, got {block_size!r}')
        return functools.partial(expected_accepted_length, block_size=int(block_size))
    return DIVERGENCES[name]


def distill_loss(
    divergence_fn,
    target_logits_BTV,
    draft_logits_BTV,
    mask_BT,
    *,
    temperature: float = 1.0,
    scale_by_t2: bool = False,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    ce_targets_BT=None,
    ce_mask_BT=None,
):
    """kd_weight · divergence(stop_gradient(p), q) · (T² if scale_by_t2) + ce_weight · CE(q, data).

    The optional cross-entropy term uses the draft's untempered logits against `ce_targets_BT`
    over `ce_mask_BT` (defaults to mask_BT). Returns (loss, metrics) with 'divergence' and 'ce'.
    target_logits_BTV None (only with kd_weight 0: cross-entropy alone) skips the divergence, so
    a caller need not run the teacher at all; the loss and its gradient are unchanged.
    """
    if target_logits_BTV is None:
        if kd_weight:
            raise ValueError(f'kd_weight={kd_weight} needs target logits for the divergence')
        loss, metrics = jnp.float32(0.0), {}
    else:
        target = jax.lax.stop_gradient(target_logits_BTV)
        div, metrics = divergence_fn(target, draft_logits_BTV, mask_BT, temperature=temperature)
        scale = float(temperature) ** 2 if scale_by_t2 else 1.0
        loss = kd_weight * scale * div
        metrics = dict(metrics, divergence=div)
    if ce_weight:
        if ce_targets_BT is None:
            raise ValueError('config.distill.ce_weight > 0 needs data targets for the CE term')
        logq = log_probs(draft_logits_BTV)
        nll = -jnp.take_along_axis(logq, ce_targets_BT[..., None], axis=-1)[..., 0]
        ce, _ = masked_mean(nll, mask_BT if ce_mask_BT is None else ce_mask_BT)
        loss = loss + ce_weight * ce
        metrics['ce'] = ce
    metrics['loss'] = loss
    return loss, metrics
