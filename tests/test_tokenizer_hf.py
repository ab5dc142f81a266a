"""HuggingFaceTokenizer: the Tokenizer protocol, identity, pickling, files transformers loads,
and build_tokenizer's 'huggingface' kind. Uses the tiny GGUF's byte-level BPE (fast)."""

from __future__ import annotations

import pickle

import ml_collections
import numpy as np
import pytest
from gguf_fixtures import MERGES, SPECIALS, vocabulary

from specjax.data import tokenizers
from specjax.data.hf_tokenizer import HuggingFaceTokenizer

TEXTS = ['the thin ant', '  a\n\n\tb  ', 'é 🙂', '']


@pytest.fixture(scope='module')
def tok():
    tokens = vocabulary()
    meta = {
        'tokenizer.ggml.model': 'gpt2',
        'tokenizer.ggml.pre': 'gpt2',
        'tokenizer.ggml.tokens': tokens,
        'tokenizer.ggml.token_type': [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        'tokenizer.ggml.merges': MERGES,
        'tokenizer.ggml.bos_token_id': 1,
        'tokenizer.ggml.eos_token_id': 2,
        'tokenizer.chat_template': '{% for m in messages %}{{ m.content }}{% endfor %}',
    }
    return HuggingFaceTokenizer.from_gguf_metadata(meta)


def test_protocol_round_trip_and_no_implicit_bos(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    batch = tok.encode_batch(TEXTS)
    assert all(b.dtype == np.int32 and b.tolist() == tok.encode(t) for b, t in zip(batch, TEXTS))
    assert tok.encode('<|im_start|>the') == [1, *tok.encode('the')]  # specials stay whole
    assert tok.pad_id == tok.eos_id == 2  # no padding id in the metadata: eos pads
    assert tok.identity()['kind'] == 'huggingface'
    assert tok.identity()['vocab_size'] == len(vocabulary())


def test_pickle_save_and_from_file_keep_the_identity(tok, tmp_path):
    again = pickle.loads(pickle.dumps(tok))
    assert again.identity() == tok.identity() and again.encode('the hat') == tok.encode('the hat')
    tok.save(str(tmp_path))
    loaded = HuggingFaceTokenizer.from_file(str(tmp_path))
    assert loaded.identity() == tok.identity()
    assert loaded.chat_template == tok.chat_template
    other = HuggingFaceTokenizer(tok.tokenizer_json, bos_id=0, eos_id=2)
    assert other.identity()['hash'] != tok.identity()['hash']  # special ids are in the hash


def test_saved_files_load_in_transformers(tok, tmp_path):
    transformers = pytest.importorskip('transformers')
    tok.save(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    msgs = [{'role': 'user', 'content': 'the'}]
    assert hf.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs)


def test_build_tokenizer_huggingface_kind(tok, tmp_path):
    tok.save(str(tmp_path))
    cfg = ml_collections.ConfigDict({'tokenizer': 'huggingface', 'tokenizer_path': str(tmp_path)})
    assert tokenizers.build_tokenizer(cfg).identity() == tok.identity()
    cfg.tokenizer_path = str(tmp_path / 'tokenizer.json')
    assert tokenizers.build_tokenizer(cfg).identity() == tok.identity()
    cfg.tokenizer_path = ''
    with pytest.raises(ValueError, match='tokenizer_path'):
        tokenizers.build_tokenizer(cfg)
    cfg.tokenizer_path = str(tmp_path / 'nowhere')
    with pytest.raises(ValueError, match='nowhere'):
        tokenizers.build_tokenizer(cfg)
    with pytest.raises(ValueError, match="'sentencepiece', 'byte', 'huggingface'"):
        tokenizers.build_tokenizer(ml_collections.ConfigDict({'tokenizer': 'wordpiece'}))


@pytest.mark.parametrize(
    'key, value, match',
    [
        ('tokenizer.ggml.model', 'llama', "'llama' is not supported"),
        ('tokenizer.ggml.pre', 'mystery', "'mystery' is not supported"),
        ('tokenizer.ggml.bos_token_id', 10**6, 'bos_id'),
    ],
)
def test_unsupported_gguf_tokenizers_are_refused(key, value, match):
    tokens = vocabulary()
    meta = {
        'tokenizer.ggml.model': 'gpt2',
        'tokenizer.ggml.tokens': tokens,
        'tokenizer.ggml.merges': MERGES,
        'tokenizer.ggml.bos_token_id': 1,
        'tokenizer.ggml.eos_token_id': 2,
        key: value,
    }
    with pytest.raises(ValueError, match=match):
        HuggingFaceTokenizer.from_gguf_metadata(meta)
