"""TFDS builder `specjax_stdlib` for the embedded corpus (array_record; no TensorFlow needed).

The builder config name carries a short manifest hash (`m<12 hex>`), so a different stdlib
prepares into a different folder instead of reusing a stale one; the full hash is stored in the
dataset's metadata and checked again on every load (`prepare_stdlib`).
"""

from __future__ import annotations

import contextlib
import logging
import os

import tensorflow_datasets as tfds
from etils import epath

from specjax.data import stdlib_source

NAME = 'specjax_stdlib'
FILE_FORMAT = 'array_record'


class StdlibConfig(tfds.core.BuilderConfig):
    """Config pinned to one corpus manifest. Build with `StdlibConfig.for_documents(docs)`."""

    def __init__(self, *, manifest_hash: str, documents=None, **kwargs):
        super().__init__(name=f'm{manifest_hash[:12]}', **kwargs)
        self.manifest_hash = manifest_hash
        self.documents = documents  # Pre-enumerated documents (avoids reading the stdlib twice).

    @classmethod
    def for_documents(cls, docs: list[stdlib_source.Document]) -> StdlibConfig:
        return cls(
            manifest_hash=stdlib_source.manifest_hash(docs),
            documents=docs,
            description='CPython stdlib sources (code) and pydoc topics (prose).',
        )


class SpecjaxStdlib(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """CPython stdlib `.py` sources (domain `code`) and pydoc topics (domain `prose`).

    Features: `text` (Text), `domain` (ClassLabel code/prose), `source` (relative path or topic
    key). Splits: `train` and `validation` (~5%, stratified per domain, by name hash).
    Not registered by name (configs are per manifest): once prepared, plain TFDS reads it with
    `tfds.data_source('specjax_stdlib/m<hash12>', split=..., data_dir=...)`.
    """

    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Initial release.'}
    BUILDER_CONFIGS = []  # Configs are created per manifest; see StdlibConfig.for_documents.

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's default inspects the package with the `importlib_resources` backport, which is not
        # a dependency of ours; the answer is simply this file.
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        cfg = self.builder_config
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict(
                {
                    'text': tfds.features.Text(),
                    'domain': tfds.features.ClassLabel(names=list(stdlib_source.DOMAINS)),
                    'source': tfds.features.Text(),
                }
            ),
            metadata=tfds.core.MetadataDict(
                manifest_hash=cfg.manifest_hash if cfg is not None else None,
                selection_version=stdlib_source.SELECTION_VERSION,
                validation_fraction=stdlib_source.VALIDATION_FRACTION,
            ),
            disable_shuffling=True,
            homepage='https://docs.python.org/3/library/',
            license='PSF-2.0',
        )

    def _log_download_bytes(self) -> None:
        """Silenced: TFDS prints 'Downloading and preparing dataset Unknown size ...' although
        nothing downloads here; prepare_stdlib logs one line instead."""

    def _log_download_done(self) -> None:
        """Silenced, as _log_download_bytes."""

    def _split_generators(self, dl_manager):
        del dl_manager
        cfg = self.builder_config
        docs = cfg.documents if cfg.documents is not None else stdlib_source.stdlib_documents()
        found = stdlib_source.manifest_hash(docs)
        if found != cfg.manifest_hash:
            raise ValueError(
                f'stdlib changed while preparing: manifest {found} != {cfg.manifest_hash}'
            )
        splits = stdlib_source.assign_splits(docs)
        return {name: self._generate_examples(split_docs) for name, split_docs in splits.items()}

    def _generate_examples(self, docs):
        for d in docs:
            yield f'{d.domain}:{d.source}', {'text': d.text, 'domain': d.domain, 'source': d.source}


def stdlib_builder(data_dir: str, docs=None) -> SpecjaxStdlib:
    """The builder for this interpreter's stdlib (not prepared yet if never prepared)."""
    docs = stdlib_source.stdlib_documents() if docs is None else docs
    return SpecjaxStdlib(
        config=StdlibConfig.for_documents(docs),
        data_dir=os.path.expanduser(data_dir),
        file_format=FILE_FORMAT,
    )


class _DropTfdsNotices(logging.Filter):
    """Drops TFDS's info and warning lines (errors still show)."""

    def filter(self, record):
        return record.levelno >= logging.ERROR or '/tensorflow_datasets/' not in record.pathname


@contextlib.contextmanager
def _quiet_tfds():
    """While preparing: no TFDS progress bars, notices ('Variant folder ... has no
    dataset_info.json' for the folder being written) or 'Downloading' banners."""
    from tensorflow_datasets.core.utils import tqdm_utils

    shown = getattr(tqdm_utils, '_active', True)
    tfds.display_progress_bar(False)
    quiet, absl_logger = _DropTfdsNotices(), logging.getLogger('absl')
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)
        tfds.display_progress_bar(shown)


def prepare_stdlib(data_dir: str, docs=None) -> SpecjaxStdlib:
    """Prepares (once) and returns the builder; verifies the stored manifest hash on load.

    `docs` (default: enumerate this interpreter's stdlib) is only for tests.
    """
    with _quiet_tfds():
        return _prepare_stdlib(data_dir, docs)


def _prepare_stdlib(data_dir: str, docs) -> SpecjaxStdlib:
    builder = stdlib_builder(data_dir, docs)
    expected = builder.builder_config.manifest_hash
    if not builder.is_prepared():
        docs = builder.builder_config.documents
        logging.info(
            "Preparing %s from %d documents of this interpreter's stdlib into %s (once; "
            'nothing downloads)',
            NAME,
            len(docs),
            builder.data_dir,
        )
        try:
            builder.download_and_prepare(file_format=FILE_FORMAT)
        except Exception:  # A concurrent preparer may have won the final rename.
            if not stdlib_builder(data_dir, docs).is_prepared():
                raise
        builder = stdlib_builder(data_dir, docs)
    stored = builder.info.metadata.get('manifest_hash') if builder.info.metadata else None
    if stored != expected:
        raise ValueError(
            f'Prepared {NAME} at {builder.data_dir} has manifest_hash {stored!r}, but this '
            f"interpreter's stdlib has {expected!r}; delete that folder to re-prepare."
        )
    return builder
