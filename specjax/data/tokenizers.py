"""Tokenizers: SentencePiece BPE that round-trips code exactly, a byte-level one for tests, and
Hugging Face ones (hf_tokenizer.py) for imported models.

SentencePiece and byte use pad=0, bos=1, eos=2; every tokenizer exposes encode/decode/
vocab_size/pad_id/bos_id/eos_id, `identity()` ({'kind', 'vocab_size', 'hash'}) that
checkpoints record, and `digest()`: the sha256 hex of its canonical content, the same on every
machine (results record it: specjax.data.digests). `decode` drops pad/bos/eos.

Stop strings and grammars (specjax.sampling.Stops / Grammar) match the bytes of decoded text,
so each tokenizer here also gives `token_bytes()`: per token id the UTF-8 bytes it contributes
to decoded text (b'' for special tokens: pad, bos, eos, control), such that
b''.join(token_bytes()[i] for i in encode(s)) == s.encode(). `token_bytes(tokenizer)` and
`vocabulary_digest(tokenizer)` (a hash of those bytes and the eos id: what a grammar was built
for) accept any tokenizer with that method.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np
import sentencepiece as spm
from etils import epath
from sentencepiece import sentencepiece_model_pb2

from specjax.data import sources

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# Bump when the trainer settings below change: cached models carry it in their file name.
SPM_SETTINGS_TAG = 'bpe1'
SPM_MAX_SENTENCE_BYTES = 4096
KINDS = ('sentencepiece', 'byte', 'huggingface')


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def identity(self) -> dict: ...

    def digest(self) -> str: ...


def token_bytes(tokenizer) -> tuple[bytes, ...]:
    """The bytes each token id adds to decoded text (b'' for special ids), vocab_size entries;
    ValueError naming the tokenizer's type when it cannot tell (no `token_bytes()` method)."""
    method = getattr(tokenizer, 'token_bytes', None)
    if method is None:
        raise ValueError(
            f'{type(tokenizer).__name__} has no token_bytes(): stop strings and grammars need '
            'the bytes of every token id (see specjax.data.tokenizers)'
        )
    out = tuple(method())
    if len(out) != tokenizer.vocab_size:
        raise ValueError(
            f'{type(tokenizer).__name__}.token_bytes() gave {len(out)} entries for '
            f'vocab_size={tokenizer.vocab_size}'
        )
    return out


def vocabulary_digest(tokenizer) -> str:
    """A 16-hex-digit sha256 of every token's bytes (length-prefixed) and the eos id: equal for
    tokenizers that decode every id alike, different otherwise."""
    h = hashlib.sha256(f'eos={tokenizer.eos_id}:n={tokenizer.vocab_size}'.encode())
    for b in token_bytes(tokenizer):
        h.update(len(b).to_bytes(4, 'little') + b)
    return h.hexdigest()[:16]


def _num_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _ids_list(ids) -> list[int]:
    return np.asarray(ids, dtype=np.int64).reshape(-1).tolist()


class ByteTokenizer:
    """UTF-8 bytes offset by 3 (pad 0, bos 1, eos 2); vocab 259. Invalid UTF-8 decodes to U+FFFD."""

    OFFSET = 3
    vocab_size = 256 + OFFSET
    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    SCHEME = f'byte:utf-8:offset={OFFSET}:pad={PAD_ID}:bos={BOS_ID}:eos={EOS_ID}'  # digest()'s

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32) + self.OFFSET

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        arr = arr[(arr >= self.OFFSET) & (arr < self.vocab_size)] - self.OFFSET
        return arr.astype(np.uint8).tobytes().decode('utf-8', errors='replace')

    def token_bytes(self) -> tuple[bytes, ...]:
        """b'' for pad/bos/eos, then the 256 single bytes."""
        return (b'',) * self.OFFSET + tuple(bytes([b]) for b in range(256))

    def identity(self) -> dict:
        return {'kind': 'byte', 'vocab_size': self.vocab_size, 'hash': self.digest()[:16]}

    def digest(self) -> str:
        return hashlib.sha256(self.SCHEME.encode()).hexdigest()


def canonical_model_proto(model_proto: bytes) -> bytes:
    """The model proto without what only says how it was trained, not what it is: the trainer's
    thread count (recorded in trainer_spec; training gives the same pieces with any count)."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(bytes(model_proto))
    proto.trainer_spec.ClearField('num_threads')
    return proto.SerializeToString(deterministic=True)


class SentencePieceTokenizer:
    """A SentencePiece model (serialized proto); `identity()['hash']` is sha256 of the proto as
    stored, `digest()` the sha256 of its canonical form (canonical_model_proto), which models
    trained before the thread count was left out share with those trained since."""

    def __init__(self, model_proto: bytes):
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        self.vocab_size = self._sp.vocab_size()
        self.pad_id, self.bos_id, self.eos_id = (
            self._sp.pad_id(),
            self._sp.bos_id(),
            self._sp.eos_id(),
        )
        self._hash = hashlib.sha256(self.model_proto).hexdigest()[:16]

    @classmethod
    def from_file(cls, path) -> SentencePieceTokenizer:
        return cls(epath.Path(path).read_bytes())

    def __getstate__(self):  # Picklable for grain worker processes.
        return {'model_proto': self.model_proto}

    def __setstate__(self, state):
        self.__init__(state['model_proto'])

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        ids = self._sp.encode(list(texts), num_threads=_num_threads())
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids) -> str:
        return self._sp.decode(_ids_list(ids))

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def token_bytes(self) -> tuple[bytes, ...]:
        """Byte-fallback pieces (<0xAB>) as that byte, control and unknown pieces as b'', other
        pieces as UTF-8 with the whitespace marker U+2581 as a space."""
        out = []
        for i in range(self.vocab_size):
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            elif self._sp.is_control(i) or self._sp.is_unknown(i):
                out.append(b'')
            else:
                out.append(piece.replace('\u2581', ' ').encode('utf-8'))
        return tuple(out)

    def identity(self) -> dict:
        return {'kind': 'sentencepiece', 'vocab_size': self.vocab_size, 'hash': self._hash}

    def digest(self) -> str:
        return hashlib.sha256(canonical_model_proto(self.model_proto)).hexdigest()


def _sentences(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Documents cut at line ends into pieces of <= SPM_MAX_SENTENCE_BYTES (SentencePiece skips
    longer sentences), stopping after `max_bytes` in total."""
    total = 0
    for text in texts:
        buf, n = [], 0
        for line in text.splitlines(keepends=True):
            size = len(line.encode('utf-8'))
            if buf and n + size > SPM_MAX_SENTENCE_BYTES:
                yield ''.join(buf)
                buf, n = [], 0
            buf.append(line)
            n += size
        if buf:
            yield ''.join(buf)
        total += len(text.encode('utf-8'))
        if max_bytes is not None and total >= max_bytes:
            return


def train_sentencepiece(
    texts: Iterable[str], vocab_size: int, *, max_bytes: int | None = None
) -> bytes:
    """Trains BPE on `texts` with settings that round-trip code exactly; returns the model proto.

    Identity normalisation and no whitespace collapsing keep indentation; "\\n" is its own piece;
    byte fallback encodes anything unseen; no dummy prefix, so decode(encode(s)) == s. The pieces
    do not depend on the thread count (1 to 8 give the same), but the proto records it, so the
    proto returned is canonical_model_proto's: the same bytes on every machine.
    """
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_sentences(texts, max_bytes),
        model_writer=writer,
        model_type='bpe',
        vocab_size=vocab_size,
        normalization_rule_name='identity',
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        byte_fallback=True,
        allow_whitespace_only_pieces=True,
        split_digits=False,
        user_defined_symbols=['\n'],
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        character_coverage=0.9995,
        max_sentence_length=2 * SPM_MAX_SENTENCE_BYTES,
        input_sentence_size=0,
        num_threads=_num_threads(),
        minloglevel=2,
    )
    return canonical_model_proto(writer.getvalue())


def sentencepiece_model_path(ds: sources.Dataset, vocab_size: int, max_bytes: int | None = None):
    """Cache path beside the prepared data, keyed by manifest hash, text feature, vocab size."""
    cap = f'_max{max_bytes}' if max_bytes else ''
    tag = f'{ds.text_feature}_v{vocab_size}{cap}_{SPM_SETTINGS_TAG}'
    return ds.cache_dir / f'spm_{ds.manifest_hash[:12]}_{tag}.model'


# Tokenizers this process built, by _built_key(config.data): what results record (digests.py).
_BUILT: dict[str, Tokenizer] = {}


def _built_key(data_config) -> str:
    fields = ('tokenizer', 'tokenizer_path', 'name', 'data_dir', 'text_feature', 'train_split')
    values = [data_config.get(f) for f in fields]
    values[1], values[3] = (os.path.expanduser(str(v or '')) for v in (values[1], values[3]))
    values += [data_config.get('vocab_size'), data_config.get('tokenizer_max_bytes')]
    return json.dumps(values, default=str)


def built_tokenizer(data_config) -> Tokenizer | None:
    """The tokenizer this process built from these `config.data` settings, or None (builds
    nothing: for recording what a run read, specjax.data.digests)."""
    return _BUILT.get(_built_key(data_config))


def build_tokenizer(data_config) -> Tokenizer:
    """`config.data.tokenizer`: 'byte' (vocab 259, ignores vocab_size), 'sentencepiece' or
    'huggingface' (`config.data.tokenizer_path`: a tokenizer.json, or a directory holding one,
    such as an imported model's workdir; ignores vocab_size).

    SentencePiece is trained once on `config.data.train_split` (at most
    `config.data.tokenizer_max_bytes` of text) and cached beside the prepared data.
    """
    tok = _build_tokenizer(data_config)
    _BUILT[_built_key(data_config)] = tok
    return tok


def _build_tokenizer(data_config) -> Tokenizer:
    kind = data_config.get('tokenizer')
    if kind not in KINDS:
        raise ValueError(f'config.data.tokenizer must be one of {KINDS}, got {kind!r}')
    if kind == 'huggingface':
        from specjax.data.hf_tokenizer import HuggingFaceTokenizer

        path = data_config.get('tokenizer_path')
        if not path:
            raise ValueError(
                "config.data.tokenizer='huggingface' needs config.data.tokenizer_path (a "
                'tokenizer.json or a directory, e.g. an imported workdir, holding one)'
            )
        try:
            return HuggingFaceTokenizer.from_file(path)
        except FileNotFoundError as e:
            raise ValueError(f'config.data.tokenizer_path={path!r}: {e}') from e
    ds = sources.open_dataset(data_config)
    if kind == 'byte':
        return ByteTokenizer()
    vocab_size = data_config.get('vocab_size')
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(
            f'config.data.vocab_size must be an int >= 300 for sentencepiece (256 byte pieces + '
            f'specials + merges), got {vocab_size!r}'
        )
    max_bytes = data_config.get('tokenizer_max_bytes')

    def build() -> bytes:
        reader = sources.SplitReader(ds, data_config.train_split)
        texts = (t for t, _ in reader.read_all())
        try:
            return train_sentencepiece(texts, vocab_size, max_bytes=max_bytes)
        except RuntimeError as e:  # e.g. fewer pieces than the corpus's required characters
            raise ValueError(f'config.data.vocab_size={vocab_size}: SentencePiece: {e}') from e

    path = sentencepiece_model_path(ds, vocab_size, max_bytes)
    return SentencePieceTokenizer(sources.cached_bytes(path, build))
