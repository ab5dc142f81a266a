"""Hugging Face tokenizers (the `tokenizers` library) behind specjax's Tokenizer protocol.

Built from a `tokenizer.json` (with the special tokens of a `tokenizer_config.json` beside it) or
assembled from a GGUF file's `tokenizer.ggml.*` byte-level BPE (vocabulary, merges, token types,
pre-tokenizer). `encode` never adds bos/eos: specjax's pipelines add them (data.pipeline) and
prompts start with bos (experiments.prompts). `identity()['hash']` is the sha256 of the canonical
tokenizer.json together with the bos/eos/pad ids (`digest()`: all of it). Picklable (grain worker
processes).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

TOKENIZER_JSON = 'tokenizer.json'
TOKENIZER_CONFIG_JSON = 'tokenizer_config.json'
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer splits of the byte-level BPE families llama.cpp names in `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+'
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+'
)


def _gpt2_pre():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_pre(regex: str):
    return lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior='isolated'),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_pre():  # SmolLM / StarCoder: every digit alone, then GPT-2's byte-level split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


GGUF_PRE_TOKENIZERS = {
    'default': _gpt2_pre,
    'gpt2': _gpt2_pre,
    'smollm': _digits_pre,
    'starcoder': _digits_pre,
    'llama-bpe': _split_pre(_LLAMA3_SPLIT),
    'llama3': _split_pre(_LLAMA3_SPLIT),
    'llama-v3': _split_pre(_LLAMA3_SPLIT),
    'smaug-bpe': _split_pre(_LLAMA3_SPLIT),
    'qwen2': _split_pre(_QWEN2_SPLIT),
    'deepseek-r1-qwen': _split_pre(_QWEN2_SPLIT),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (the alphabet of byte-level BPE vocabularies)."""
    keep = list(range(ord('!'), ord('~') + 1))
    keep += list(range(ord('¡'), ord('¬') + 1)) + list(range(ord('®'), ord('ÿ') + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class HuggingFaceTokenizer:
    """A `tokenizers.Tokenizer` with explicit bos/eos/pad ids and an optional chat template."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        bos_id: int,
        eos_id: int,
        pad_id: int | None = None,
        chat_template: str | None = None,
    ):
        self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.tokenizer_json = self._tok.to_str()  # canonical form: what the hash covers
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        pad_id = eos_id if pad_id is None else pad_id
        for name, value in (('bos_id', bos_id), ('eos_id', eos_id), ('pad_id', pad_id)):
            if not isinstance(value, int | np.integer) or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f'HuggingFaceTokenizer {name}={value!r} is not a token id of this '
                    f'vocabulary (size {self.vocab_size})'
                )
        self.bos_id, self.eos_id, self.pad_id = int(bos_id), int(eos_id), int(pad_id)
        self.chat_template = chat_template
        self._bytes = None  # token_bytes(), computed on first use
        scheme = f'{self.tokenizer_json}\nbos={bos_id}:eos={eos_id}:pad={pad_id}'
        self._digest = hashlib.sha256(scheme.encode()).hexdigest()
        self._hash = self._digest[:16]

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str) -> HuggingFaceTokenizer:
        """From a tokenizer.json, or a directory (an HF checkpoint, a specjax workdir) holding one.

        Special tokens come from a tokenizer_config.json beside it (bos_token, eos_token,
        pad_token, chat_template); without one, bos/eos are looked up by common names.
        """
        path = os.path.expanduser(str(path))
        if os.path.isdir(path):
            path = os.path.join(path, TOKENIZER_JSON)
        if not os.path.isfile(path):
            raise FileNotFoundError(f'no tokenizer.json at {path!r}')
        with open(path, encoding='utf-8') as f:
            text = f.read()
        tok = tokenizers.Tokenizer.from_str(text)
        config_path = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_JSON)
        config = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding='utf-8') as f:
                config = json.load(f)

        def token_id(key: str, fallbacks: Sequence[str]) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):  # {'content': ..., ...} in older files
                value = value.get('content')
            names = [value] if value else list(fallbacks)
            for name in names:
                i = tok.token_to_id(name)
                if i is not None:
                    return i
            if value:
                raise ValueError(f'{config_path}: {key}={value!r} is not in the vocabulary')
            return None

        bos = token_id('bos_token', ('<|begin_of_text|>', '<s>', '<|endoftext|>', '<bos>'))
        eos = token_id('eos_token', ('<|end_of_text|>', '</s>', '<|endoftext|>', '<eos>'))
        if bos is None or eos is None:
            raise ValueError(
                f'{path}: cannot tell the bos/eos tokens; write a tokenizer_config.json with '
                "'bos_token' and 'eos_token' beside it"
            )
        pad = token_id('pad_token', ())
        return cls(
            text, bos_id=bos, eos_id=eos, pad_id=pad, chat_template=config.get('chat_template')
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> HuggingFaceTokenizer:
        """From a GGUF file's metadata (key -> value, e.g. 'tokenizer.ggml.tokens' -> [str]).

        Only byte-level BPE ('gpt2' in tokenizer.ggml.model) is assembled; control tokens
        (type 3) become special added tokens, user-defined ones (type 4) plain added tokens.
        """
        kind = meta.get('tokenizer.ggml.model')
        if kind != 'gpt2':
            raise ValueError(
                f"GGUF tokenizer.ggml.model={kind!r} is not supported; only byte-level BPE ('gpt2')"
            )
        pre = meta.get('tokenizer.ggml.pre', 'default')
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(
                f'GGUF tokenizer.ggml.pre={pre!r} is not supported; known: '
                f'{sorted(GGUF_PRE_TOKENIZERS)}'
            )
        tokens = list(meta['tokenizer.ggml.tokens'])
        types = list(meta.get('tokenizer.ggml.token_type') or [1] * len(tokens))
        if 'tokenizer.ggml.merges' not in meta:
            raise ValueError('GGUF has no tokenizer.ggml.merges (needed for byte-level BPE)')
        merges = [tuple(m.split(' ', 1)) for m in meta['tokenizer.ggml.merges']]
        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            if types[i] != _CONTROL and not set(t) <= alphabet:
                t = ''.join(spelling[b] for b in t.encode('utf-8'))
            vocab.setdefault(t, i)
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == _CONTROL and t in vocab
        ]
        tok.add_special_tokens(special)
        tok.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types)
                if ty == _USER_DEFINED and t in vocab
            ]
        )
        if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError(
                f'GGUF tokenizer: assembled {tok.get_vocab_size(with_added_tokens=True)} tokens '
                f'from {len(tokens)} listed (duplicate spellings?)'
            )
        bos = meta.get('tokenizer.ggml.bos_token_id')
        eos = meta.get('tokenizer.ggml.eos_token_id')
        if bos is None or eos is None:
            raise ValueError('GGUF lacks tokenizer.ggml.bos_token_id / eos_token_id')
        return cls(
            tok.to_str(),
            bos_id=int(bos),
            eos_id=int(eos),
            pad_id=meta.get('tokenizer.ggml.padding_token_id'),
            chat_template=meta.get('tokenizer.chat_template'),
        )

    def __getstate__(self):  # Picklable for grain worker processes.
        return {
            'tokenizer_json': self.tokenizer_json,
            'bos_id': self.bos_id,
            'eos_id': self.eos_id,
            'pad_id': self.pad_id,
            'chat_template': self.chat_template,
        }

    def __setstate__(self, state):
        self.__init__(
            state['tokenizer_json'],
            bos_id=state['bos_id'],
            eos_id=state['eos_id'],
            pad_id=state['pad_id'],
            chat_template=state['chat_template'],
        )

    # --- the Tokenizer protocol ---------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids) -> str:
        """Drops pad/bos/eos (like the other tokenizers); other special tokens are kept."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        drop = (arr == self.pad_id) | (arr == self.bos_id) | (arr == self.eos_id)
        return self._tok.decode(arr[~drop].tolist(), skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self._tok.id_to_token(int(i))

    def token_bytes(self) -> tuple[bytes, ...]:
        """Per id the bytes it adds to decoded text: special added tokens b'' (decode keeps
        them as text, but they are control symbols, not output), other added tokens their text,
        byte-level BPE pieces through GPT-2's byte alphabet; tokenizers without a ByteLevel
        decoder fall back to decoding each id alone (exact unless a piece is part of a
        multi-byte character)."""
        if self._bytes is None:
            added = self._tok.get_added_tokens_decoder()
            inverse = {c: b for b, c in _byte_alphabet().items()}
            byte_level = json.loads(self.tokenizer_json).get('decoder', {}) or {}
            byte_level = byte_level.get('type') == 'ByteLevel'
            out = []
            for i in range(self.vocab_size):
                piece = self._tok.id_to_token(i)
                if i in added:
                    out.append(b'' if added[i].special else added[i].content.encode('utf-8'))
                elif piece is None:
                    out.append(b'')
                elif byte_level and all(c in inverse for c in piece):
                    out.append(bytes(inverse[c] for c in piece))
                else:
                    out.append(self._tok.decode([i], skip_special_tokens=False).encode('utf-8'))
            self._bytes = tuple(out)
        return self._bytes

    def identity(self) -> dict:
        return {'kind': 'huggingface', 'vocab_size': self.vocab_size, 'hash': self._hash}

    def digest(self) -> str:
        """The full sha256 hex that identity()['hash'] begins with."""
        return self._digest

    # --- chat and files -----------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt=True
    ) -> str:
        """The chat template rendered for `messages` ([{'role', 'content'}]); encode() the text."""
        if not self.chat_template:
            raise ValueError('this tokenizer has no chat template')
        import jinja2.sandbox  # noqa: PLC0415 (only chat users need jinja2)

        def raise_exception(message):
            raise ValueError(f'chat template: {message}')

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals['raise_exception'] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.id_to_piece(self.bos_id),
            eos_token=self.id_to_piece(self.eos_id),
        )

    def save(self, directory: str) -> None:
        """Writes tokenizer.json and tokenizer_config.json (for transformers' AutoTokenizer)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, TOKENIZER_JSON), 'w', encoding='utf-8') as f:
            f.write(self.tokenizer_json)
        config = {
            'tokenizer_class': 'PreTrainedTokenizerFast',
            'bos_token': self.id_to_piece(self.bos_id),
            'eos_token': self.id_to_piece(self.eos_id),
            'pad_token': self.id_to_piece(self.pad_id),
            'add_bos_token': False,
            'add_eos_token': False,
            'clean_up_tokenization_spaces': False,
        }
        if self.chat_template:
            config['chat_template'] = self.chat_template
        with open(os.path.join(directory, TOKENIZER_CONFIG_JSON), 'w', encoding='utf-8') as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
