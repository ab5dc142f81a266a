"""Test corpora for any test that needs data: the real stdlib corpus (prepared once, cached across
pytest runs) and a tiny synthetic TFDS dataset with a different text feature name.

Fixtures (session-scoped; register with `pytest_plugins = ['data_fixtures']` in conftest.py):
  stdlib_data_dir  -> str, a TFDS data_dir holding `specjax_stdlib` (persistent: folder names
                      carry the stdlib manifest hash, so a different stdlib never reuses it)
  toy_data_dir     -> str, a TFDS data_dir holding `specjax_toy_text` (per session)
Helpers: stdlib_data_config(data_dir, **overrides), toy_data_config(data_dir, **overrides).
Persistent location: $SPECJAX_TEST_CACHE, else ~/.cache/specjax-tests.
"""

from __future__ import annotations

import fcntl
import functools
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath

from specjax.data import default_data_config
from specjax.data.corpus import prepare_stdlib

TOY_NAME = 'specjax_toy_text'
TOY_TOPICS = ('alpha', 'beta', 'gamma')


def test_cache_dir() -> str:
    """Persistent cache root for test artefacts."""
    return os.path.expanduser(
        os.environ.get('SPECJAX_TEST_CACHE', os.path.join('~', '.cache', 'specjax-tests'))
    )


test_cache_dir.__test__ = False  # Not a test, despite the name.


def stdlib_data_config(data_dir: str, **overrides):
    """`config.data` for the stdlib corpus under `data_dir` (SentencePiece 1024, seq_len 128)."""
    c = default_data_config()
    c.data_dir = data_dir
    c.vocab_size = 1024
    c.seq_len = 128
    c.update(overrides)
    return c


def toy_data_config(data_dir: str, **overrides):
    """`config.data` for the toy dataset (text feature 'content', domains from 'topic')."""
    c = default_data_config()
    c.update(
        dict(
            name=TOY_NAME,
            data_dir=data_dir,
            text_feature='content',
            domain_feature='topic',
            tokenizer='byte',
            seq_len=64,
            packing_bins=8,
        )
    )
    c.update(overrides)
    return c


def toy_documents(split: str) -> list[tuple[str, str]]:
    """Deterministic (content, topic) pairs: short and long (multi-chunk) documents, unicode."""
    rng = np.random.default_rng({'train': 0, 'validation': 1}[split])
    words = ['def', 'return', 'x', 'λ', 'データ', '\n', '    ', 'if', '\t', 'é', '🙂', 'None']
    n = {'train': 40, 'validation': 9}[split]
    docs = []
    for i in range(n):
        length = 40 if i % 4 == 0 else int(rng.integers(1, 6))  # Some span several rows.
        body = ' '.join(rng.choice(words, size=length))
        docs.append((f'doc {split} {i}: {body}\n', TOY_TOPICS[i % len(TOY_TOPICS)]))
    return docs


class SpecjaxToyText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Tiny synthetic text dataset; unregistered, so the data layer must find it by name on disk."""

    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Initial release.'}

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description='Toy text for specjax tests.',
            features=tfds.features.FeaturesDict(
                {
                    'content': tfds.features.Text(),
                    'topic': tfds.features.ClassLabel(names=list(TOY_TOPICS)),
                    'length': np.int32,
                }
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {s: self._generate_examples(s) for s in ('train', 'validation')}

    def _generate_examples(self, split):
        for i, (content, topic) in enumerate(toy_documents(split)):
            yield i, {'content': content, 'topic': topic, 'length': len(content)}


def prepare_toy(data_dir: str) -> str:
    """Prepares `specjax_toy_text` (array_record) under `data_dir`; returns data_dir."""
    builder = SpecjaxToyText(data_dir=data_dir, file_format='array_record')
    if not builder.is_prepared():
        builder.download_and_prepare(file_format='array_record')
    return data_dir


@functools.cache
def prepared_stdlib_dir() -> str:
    """A persistent TFDS data_dir with `specjax_stdlib` prepared (~1-2 s the first time). An
    exclusive file lock makes concurrent pytest workers (pytest-xdist) prepare it once."""
    data_dir = os.path.join(test_cache_dir(), 'tfds')
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, '.prepare.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            prepare_stdlib(data_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return data_dir


@pytest.fixture(scope='session')
def stdlib_data_dir() -> str:
    return prepared_stdlib_dir()


@pytest.fixture(scope='session')
def toy_data_dir(tmp_path_factory) -> str:
    return prepare_toy(str(tmp_path_factory.mktemp('toy_tfds')))
