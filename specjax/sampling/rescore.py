"""alpha re-scored from sequences a sampler produced: both models (or the n-gram lookup) run
over prompt + generated tokens, and rule `acceptance`'s acceptance probability is taken at each
generated position (spec_eval's alpha, from the target's own samples)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling.ngram import is_ngram, lookup
from specjax.sampling.stats import alpha_per_position


def alpha_of_sequences(
    target,
    draft,
    prompts,
    prompt_lengths,
    tokens,
    lengths,
    sampling,
    draft_vocab_ids=None,
    acceptance='probabilistic',
):
    """alpha at every generated position, by re-scoring prompt + generated tokens with both models.

    prompts int32 [B, P] right-padded with lengths [B]; tokens int32 [B, N] generated, lengths
    [B]. Returns (alpha [B, N] float32, mask [B, N] bool = position generated): alpha[b, j] is
    rule `acceptance`'s acceptance probability (alpha_per_position; sum_v min(p_v, q_v) for the
    default) of the distributions generated token j was drawn from (its context is the prompt
    and tokens[b, :j]). When max_new_tokens <= k no emitted token is a bonus token, so
    these positions are exactly the examined ones. `draft_vocab_ids`: a reduced-vocabulary
    draft (specjax.sampling.draft_vocab): its q is mapped onto the target's vocabulary (0 off
    the set) before alpha is taken.
    """
    from specjax.models import split
    from specjax.parallel.distributed import to_host
    from specjax.sampling.acceptance import as_acceptance
    from specjax.sampling.draft_vocab import check_draft_vocab
    from specjax.sampling.drafters import draft_vocab_size, split_draft

    t_graphdef, t_params = split(target)
    d_graphdef, d_params = split_draft(draft)
    prompts = np.asarray(jax.device_get(prompts), np.int32)
    p_len = np.asarray(jax.device_get(prompt_lengths), np.int32)
    tokens = np.asarray(jax.device_get(tokens), np.int32)
    g_len = np.asarray(jax.device_get(lengths), np.int32)
    batch, width = prompts.shape
    n = tokens.shape[1]
    t_vocab = target.config.vocab_size
    vocab = check_draft_vocab(draft_vocab_ids, t_vocab, draft_vocab_size(d_graphdef, t_vocab))
    # A feature draft's alpha here is its first proposal's (true target features); later
    # proposals read its own states, whose acceptance the sampler's per-position counts give.
    seq = np.zeros((batch, width + n), np.int32)
    for b in range(batch):
        seq[b, : p_len[b]] = prompts[b, : p_len[b]]
        seq[b, p_len[b] : p_len[b] + g_len[b]] = tokens[b, : g_len[b]]
    alpha, proposed = _alpha_of_sequences(
        t_graphdef,
        d_graphdef,
        n,
        vocab,
        as_acceptance(acceptance),
        t_params,
        d_params,
        jnp.asarray(seq),
        jnp.asarray(p_len),
        sampling.traced(dynamic=True),  # one compile for every setting
    )
    mask = (np.arange(n)[None, :] < g_len[:, None]) & to_host(proposed)
    return np.where(mask, to_host(alpha), 0.0), mask  # to_host: rows may span processes


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _alpha_of_sequences(
    t_graphdef, d_graphdef, n, vocab, acc, t_params, d_params, seq_BL, p_len_B, sampling
):
    """([B, n] rule acc's alpha at the positions predicting generated tokens 0..n-1, [B, n]
    whether the draft proposes there: always for a model, where a match exists for an n-gram
    draft, whose q is the one-hot of its first proposal)."""
    from specjax.models import apply, merge
    from specjax.sampling.drafters import feature_config_of

    idx_BN = p_len_B[:, None] - 1 + jnp.arange(n)[None, :]
    take = lambda logits_BLV: jnp.take_along_axis(logits_BLV, idx_BN[..., None], axis=1)
    proposed = jnp.ones(idx_BN.shape, bool)
    feature = None if is_ngram(d_graphdef) else feature_config_of(d_graphdef)
    if is_ngram(d_graphdef):
        p_logits = take(apply(t_graphdef, t_params, seq_BL))
        first = lambda length_B: lookup(seq_BL, length_B, k=1, max_n=d_graphdef.max_n,
                                        min_n=d_graphdef.min_n)[:2]  # fmt: skip
        x_NB1, found_NB = jax.vmap(first)(p_len_B[None, :] + jnp.arange(n)[:, None])
        proposed = found_NB.T
        hit = jnp.arange(p_logits.shape[-1]) == x_NB1[:, :, 0].T[..., None]
        q_logits = jnp.where(hit, 0.0, -1e9)
    elif feature is None:
        p_logits = take(apply(t_graphdef, t_params, seq_BL))
        q_logits = vocab.restrict(take(apply(d_graphdef, d_params, vocab.to_draft(seq_BL))))
    else:  # a feature draft reads the target's true features (its first proposal's q)
        t_logits, features = apply(
            t_graphdef, t_params, seq_BL, feature_layers=feature.feature_layers
        )
        draft = merge(d_graphdef, d_params)
        fused = draft.fuse_features(features)
        shifted = jnp.concatenate([jnp.zeros_like(fused[:, :1]), fused[:, :-1]], axis=1)
        p_logits, q_logits = take(t_logits), vocab.restrict(take(draft(seq_BL, shifted)[0]))
    if vocab.ids is not None:  # [.., N] -> [.., V]: effectively -inf off the set (q = 0 there)
        full = jnp.full((*q_logits.shape[:-1], vocab.target_vocab), -1e9, jnp.float32)
        q_logits = full.at[..., jnp.asarray(vocab.ids, jnp.int32)].set(q_logits)
    return alpha_per_position(p_logits, q_logits, sampling, acc), proposed
