"""Next-token cross-entropy on packed sequences, in float32, plus per-domain sums for evaluation.

Convention (contracts.md): position t predicts tokens[t + 1] iff
segment_ids[t + 1] == segment_ids[t] != 0, so padding (segment 0) and the first token of the next
packed document are never targets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_targets(tokens_BT, segment_ids_BT):
    """Returns (targets [B, T-1], mask [B, T-1] bool) for predictions at positions 0..T-2."""
    targets = tokens_BT[:, 1:]
    prev_seg, next_seg = segment_ids_BT[:, :-1], segment_ids_BT[:, 1:]
    mask = (next_seg == prev_seg) & (prev_seg != 0)
    return targets, mask


def token_cross_entropy(logits_BTV, targets_BT):
    """Per-position -log softmax(logits)[target] in float32, [B, T]."""
    logits = logits_BTV.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    return lse - target_logit


def next_token_loss(logits_BTV, tokens_BT, segment_ids_BT):
    """Masked per-position losses for next-token prediction.

    Args:
      logits_BTV: model output for every input position [B, T, V].
      tokens_BT, segment_ids_BT: int32 [B, T] packed batch (segment 0 = padding).
    Returns:
      (loss_BT, mask_BT): float32 losses [B, T-1] (zero where masked) and the bool target mask.
    """
    targets, mask = next_token_targets(tokens_BT, segment_ids_BT)
    loss = token_cross_entropy(logits_BTV[:, :-1], targets)
    return jnp.where(mask, loss, 0.0), mask


def mean_loss(loss_BT, mask_BT):
    """Average over real targets (0 when a batch has none); returns (mean, count float32)."""
    count = jnp.sum(mask_BT, dtype=jnp.float32)
    return jnp.sum(loss_BT) / jnp.maximum(count, 1.0), count


def domain_sums(loss_BT, mask_BT, domain_ids_BT, num_domains: int):
    """Loss sums and target counts per domain id in [0, num_domains), each float32 [D].

    domain_ids_BT is aligned with the targets (already shifted); ids outside the range (the -1 of
    padding) contribute nothing.
    """
    onehot_BTD = jax.nn.one_hot(domain_ids_BT, num_domains, dtype=jnp.float32)
    onehot_BTD = onehot_BTD * mask_BT[..., None].astype(jnp.float32)
    sums = jnp.einsum('bt,btd->d', loss_BT, onehot_BTD)
    counts = jnp.sum(onehot_BTD, axis=(0, 1))
    return sums, counts
