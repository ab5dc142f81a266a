"""Evaluation prompts: prefixes of validation documents, with their domain labels."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.data import open_dataset
from specjax.data.pipeline import document_source

_MAX_WINDOWS = 8  # windows per document after its prefix, for domains short of documents


@dataclasses.dataclass
class Prompts:
    """tokens int32 [N, width] right-padded with 0; lengths int32 [N]; domains [N] names; docs."""

    tokens: np.ndarray
    lengths: np.ndarray
    domains: np.ndarray
    docs: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def batches(self, batch_size: int):
        """Yields (rows [n_real], tokens [batch_size, W], lengths [batch_size]); the last batch is
        padded by repeating its first row (callers drop rows past n_real)."""
        for start in range(0, len(self), batch_size):
            rows = np.arange(start, min(start + batch_size, len(self)))
            idx = np.concatenate([rows, np.full(batch_size - len(rows), rows[0])])
            yield rows, self.tokens[idx], self.lengths[idx]


def make_prompts(
    data_config,
    tok,
    *,
    per_domain: int,
    min_len: int,
    max_len: int,
    seed: int,
    split: str | None = None,
) -> Prompts:
    """Up to `per_domain` prompts per domain: documents in seeded order, each cut to its first
    L tokens (starting with the tokenizer's bos, as training documents do).

    L ~ uniform[min_len, max_len] per prompt, capped so the prompt is a strict prefix (the
    document's eos never is in it); documents with fewer than min_len + 1 tokens are skipped.
    Where a domain has fewer than `per_domain` such documents, further prompts are windows of
    its documents at offsets 4 * max_len, 8 * max_len, ... (up to _MAX_WINDOWS per document;
    they start mid-document, as training chunks after a document's first do). Width is max_len.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(
            f'config.eval.prompt_len_min={min_len} / prompt_len_max={max_len}: need 1 <= min <= max'
        )
    if per_domain < 1:
        raise ValueError(f'config.eval.prompts_per_domain must be >= 1, got {per_domain}')
    split = split or data_config.eval_split
    names = open_dataset(data_config).domain_names
    source = document_source(data_config, tok, split)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(source))
    chosen = {d: [] for d in range(len(names))}
    # Pass 0: each document's prefix; pass j >= 1: the window at offset j * stride, for domains
    # that still lack prompts (a split with few documents of a domain).
    stride = 4 * max_len
    for window in range(1 + _MAX_WINDOWS):
        for i in order:
            doc = source[int(i)]
            domain = int(doc['domain'])
            if len(chosen.setdefault(domain, [])) >= per_domain:
                continue
            tokens = np.asarray(doc['tokens'])[window * stride :]
            length = min(int(rng.integers(min_len, max_len + 1)), len(tokens) - 1)
            if length < min_len:
                continue
            chosen[domain].append((tokens[:length], int(i)))
            if all(len(v) >= per_domain for v in chosen.values()):
                break
        if all(len(v) >= per_domain for v in chosen.values()):
            break
    picked = [(d, t, i) for d in sorted(chosen) for t, i in chosen[d]]
    if not picked:
        raise ValueError(
            f'no validation document of split {split!r} has more than '
            f'config.eval.prompt_len_min={min_len} tokens'
        )
    out = np.zeros((len(picked), max_len), np.int32)
    for row, (_, toks, _) in enumerate(picked):
        out[row, : len(toks)] = toks
    domain_name = lambda d: names[d] if 0 <= d < len(names) else str(d)
    return Prompts(
        tokens=out,
        lengths=np.asarray([len(t) for _, t, _ in picked], np.int32),
        domains=np.asarray([domain_name(d) for d, _, _ in picked], dtype=object),
        docs=np.asarray([i for _, _, i in picked], np.int64),
    )
