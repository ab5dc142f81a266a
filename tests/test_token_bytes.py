"""token_bytes(): every tokenizer's per-id bytes reassemble encoded text exactly (what stop
strings and grammars match against), vocabulary digests tell tokenizers apart, and a
SentencePiece tokenizer like the embedded corpus's drives a grammar and stops in the samplers."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from gguf_fixtures import MERGES, SPECIALS, vocabulary
from sampling_models import make_model, perturbed, tiny_config

from specjax.data.hf_tokenizer import HuggingFaceTokenizer
from specjax.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    token_bytes,
    train_sentencepiece,
    vocabulary_digest,
)
from specjax.sampling import (
    FinishReason,
    Grammar,
    SamplingConfig,
    Stops,
    autoregressive_sample,
    speculative_sample,
)

TEXTS = [
    'def g(y):\n\treturn {"k": [1, 2]}  # ü 日本 🙂',
    '  spaces  and\n\nnewlines ',
    'The quick brown fox. {"name": "fox", "n": 3}',
]
CORPUS = [
    'def f(x):\n    return x + 1\n\nclass A:\n    pass\n' * 3,
    'The quick brown fox jumps over the lazy dog. {"name": "a", "n": 1, "tags": [2, 3]}\n',
] * 20


@pytest.fixture(scope='module')
def sentencepiece():
    return SentencePieceTokenizer(train_sentencepiece(CORPUS, 320))


@pytest.fixture(scope='module')
def huggingface():
    tokens = vocabulary()
    meta = {
        'tokenizer.ggml.model': 'gpt2',
        'tokenizer.ggml.pre': 'gpt2',
        'tokenizer.ggml.tokens': tokens,
        'tokenizer.ggml.token_type': [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        'tokenizer.ggml.merges': MERGES,
        'tokenizer.ggml.bos_token_id': 1,
        'tokenizer.ggml.eos_token_id': 2,
    }
    return HuggingFaceTokenizer.from_gguf_metadata(meta)


def test_token_bytes_reassemble_the_text(sentencepiece, huggingface):
    toks = (ByteTokenizer(), sentencepiece, huggingface)
    for tok in toks:
        pieces = token_bytes(tok)
        assert len(pieces) == tok.vocab_size
        assert pieces[tok.eos_id] == b'' and pieces[tok.bos_id] == b''
        for text in TEXTS:
            ids = tok.encode(text)
            assert b''.join(pieces[i] for i in ids) == text.encode(), (type(tok), text)
    digests = {vocabulary_digest(t) for t in toks}
    assert len(digests) == 3 and vocabulary_digest(huggingface) in digests
    with pytest.raises(ValueError, match='object has no token_bytes'):
        token_bytes(object())


def test_a_sentencepiece_vocabulary_under_a_schema_and_stops(sentencepiece):
    tok = sentencepiece
    schema = {
        'type': 'object',
        'properties': {'name': {'enum': ['fox', 'dog']}, 'n': {'type': 'integer'}},
        'required': ['name', 'n'],
        'additionalProperties': False,
    }
    grammar = Grammar.from_json_schema(tok, schema)
    target = make_model(tiny_config(tok.vocab_size, max_len=64), seed=0, scale=3.0)
    draft = perturbed(target, seed=1, noise=0.5)
    rows = [tok.encode(t) for t in ('The quick brown ', 'def f(', 'class A:', '{"')]
    prompts = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for r, row in enumerate(rows):
        prompts[r, : len(row)] = row
    lengths = np.array([len(r) for r in rows], np.int32)
    stops = Stops(tok, strings=('99',))
    args = dict(max_new_tokens=40, rng=0, grammar=grammar, stops=stops)
    ar = autoregressive_sample(target, prompts, lengths, sampling=SamplingConfig(0.0), **args)
    chain = speculative_sample(target, draft, prompts, lengths, num_draft_tokens=3,
                               sampling=SamplingConfig(0.0), **args)  # fmt: skip
    np.testing.assert_array_equal(chain.tokens, ar.tokens)
    sampled = speculative_sample(target, draft, prompts, lengths, num_draft_tokens=3,
                                 sampling=SamplingConfig(1.0), **args)  # fmt: skip
    valid = 0
    for out in (ar, sampled):
        for row, n, why in zip(np.asarray(out.tokens), np.asarray(out.lengths),
                               np.asarray(out.finish_reason), strict=True):  # fmt: skip
            text = tok.decode(row[:n])
            if why == FinishReason.STOP_STRING:
                assert '99' in text and '99' not in tok.decode(row[: n - 1])
            elif why != FinishReason.LENGTH:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
    assert valid >= 4, (ar.finish_reason, sampled.finish_reason)
