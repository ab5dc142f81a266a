"""Helpers for the stop and grammar tests: a tokenizer over given byte pieces (small
vocabularies with several tokenisations of one text) and plain-Python references."""

from __future__ import annotations

import hashlib

import numpy as np


class PieceTokenizer:
    """Token id i decodes to pieces[i] (bytes); pad 0 and eos 1 decode to b''. encode: longest
    piece first. Satisfies specjax.data.tokenizers.Tokenizer plus token_bytes()."""

    def __init__(self, pieces, eos_id: int = 1):
        self.pieces = tuple(p.encode() if isinstance(p, str) else bytes(p) for p in pieces)
        self.vocab_size = len(self.pieces)
        self.pad_id, self.bos_id, self.eos_id = 0, 0, eos_id

    def token_bytes(self):
        return self.pieces

    def encode(self, text: str) -> list[int]:
        data, out = text.encode(), []
        by_length = sorted(
            (i for i, p in enumerate(self.pieces) if p), key=lambda i: -len(self.pieces[i])
        )
        while data:
            i = next(i for i in by_length if data.startswith(self.pieces[i]))
            out.append(i)
            data = data[len(self.pieces[i]) :]
        return out

    def encode_batch(self, texts):
        return [np.asarray(self.encode(t), np.int32) for t in texts]

    def decode(self, ids) -> str:
        return b''.join(self.pieces[int(i)] for i in ids).decode('utf-8', 'replace')

    def identity(self) -> dict:
        digest = hashlib.sha256(b'\0'.join(self.pieces)).hexdigest()[:16]
        return {'kind': 'pieces', 'vocab_size': self.vocab_size, 'hash': digest}


# 259 printable pieces: 95 single characters, then two-letter ones (strings span 1-3 tokens);
# the size of ByteTokenizer's vocabulary.
TEXT = PieceTokenizer(
    [''] * 3 + [chr(32 + j) if j < 95 else chr(97 + j % 26) + chr(97 + j // 26 % 26)
                for j in range(256)]
)  # fmt: skip


def first_stop(pieces, tokens, strings=(), token_ids=(), min_new=0):
    """Reference on decoded bytes: (length, reason) where a row of `tokens` ends: after the first
    token at index >= min_new that is a stop id ('token') or whose bytes complete a stop string
    ('string'); (len(tokens), None) when nothing ends it."""
    text = b''
    for n, t in enumerate(tokens):
        start = len(text)
        text += pieces[int(t)]
        if n < min_new:
            continue
        if int(t) in token_ids:
            return n + 1, 'token'
        for s in strings:
            s = s.encode()
            if s in text[max(0, start - len(s) + 1) :]:
                return n + 1, 'string'
    return len(tokens), None
