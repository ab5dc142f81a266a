"""Digests that pin what a run read: the prepared corpus's records and the tokenizer's content.

Two runs with one config and seed compute the same token streams when these agree; results.json
records them (specjax.workdir.write_results), so two runs' inputs compare by two strings.

- `corpus_digest(ds)`: {'sha256', 'splits': {split: {'records', 'sha256'}}}: per split, sha256
  over every record's decoded features (by name, canonically encoded) in record order; the
  top-level sha256 covers every split's. Computed once and kept in the prepared dataset's own
  folder (DIGEST_FILE), so it goes when the records go; recomputed when that file's splits or
  record counts disagree with the dataset's.
- `tokenizer_digest(tok)`: {'kind', 'vocab_size', 'sha256'}: `tok.digest()`, the sha256 of its
  canonical content (SentencePiece: the model proto without the trainer's thread count; Hugging
  Face: the canonical tokenizer.json with the special ids; byte: its scheme).
- `data_digests(data_config)`: both, for `config.data` (opening, preparing and training as a run
  would).
- `used_digests(config)`: both for the corpus and tokenizer this process read through
  `config.data`, None for what it did not read (a config without data, data passed in by a test,
  an imported model); never prepares, trains or reads a corpus the run did not.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping

import numpy as np
from etils import epath

from specjax.data import sources, tokenizers

DIGEST_FILE = 'specjax_corpus_digest.json'
FORMAT = 'specjax-corpus-digest:v1'  # bump when the encoding below changes
_CHUNK = 256  # records decoded at a time


def _feed(h, value) -> None:
    """Feeds one decoded feature value to `h`, tagged and length-prefixed, so that distinct values
    never share an encoding; text and bytes encode alike (utf-8), numbers by dtype and shape."""
    if isinstance(value, Mapping):
        h.update(b'd%d:' % len(value))
        for key in sorted(value):
            _feed(h, str(key))
            _feed(h, value[key])
    elif isinstance(value, bytes | str):
        data = value.encode('utf-8') if isinstance(value, str) else bytes(value)
        h.update(b's%d:' % len(data))
        h.update(data)
    elif isinstance(value, list | tuple):
        h.update(b'l%d:' % len(value))
        for item in value:
            _feed(h, item)
    else:
        arr = np.asarray(value)
        if arr.dtype.kind in 'OSU':  # text sequences: element by element
            h.update(f'L{arr.shape}:'.encode())
            for item in arr.reshape(-1):
                _feed(h, item)
        else:
            arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder('<'))
            h.update(f'a{arr.dtype.str}{arr.shape}:'.encode())
            h.update(arr.tobytes())


def split_records_digest(ds: sources.Dataset, split: str) -> tuple[int, str]:
    """(records, sha256 hex) of one split's decoded records in record order."""
    source = ds.builder.as_data_source(split)
    h = hashlib.sha256(f'{FORMAT}\n'.encode())
    for start in range(0, len(source), _CHUNK):
        for record in source.__getitems__(list(range(start, min(start + _CHUNK, len(source))))):
            _feed(h, record)
    return len(source), h.hexdigest()


def _combine(splits: dict) -> str:
    h = hashlib.sha256(f'{FORMAT}\n'.encode())
    for name in sorted(splits):
        h.update(f'{name}\t{splits[name]["records"]}\t{splits[name]["sha256"]}\n'.encode())
    return h.hexdigest()


def _expected_records(ds: sources.Dataset) -> dict[str, int]:
    return {name: int(info.num_examples) for name, info in ds.builder.info.splits.items()}


def _stored(path: epath.Path, expected: dict[str, int]) -> dict | None:
    """The digest kept at `path` if it is current (format, splits and record counts), else None."""
    try:
        stored = json.loads(path.read_text())
        splits = stored['splits']
        current = (
            stored['format'] == FORMAT
            and {name: split['records'] for name, split in splits.items()} == expected
        )
        return {'sha256': str(stored['sha256']), 'splits': splits} if current else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def corpus_digest(ds: sources.Dataset) -> dict:
    """{'sha256', 'splits': {split: {'records', 'sha256'}}} of the prepared records (see the
    module docstring), from <prepared dataset folder>/DIGEST_FILE when it is there and current."""
    path = epath.Path(ds.builder.data_dir) / DIGEST_FILE
    expected = _expected_records(ds)
    stored = _stored(path, expected)
    if stored is not None:
        return stored
    splits = {}
    for name in sorted(expected):
        records, sha = split_records_digest(ds, name)
        splits[name] = {'records': records, 'sha256': sha}
    out = {'sha256': _combine(splits), 'splits': splits}
    try:
        sources.write_atomic(path, json.dumps(dict(out, format=FORMAT), indent=2).encode())
    except OSError as e:  # a read-only dataset folder: computed again next time
        logging.warning('corpus digest of %s not kept (%s): %s', ds.name, path, e)
    return out


def corpus_record(ds: sources.Dataset) -> dict:
    """What results record of a corpus: its name, manifest hash and corpus_digest."""
    return {'name': ds.name, 'manifest_hash': ds.manifest_hash, **corpus_digest(ds)}


def tokenizer_digest(tok) -> dict:
    """{'kind', 'vocab_size', 'sha256'}; a tokenizer without digest() gives its identity hash
    ('hash') instead of 'sha256'."""
    ident = tok.identity()
    out = {'kind': ident.get('kind'), 'vocab_size': ident.get('vocab_size')}
    digest = getattr(tok, 'digest', None)
    if callable(digest):
        return dict(out, sha256=digest())
    return dict(out, hash=ident.get('hash'))


def data_digests(data_config) -> dict:
    """{'corpus', 'tokenizer'} of `config.data`: opens (and prepares) the dataset and builds (and
    trains) the tokenizer as a run would."""
    ds = sources.open_dataset(data_config)
    tok = tokenizers.build_tokenizer(data_config)
    return {'corpus': corpus_record(ds), 'tokenizer': tokenizer_digest(tok)}


def used_digests(config) -> dict:
    """{'corpus', 'tokenizer'} that this process read through `config.data` (None for each it
    did not: see the module docstring)."""
    get = getattr(config, 'get', None)
    data_config = get('data') if callable(get) else None
    if not callable(getattr(data_config, 'get', None)):
        return {'corpus': None, 'tokenizer': None}
    ds = sources.opened_dataset(data_config)
    tok = tokenizers.built_tokenizer(data_config)
    return {
        'corpus': corpus_record(ds) if ds is not None else None,
        'tokenizer': tokenizer_digest(tok) if tok is not None else None,
    }
