"""Resolving `config.data` to a prepared TFDS dataset: validation, split readers, identity, caches.

`config.data.name == 'specjax_stdlib'` prepares the embedded corpus on first use; any other name
must already be prepared by TFDS in array_record format under `config.data.data_dir`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time
import uuid

import tensorflow_datasets as tfds
from etils import epath

STDLIB_NAME = 'specjax_stdlib'
CACHE_SUBDIR = 'specjax_cache'


class _CustomConfigFilter(logging.Filter):
    """Drops TFDS's per-construction warning about our manifest-named builder configs."""

    def filter(self, record):
        return 'Using custom data configuration: StdlibConfig' not in str(record.getMessage())


logging.getLogger('absl').addFilter(_CustomConfigFilter())


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A prepared dataset: its builder, identity and resolved feature names."""

    builder: tfds.core.DatasetBuilder
    data_dir: str
    name: str
    manifest_hash: str
    text_feature: str
    domain_feature: str | None
    domain_names: tuple[str, ...]

    @property
    def cache_dir(self) -> epath.Path:
        """Where tokenizer models and token caches for this dataset live (beside the data)."""
        slug = re.sub(r'[^A-Za-z0-9_.-]+', '-', self.name).strip('-')
        return epath.Path(self.data_dir) / CACHE_SUBDIR / f'{slug}_{self.manifest_hash[:12]}'


def _expand(data_dir: str) -> str:
    return os.path.expanduser(str(data_dir))


def _generic_manifest(builder: tfds.core.DatasetBuilder) -> str:
    """sha256 over a prepared dataset's full name, features and per-split sizes/shards."""
    info = builder.info
    splits = {
        k: [v.num_examples, int(v.num_bytes), list(v.shard_lengths)]
        for k, v in sorted(info.splits.items())
    }
    blob = json.dumps(
        {'full_name': info.full_name, 'features': sorted(info.features.keys()), 'splits': splits},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


@functools.lru_cache(maxsize=16)
def _open(name: str, data_dir: str, text_feature: str, domain_feature: str | None) -> Dataset:
    if name == STDLIB_NAME:
        from specjax.data import corpus  # noqa: PLC0415 (registers the builder only when used)

        builder = corpus.prepare_stdlib(data_dir)
        manifest = builder.builder_config.manifest_hash
    else:
        try:
            builder = tfds.builder(name, data_dir=data_dir)
        except (tfds.core.registered.DatasetNotFoundError, ValueError) as e:
            raise ValueError(
                f'config.data.name={name!r}: no such TFDS dataset under config.data.data_dir='
                f'{data_dir!r} ({type(e).__name__}: {str(e).splitlines()[0]})'
            ) from None
        if not builder.is_prepared():
            raise ValueError(
                f'config.data.name={name!r} is not prepared under config.data.data_dir='
                f'{data_dir!r}; prepare it with TFDS (file_format="array_record") first.'
            )
        fmt = builder.info.file_format
        if fmt is None or getattr(fmt, 'value', fmt) != 'array_record':
            raise ValueError(
                f'config.data.name={name!r} is stored as {fmt}; random access without TensorFlow '
                'needs array_record (re-prepare with file_format="array_record").'
            )
        manifest = _generic_manifest(builder)
    features = builder.info.features
    if text_feature not in features:
        raise ValueError(
            f'config.data.text_feature={text_feature!r} is not a feature of {name!r} '
            f'(features: {sorted(features.keys())})'
        )
    if domain_feature is None:
        domain_names = ('all',)
    elif domain_feature not in features:
        raise ValueError(
            f'config.data.domain_feature={domain_feature!r} is not a feature of {name!r} '
            f'(features: {sorted(features.keys())}); use None for no domains'
        )
    elif not isinstance(features[domain_feature], tfds.features.ClassLabel):
        raise ValueError(
            f'config.data.domain_feature={domain_feature!r} must be a ClassLabel feature, '
            f'got {type(features[domain_feature]).__name__}'
        )
    else:
        domain_names = tuple(features[domain_feature].names)
    return Dataset(builder, data_dir, name, manifest, text_feature, domain_feature, domain_names)


# Datasets this process opened, by (name, data_dir, text_feature, domain_feature): what results
# record (specjax.data.digests).
_OPENED: dict[tuple, Dataset] = {}


def _opened_key(data_config) -> tuple:
    fields = ('name', 'text_feature', 'domain_feature')
    name, text, domain = (data_config.get(f) for f in fields)
    return name, _expand(data_config.get('data_dir') or ''), text, domain


def opened_dataset(data_config) -> Dataset | None:
    """The dataset this process opened for these `config.data` settings, or None (opens and
    prepares nothing: for recording what a run read, specjax.data.digests)."""
    return _OPENED.get(_opened_key(data_config))


def open_dataset(data_config) -> Dataset:
    """Validates `config.data` against the prepared dataset (preparing `specjax_stdlib` once).

    Raises ValueError naming the config field and value for unknown datasets, missing features,
    unknown splits, or bad sizes — before anything is tokenized or compiled.
    """
    for field in ('name', 'data_dir', 'text_feature'):
        value = data_config.get(field)
        if not isinstance(value, str) or not value:
            raise ValueError(f'config.data.{field} must be a non-empty string, got {value!r}')
    domain_feature = data_config.get('domain_feature')
    if domain_feature is not None and not isinstance(domain_feature, str):
        raise ValueError(
            f'config.data.domain_feature must be a string or None, got {domain_feature!r}'
        )
    seq_len = data_config.get('seq_len')
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f'config.data.seq_len must be an int >= 2, got {seq_len!r}')
    ds = _open(
        data_config.name, _expand(data_config.data_dir), data_config.text_feature, domain_feature
    )
    for field in ('train_split', 'eval_split'):
        split = data_config.get(field)
        if split not in ds.builder.info.splits:
            raise ValueError(
                f'config.data.{field}={split!r} is not a split of {data_config.name!r} '
                f'(splits: {sorted(ds.builder.info.splits.keys())})'
            )
    _OPENED[_opened_key(data_config)] = ds
    return ds


def corpus_identity(data_config) -> dict:
    """{'name', 'manifest_hash', 'full_name', 'text_feature', 'domain_feature'} for metadata."""
    ds = open_dataset(data_config)
    return {
        'name': ds.name,
        'manifest_hash': ds.manifest_hash,
        'full_name': ds.builder.info.full_name,
        'text_feature': ds.text_feature,
        'domain_feature': ds.domain_feature,
    }


class SplitReader:
    """Random access to (text, domain id) of one split, via TFDS's array_record data source."""

    def __init__(self, ds: Dataset, split: str):
        self._source = ds.builder.as_data_source(split)
        self._text = ds.text_feature
        self._domain = ds.domain_feature

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self._decode(self._source[index])

    def _decode(self, record) -> tuple[str, int]:
        text = record[self._text]
        text = text.decode('utf-8') if isinstance(text, bytes) else str(text)
        return text, int(record[self._domain]) if self._domain is not None else 0

    def read_all(self, chunk: int = 256):
        """Yields (text, domain id) in record order, reading `chunk` records at a time."""
        for start in range(0, len(self), chunk):
            idx = list(range(start, min(start + chunk, len(self))))
            for record in self._source.__getitems__(idx):
                yield self._decode(record)


def write_atomic(path: epath.Path, data: bytes) -> None:
    """Writes via a unique temporary file and replace, so concurrent writers never tear a file
    (and the last one wins, where rename refused an existing file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f'.{path.name}.{uuid.uuid4().hex}.tmp'
    tmp.write_bytes(data)
    tmp.replace(path)


def cached_bytes(path: epath.Path, build, *, timeout_s: float = 3600.0) -> bytes:
    """Reads `path`, or builds it: process 0 writes; other JAX processes wait for the file.

    `build()` returns the bytes to store. Multi-host runs need `data_dir` on a shared filesystem.
    """
    if path.exists():
        return path.read_bytes()
    import jax  # noqa: PLC0415 (only needed on the slow path)

    if jax.process_count() > 1 and jax.process_index() != 0:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f'process {jax.process_index()} waited {timeout_s}s for {path}')
            time.sleep(1.0)
        return path.read_bytes()
    data = build()
    write_atomic(path, data)
    return data
