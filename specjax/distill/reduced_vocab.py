"""Distillation onto a reduced draft vocabulary: the N most frequent target tokens.

A draft whose embedding and output layer cover only N of the target's V tokens (its output index
i means target token ids[i]; specjax.sampling.draft_vocab serves it exactly). Pure functions:

- the set: `corpus_counts` (token frequencies of a tokenized split, each document's bos and eos
  counted) and `top_ids` (the N most frequent, ties by the smaller id);
- the teacher, restricted: `teacher_topk` keeps, per position, the K most probable of the N ids
  with their log-probabilities under the teacher's full-V softmax (what the cache stores);
  `teacher_on_set` keeps all N (held-out alpha needs them);
- the losses over the N ids:
  KD   p~ = the teacher's distribution restricted to the cached top-K of the N-set and
       renormalised there: p~_i = p(ids[i]) / sum_{j in topK} p(ids[j]) (0 elsewhere);
       a divergence of specjax.distill.divergences between p~ and q = softmax of the draft's
       N logits, e.g. FKL(p~ || q) = sum_i p~_i (log p~_i - log q_i) or TVD = 1 - sum min.
       Every position with a next-token target counts (the teacher's distribution is
       informative even where the data token is outside the set).
  CE   -log q[index of the data token], averaged over positions whose next token is in the set;
       positions whose target is outside the set are masked (the draft can never propose it,
       so no loss can teach it to).
- `alpha_terms`: held-out acceptance of the reduced draft against the teacher's FULL distribution
  (q = 0 off the set): alpha_T1 = sum_i min(p(ids[i]), q_i), alpha_T0 = [ids[argmax q] = argmax p].

Shapes: *_BTV teacher logits over V, *_BTN draft logits over N, *_BTK cached top-K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.distill import divergences


def corpus_counts(ids, offsets, vocab_size: int, bos_id: int | None, eos_id: int | None):
    """int64 [V] token counts of a tokenized split (flat ids, offsets [docs + 1])."""
    counts = np.bincount(np.asarray(ids, np.int64), minlength=vocab_size).astype(np.int64)
    if len(counts) > vocab_size:
        raise ValueError(f'token ids reach {len(counts) - 1}, beyond vocab_size={vocab_size}')
    docs = len(offsets) - 1
    for special in (bos_id, eos_id):
        if special is not None:
            counts[special] += docs
    return counts


def top_ids(counts_V, n: int, field: str = 'config.vocab.size') -> np.ndarray:
    """int32 [n]: the n most frequent token ids, most frequent first (ties: smaller id first)."""
    counts_V = np.asarray(counts_V)
    vocab = len(counts_V)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n <= vocab:
        raise ValueError(
            f'{field}={n!r} must be an int in [1, {vocab}] (the target vocabulary has {vocab} '
            'tokens)'
        )
    order = np.lexsort((np.arange(vocab), -counts_V))
    return order[:n].astype(np.int32)


def index_table(ids_N, vocab_size: int) -> np.ndarray:
    """int32 [V]: target id -> draft index, -1 off the set."""
    table = np.full((vocab_size,), -1, np.int32)
    table[np.asarray(ids_N)] = np.arange(len(ids_N), dtype=np.int32)
    return table


def teacher_topk(logits_BTV, ids_N, k: int):
    """(idx_BTK int32 draft indices, logp_BTK float32): the K most probable of the N-set tokens,
    log-probabilities under the full-V softmax (sum of exp < 1: the rest of V is not kept)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    on_set = jnp.take(logp_BTV, jnp.asarray(ids_N, jnp.int32), axis=-1)
    logp, idx = jax.lax.top_k(on_set, k)
    return idx.astype(jnp.int32), logp


def teacher_on_set(logits_BTV, ids_N):
    """(logp_BTN float32 under the full-V softmax, argmax_BT int32 target id over all of V)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    on_set = jnp.take(logp_BTV, jnp.asarray(ids_N, jnp.int32), axis=-1)
    return on_set, jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)


OFF_TOP_K = -1e9  # a teacher logit off its cached top K: probability exactly 0 after softmax


def restricted_teacher_logits(idx_BTK, logp_BTK, n: int):
    """float32 [B, T, N] logits whose softmax is p~ (the cached top K renormalised, 0 elsewhere),
    so every divergence of specjax.distill.divergences applies to the reduced draft as is."""
    b, t, _ = idx_BTK.shape
    logits = jnp.full((b, t, n), OFF_TOP_K, jnp.float32)
    rows = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    return logits.at[rows[0], rows[1], idx_BTK].set(logp_BTK.astype(jnp.float32))


def kd_loss(draft_logits_BTN, idx_BTK, logp_BTK, mask_BT, divergence: str = 'fkl', beta=0.5):
    """Mean over mask of divergence(p~ || q) (specjax.distill.divergences by name; 'fkl' is
    FKL(p~ || q)), p~ the cached top-K renormalised (see the module doc)."""
    fn = divergences.get_divergence(divergence, beta=beta)
    teacher = restricted_teacher_logits(idx_BTK, logp_BTK, draft_logits_BTN.shape[-1])
    loss, _ = fn(jax.lax.stop_gradient(teacher), draft_logits_BTN, mask_BT)
    return loss


def ce_loss(draft_logits_BTN, target_idx_BT, mask_BT):
    """Mean over mask & in-set (target_idx >= 0) of -log q[target_idx]; returns (loss, count)."""
    logq_BTN = jax.nn.log_softmax(draft_logits_BTN.astype(jnp.float32), axis=-1)
    valid = mask_BT & (target_idx_BT >= 0)
    safe = jnp.where(valid, target_idx_BT, 0)
    nll_BT = -jnp.take_along_axis(logq_BTN, safe[..., None], axis=-1)[..., 0]
    count = jnp.sum(valid.astype(jnp.float32))
    return jnp.sum(jnp.where(valid, nll_BT, 0.0)) / jnp.maximum(count, 1.0), count


def alpha_terms(draft_logits_BTN, teacher_logp_BTN, teacher_argmax_BT, ids_N, mask_BT):
    """(sum of alpha_T1, sum of alpha_T0, count) over mask, against the full teacher (q = 0 off
    the set, so off-set teacher mass is never matched)."""
    q_BTN = jax.nn.softmax(draft_logits_BTN.astype(jnp.float32), axis=-1)
    a1 = jnp.sum(jnp.minimum(jnp.exp(teacher_logp_BTN), q_BTN), axis=-1)
    ids = jnp.asarray(ids_N, jnp.int32)
    a0 = (ids[jnp.argmax(draft_logits_BTN, axis=-1)] == teacher_argmax_BT).astype(jnp.float32)
    m = mask_BT.astype(jnp.float32)
    return jnp.sum(a1 * m), jnp.sum(a0 * m), jnp.sum(m)
