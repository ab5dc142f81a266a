"""Count-based reference losses printed beside the model's validation loss.

Targets are exactly the model's: within each document chunk of <= seq_len tokens
([bos] + ids + [eos], split like the pipeline does), token t+1 is predicted from token t.
Counts come from the train split's chunks; nothing is tuned on validation.

Smoothing (fixed):
  unigram  p1(w) = (c(w) + 1) / (N + V)                       (add-one over the vocabulary)
  bigram   p2(w | v) = max(c(v, w) - d, 0) / c(v) + d * T(v) / c(v) * p1(w),   d = 0.75
           (interpolated absolute discounting; T(v) = distinct successors of v; p2 = p1 if
           c(v) = 0). c(v) counts v as a context, c(w) counts w as a target.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.data import pipeline
from specjax.data.tokenizers import Tokenizer

DISCOUNT = 0.75


@dataclasses.dataclass(frozen=True)
class BigramCounts:
    """Sparse bigram counts: sorted pair keys (prev * V + next), their counts, per-token counts."""

    vocab_size: int
    pair_keys: np.ndarray  # int64 [P], sorted
    pair_counts: np.ndarray  # int64 [P]
    context_counts: np.ndarray  # int64 [V]
    context_types: np.ndarray  # int64 [V]
    target_counts: np.ndarray  # int64 [V]


def chunk_pairs(split: pipeline.TokenizedSplit, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(prev, next) int64 [N] for every in-chunk next-token target of a split."""
    prev, nxt = [], []
    for i in range(len(split)):
        tokens = split[i]['tokens'].astype(np.int64)
        for a in range(0, len(tokens), seq_len):
            piece = tokens[a : a + seq_len]
            prev.append(piece[:-1])
            nxt.append(piece[1:])
    if not prev:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(prev), np.concatenate(nxt)


def batch_pairs(batches: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(prev, next) of the loss convention: t -> t+1 iff seg[t+1] == seg[t] != 0."""
    prev, nxt = [], []
    for b in batches:
        tok, seg = b['tokens'], b['segment_ids']
        mask = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
        prev.append(tok[:, :-1][mask].astype(np.int64))
        nxt.append(tok[:, 1:][mask].astype(np.int64))
    return np.concatenate(prev), np.concatenate(nxt)


def fit_counts(prev: np.ndarray, nxt: np.ndarray, vocab_size: int) -> BigramCounts:
    keys, counts = np.unique(prev * vocab_size + nxt, return_counts=True)
    return BigramCounts(
        vocab_size=vocab_size,
        pair_keys=keys,
        pair_counts=counts.astype(np.int64),
        context_counts=np.bincount(prev, minlength=vocab_size).astype(np.int64),
        context_types=np.bincount(keys // vocab_size, minlength=vocab_size).astype(np.int64),
        target_counts=np.bincount(nxt, minlength=vocab_size).astype(np.int64),
    )


def unigram_probs(counts: BigramCounts) -> np.ndarray:
    """Add-one unigram over target counts, float64 [V]."""
    return (counts.target_counts + 1.0) / (counts.target_counts.sum() + counts.vocab_size)


def cross_entropies(counts: BigramCounts, prev: np.ndarray, nxt: np.ndarray) -> dict:
    """Mean nats/token of the unigram and interpolated bigram models over the (prev, next) pairs."""
    if len(nxt) == 0:
        raise ValueError('no targets to evaluate the baselines on')
    p1 = unigram_probs(counts)
    keys = prev * counts.vocab_size + nxt
    pos = np.searchsorted(counts.pair_keys, keys)
    pos_c = np.minimum(pos, len(counts.pair_keys) - 1)
    found = (len(counts.pair_keys) > 0) & (counts.pair_keys[pos_c] == keys)
    c_pair = np.where(found, counts.pair_counts[pos_c], 0).astype(np.float64)
    c_ctx = counts.context_counts[prev].astype(np.float64)
    types = counts.context_types[prev].astype(np.float64)
    safe = np.maximum(c_ctx, 1.0)
    p2 = np.where(
        c_ctx > 0,
        np.maximum(c_pair - DISCOUNT, 0.0) / safe + DISCOUNT * types / safe * p1[nxt],
        p1[nxt],
    )
    return {
        'unigram': float(-np.log(p1[nxt]).mean()),
        'bigram': float(-np.log(p2).mean()),
        'num_targets': int(len(nxt)),
    }


def baseline_losses(data_config, tok: Tokenizer, batches: list[dict] | None = None) -> dict:
    """{'bigram', 'unigram' (nats/token), 'num_targets'} on the eval split, counts from train.

    With `batches` (from make_eval_batches), evaluates on exactly those batches' targets;
    otherwise on every in-chunk target of `config.data.eval_split`.
    """
    seq_len = data_config.seq_len
    train = pipeline.tokenized_split(data_config, tok, data_config.train_split)
    counts = fit_counts(*chunk_pairs(train, seq_len), tok.vocab_size)
    if batches is None:
        evals = pipeline.tokenized_split(data_config, tok, data_config.eval_split)
        prev, nxt = chunk_pairs(evals, seq_len)
    else:
        prev, nxt = batch_pairs(batches)
    return cross_entropies(counts, prev, nxt)
