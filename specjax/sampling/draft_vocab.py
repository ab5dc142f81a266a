"""Reduced draft vocabulary: the draft proposes only N of the target's V tokens (q = 0 elsewhere).

`draft_vocab_ids` int [N] lists the target token ids the draft may propose, in the order of the
draft's output index. Two draft layouts are accepted:

- draft vocab_size == V (same tokenizer, e.g. the target's own small sibling): its logits are
  restricted to the N ids before the sampling transform (FR-Spec-style pruned output head);
- draft vocab_size == N (a draft trained on the reduced vocabulary): context tokens are mapped to
  draft indices on the way in (target tokens outside the set become draft index 0), and draft
  index i means target token ids[i] on the way out.

Either way q is a distribution over the target's vocabulary that is zero off the set, and every
exact acceptance rule stays exact (exactness never depends on what q is). Top-k / top-p apply to
the draft's N tokens.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """Static (hashable) description of the draft's vocabulary; ids None = the full vocabulary."""

    target_vocab: int
    ids: tuple[int, ...] | None = None
    remap_inputs: bool = False

    def to_draft(self, tokens):
        """Target token ids -> the draft model's input ids (same shape)."""
        if not self.remap_inputs:
            return tokens
        table = np.zeros((self.target_vocab,), np.int32)
        table[list(self.ids)] = np.arange(len(self.ids), dtype=np.int32)
        return jnp.asarray(table)[tokens]

    def restrict(self, logits_V):
        """Draft logits [..., draft vocab] -> [..., N] over the proposable tokens."""
        if self.ids is None or self.remap_inputs:
            return logits_V
        return jnp.take(logits_V, jnp.asarray(self.ids, jnp.int32), axis=-1)

    def token(self, x_N):
        """Draft output indices in [0, N) -> target token ids."""
        if self.ids is None:
            return x_N
        return jnp.asarray(self.ids, jnp.int32)[x_N]

    def expand(self, q_N):
        """[..., N] draft probabilities -> [..., V] over the target vocabulary (0 off the set)."""
        if self.ids is None:
            return q_N
        full = jnp.zeros((*q_N.shape[:-1], self.target_vocab), q_N.dtype)
        return full.at[..., jnp.asarray(self.ids, jnp.int32)].set(q_N)


def check_draft_vocab(draft_vocab_ids, target_vocab: int, draft_vocab: int) -> DraftVocab:
    """Validates draft_vocab_ids against both vocabularies (before any compile)."""
    if draft_vocab_ids is None:
        if target_vocab != draft_vocab:
            raise ValueError(
                f'target vocab_size={target_vocab} differs from draft vocab_size={draft_vocab} '
                '(pass draft_vocab_ids to map a reduced draft vocabulary)'
            )
        return DraftVocab(target_vocab)
    ids = np.asarray(draft_vocab_ids)
    if ids.ndim != 1 or len(ids) < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f'draft_vocab_ids must be a non-empty int [N] array, got shape {ids.shape} '
            f'dtype {ids.dtype}'
        )
    bad = (ids < 0) | (ids >= target_vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f'draft_vocab_ids[{i}]={int(ids[i])}: ids must lie in [0, target vocab_size='
            f'{target_vocab}) ({int(bad.sum())} outside, values in [{ids.min()}, {ids.max()}])'
        )
    if len(np.unique(ids)) != len(ids):
        raise ValueError('draft_vocab_ids has duplicate token ids')
    if draft_vocab not in (target_vocab, len(ids)):
        raise ValueError(
            f'draft vocab_size={draft_vocab} must equal the target vocab_size={target_vocab} '
            f'or len(draft_vocab_ids)={len(ids)}'
        )
    remap = draft_vocab == len(ids) and draft_vocab != target_vocab
    return DraftVocab(target_vocab, tuple(int(i) for i in ids), remap)
