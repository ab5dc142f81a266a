"""The embedded corpus: the running interpreter's stdlib sources (code) and pydoc topics (prose).

Pure Python, no TFDS: this module enumerates the documents, pins them with a manifest hash and
assigns the deterministic train/validation split. `corpus.py` wraps it in a TFDS builder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import sysconfig

DOMAINS = ('code', 'prose')
VALIDATION_FRACTION = 0.05
# Directory names left out at any depth (test suites and their fixtures, some deliberately
# mis-encoded), top-level directories left out, and single files left out.
EXCLUDED_DIR_NAMES = frozenset({'test', 'tests', 'idle_test', '__pycache__'})
EXCLUDED_TOP_DIRS = frozenset({'encodings', 'site-packages', 'dist-packages'})
EXCLUDED_FILES = frozenset({'pydoc_data/topics.py'})  # The prose domain, verbatim.
# Written by the interpreter's build or install, not part of CPython's sources, so they differ
# between two installs of one version (prefix, compiler flags, a timestamped build dir): the
# build's variables (_sysconfigdata_*.py), the build-config dir (config-3.11-x86_64-linux-gnu/,
# python-config.py) and site customisation hooks. Keeping them made the corpus, its tokenizer
# and every packed row machine-dependent.
EXCLUDED_TOP_PREFIXES = ('_sysconfigdata_', 'config-')
EXCLUDED_TOP_FILES = frozenset({'sitecustomize.py', 'usercustomize.py'})
# Bumped whenever the selection or split rule changes: part of the manifest hash.
# v2: install-specific files excluded (EXCLUDED_TOP_PREFIXES, EXCLUDED_TOP_FILES).
SELECTION_VERSION = 'v2'


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus document. `source` is a stdlib-relative posix path or a pydoc topic key."""

    domain: str
    source: str
    text: str


def stdlib_dir() -> pathlib.Path:
    """The running interpreter's stdlib directory."""
    return pathlib.Path(sysconfig.get_paths()['stdlib'])


def _is_selected(rel: pathlib.PurePosixPath) -> bool:
    parts = rel.parts
    if parts[0] in EXCLUDED_TOP_DIRS or str(rel) in EXCLUDED_FILES | EXCLUDED_TOP_FILES:
        return False
    if parts[0].startswith(EXCLUDED_TOP_PREFIXES):
        return False
    return not any(p in EXCLUDED_DIR_NAMES for p in parts[:-1])


def code_documents(root: pathlib.Path | None = None) -> list[Document]:
    """Stdlib `.py` files under `root` (default: this interpreter's), sorted by relative path.

    Files that are not valid UTF-8 are skipped (none in CPython 3.11 once tests are excluded).
    """
    root = stdlib_dir() if root is None else pathlib.Path(root)
    docs = []
    for path in sorted(root.rglob('*.py')):
        rel = pathlib.PurePosixPath(path.relative_to(root).as_posix())
        if not path.is_file() or not _is_selected(rel):
            continue
        try:
            text = path.read_bytes().decode('utf-8')
        except UnicodeDecodeError:
            continue
        if text:
            docs.append(Document('code', str(rel), text))
    docs.sort(key=lambda d: d.source)
    return docs


def prose_documents() -> list[Document]:
    """One document per `pydoc_data.topics.topics` entry, sorted by topic key."""
    from pydoc_data import topics  # noqa: PLC0415 (stdlib; loaded only when needed)

    return [Document('prose', k, v) for k, v in sorted(topics.topics.items()) if v]


def stdlib_documents(root: pathlib.Path | None = None) -> list[Document]:
    """All documents of the embedded corpus: code first, then prose, each sorted by source."""
    return code_documents(root) + prose_documents()


def manifest_hash(docs: list[Document]) -> str:
    """sha256 hex over the selection version and sorted (domain, source, sha256(text)) entries."""
    h = hashlib.sha256(f'specjax_stdlib:{SELECTION_VERSION}\n'.encode())
    for d in sorted(docs, key=lambda d: (d.domain, d.source)):
        content = hashlib.sha256(d.text.encode('utf-8')).hexdigest()
        h.update(f'{d.domain}\t{d.source}\t{content}\n'.encode())
    return h.hexdigest()


def _split_key(doc: Document) -> str:
    return hashlib.sha256(f'{doc.domain}:{doc.source}'.encode()).hexdigest()


def assign_splits(
    docs: list[Document], fraction: float = VALIDATION_FRACTION
) -> dict[str, list[Document]]:
    """Deterministic split, stratified per domain: code by file, prose by topic key.

    Per domain, the ceil(fraction * n) documents with the smallest sha256(domain:source) go to
    validation, so every non-empty domain is in both splits (given >= 2 documents) and the
    assignment depends only on names, never on content or enumeration order.
    """
    out = {'train': [], 'validation': []}
    for domain in DOMAINS:
        group = sorted((d for d in docs if d.domain == domain), key=_split_key)
        if not group:
            continue
        n_val = min(len(group) - 1, max(1, math.ceil(fraction * len(group))))
        val = {d.source for d in group[:n_val]}
        for d in sorted(group, key=lambda d: d.source):
            out['validation' if d.source in val else 'train'].append(d)
    return out
