"""The frozen target's outputs on a finite set of rows, computed once and kept in bfloat16 on disk,
for the feature_draft mode's cached training (config.feature.cache; specjax.distill.feature_ttt's
`targets`, cached).

A cache directory holds, for M rows of T tokens (tokens / positions / segment_ids int32 [M, T]):
  features.npy        the target's hidden states after the feature layers, [M, T, n, E];
  target_logp.npy     the target's log-softmax over the draft's vocabulary, [M, T, N]: the
                      logits restricted to the draft's N ids and renormalised there (all V
                      without a map); log-probs rather than logits keep the likely entries near
                      0, where bfloat16 is finest;
  feature_cache.json  {'identity': what the arrays were computed from (the target's identity,
                      feature_layers, sha256 of the ids and of the rows, the shapes, 'bfloat16'),
                      'rows_done', 'batch_size', 'bytes' (both files on disk), 'bytes_per_row',
                      'seconds' (the batches' time: forwards, the first one's compile included,
                      and writes, summed over every build session)}.
Both arrays are bfloat16 stored as their uint16 bit patterns (an .npy header has no bfloat16)
and read back as bfloat16 memory maps, so only the rows a batch draws are read into memory.

`build_or_load` computes the rows in batches, one jitted target forward each, and records
rows_done after each batch is flushed to disk: an interrupted build resumes there, a complete
cache with the same identity is read as it is (the target is not run), and a directory holding
a cache of anything else is refused naming the differing field (never overwritten). One process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import config_diff
from specjax.distill.feature_ttt import on_draft_vocab, target_forward
from specjax.distill.reduced_task import fingerprint
from specjax.jsonio import to_json, write_json
from specjax.parallel import batch_sharding, param_shardings, replicated
from specjax.parallel.sharding import on_mesh
from specjax.train.runs import batch_placer

FEATURES_FILE = 'features.npy'
LOGP_FILE = 'target_logp.npy'
INFO_FILE = 'feature_cache.json'
ROW_KEYS = ('tokens', 'positions', 'segment_ids')  # the rows, int32 [M, T] each
DTYPE = 'bfloat16'
_FILES = {FEATURES_FILE: 'features_shape', LOGP_FILE: 'target_logp_shape'}  # array: its shape


@dataclasses.dataclass(frozen=True)
class FeatureCache:
    """A complete cache: its arrays as read-only bfloat16 memory maps and its JSON record."""

    directory: str
    features: np.ndarray  # bfloat16 [M, T, n, E]
    target_logp: np.ndarray  # bfloat16 [M, T, N]
    info: dict  # feature_cache.json

    def summary(self) -> dict:
        """What a results.json records: directory, rows, bytes on disk (and per row), seconds."""
        keys = ('rows_done', 'bytes', 'bytes_per_row', 'seconds', 'batch_size')
        return dict({k: self.info[k] for k in keys}, directory=self.directory, dtype=DTYPE)


def ids_sha256(ids_N) -> str | None:
    """sha256 of the draft's ids as int32 bytes; None for the full vocabulary."""
    if ids_N is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(ids_N, np.int32).tobytes()).hexdigest()


def cache_identity(
    target_identity: dict, row_set: dict, feature_layers, ids_N, d_model: int, n: int
):
    """What a cache's arrays are a function of (feature_cache.json's 'identity'); `n`: the size
    of the draft's vocabulary (len(ids_N), or the target's vocab_size)."""
    m, t = np.shape(row_set['tokens'])
    return to_json(
        {
            'target': target_identity,
            'feature_layers': [int(i) for i in feature_layers],
            'draft_vocab_sha256': ids_sha256(ids_N),
            'rows_sha256': fingerprint({f'rows_{k}': row_set[k] for k in ROW_KEYS}, ('rows',)),
            'features_shape': [int(m), int(t), len(feature_layers), int(d_model)],
            'target_logp_shape': [int(m), int(t), int(n)],
            'dtype': DTYPE,
        }
    )


def check_identity(saved: dict, expected: dict, directory: str) -> None:
    """ValueError naming every field of `expected` that the cache in `directory` (identity
    `saved`) differs in; fields `expected` lacks are not compared."""
    diffs = config_diff.differences({k: saved.get(k) for k in expected}, to_json(expected))
    if diffs:
        raise ValueError(
            f'the feature cache in {directory} was computed for other settings: '
            f'{config_diff.describe(diffs, "in the cache", "now")}. Delete {directory} to '
            'rebuild it, or use another directory.'
        )


def check_matches(cache: FeatureCache, target_identity: dict, feature_layers, ids_N) -> None:
    """ValueError naming the field unless `cache` holds this target's outputs at these feature
    layers over these draft ids."""
    expected = {'target': target_identity, 'feature_layers': [int(i) for i in feature_layers]}
    expected['draft_vocab_sha256'] = ids_sha256(ids_N)
    check_identity(cache.info['identity'], expected, cache.directory)


def check_config(config, cache: FeatureCache | None) -> None:
    """ValueError naming config.feature.cache unless the feature_draft mode is given a cache
    exactly when config asks for one (the generic data sources carry none)."""
    if config.feature.cache and cache is None:
        raise ValueError(
            'config.feature.cache=True needs training batches carrying the cached features '
            "and target_logp (specjax.distill.feature_cache), which this run's data has none "
            'of (the SmolLM2 preset builds them for its finite row set): set '
            'config.feature.cache=False'
        )
    if cache is not None and not config.feature.cache:
        raise ValueError(
            f'a feature cache ({cache.directory}) was passed with config.feature.cache=False: '
            'set it True to train on it'
        )


def read_info(directory: str) -> dict | None:
    """feature_cache.json of `directory`, or None when there is none."""
    path = os.path.join(directory, INFO_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _open(directory: str, name: str, mode: str, shape=None) -> np.ndarray:
    """The uint16 memory map of `name` (created with `shape` for mode 'w+')."""
    path = os.path.join(directory, name)
    if mode == 'w+':
        return np.lib.format.open_memmap(path, mode='w+', dtype=np.uint16, shape=tuple(shape))
    if not os.path.exists(path):
        raise ValueError(
            f'the feature cache in {directory} has {INFO_FILE} but no {name}: delete '
            f'{directory} to rebuild it'
        )
    return np.load(path, mmap_mode=mode)


def as_bits(x) -> np.ndarray:
    """bfloat16 values (or anything castable) -> their uint16 bit patterns."""
    return np.asarray(x).astype(jnp.bfloat16).view(np.uint16)


def from_bits(x: np.ndarray) -> np.ndarray:
    """uint16 bit patterns -> bfloat16 values (a view: a memory map stays one)."""
    return x.view(jnp.bfloat16)


def forward_fn(teacher, feature_layers, ids_N, mesh, rules):
    """Jitted (target params, batch of ROW_KEYS) -> (features, log-softmax over the draft's
    vocabulary), both bfloat16, replicated; the batch is placed by batch_sharding."""
    layers = tuple(int(i) for i in feature_layers)

    def fn(params, batch):
        logits, features = target_forward(teacher.graphdef, params, batch, layers)
        logits = on_draft_vocab(logits, ids_N).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return features.astype(jnp.bfloat16), logp.astype(jnp.bfloat16)

    b_sharding = batch_sharding(mesh, rules)
    shardings = (param_shardings(mesh, teacher.params, rules), b_sharding)
    jitted = jax.jit(on_mesh(fn, mesh), in_shardings=shardings, out_shardings=replicated(mesh))
    return jitted, batch_placer(b_sharding, ROW_KEYS)


def _padded(row_set: dict, start: int, size: int) -> dict:
    """Rows start..start+size of `row_set`, zero rows (padding, segment 0) past the end."""
    out = {}
    for k in ROW_KEYS:
        part = np.asarray(row_set[k][start : start + size], np.int32)
        out[k] = np.pad(part, ((0, size - len(part)), (0, 0)))
    return out


def build_or_load(
    teacher, row_set, feature_layers, ids_N, batch_size, directory, *, mesh, rules, on_batch=None
) -> FeatureCache:
    """The cache of the frozen `teacher` (specjax.distill.teacher.load_teacher's, on `mesh`
    with `rules`) on `row_set` ({ROW_KEYS: int32 [M, T]}) in `directory`: read as it is when
    complete, resumed from rows_done when interrupted, else built; ValueError naming the field
    when the directory holds a cache of other settings. Each batch of `batch_size` rows is one
    target forward (the last padded to that size); on_batch(rows_done) is called after each
    batch is recorded (tests stop a build there)."""
    if jax.process_count() != 1:
        raise ValueError('the feature cache is built by one process (jax.process_count() == 1)')
    cfg = teacher.config
    n = cfg.vocab_size if ids_N is None else len(ids_N)
    identity = cache_identity(teacher.identity(), row_set, feature_layers, ids_N, cfg.d_model, n)
    m = identity['features_shape'][0]
    info = read_info(directory)
    if info is not None:
        check_identity(info['identity'], identity, directory)
        if info['rows_done'] >= m:
            return open_cache(directory)
        maps = [_open(directory, name, 'r+') for name in _FILES]
    else:
        os.makedirs(directory, exist_ok=True)
        maps = [_open(directory, name, 'w+', identity[shape]) for name, shape in _FILES.items()]
        info = {'identity': identity, 'rows_done': 0, 'seconds': 0.0}
    forward, put = forward_fn(teacher, feature_layers, ids_N, mesh, rules)
    info['batch_size'] = int(batch_size)
    info['bytes'] = sum(os.path.getsize(os.path.join(directory, name)) for name in _FILES)
    info['bytes_per_row'] = info['bytes'] // max(m, 1)
    write_json(os.path.join(directory, INFO_FILE), info)
    for start in range(info['rows_done'], m, batch_size):
        began = time.perf_counter()
        outs = jax.device_get(forward(teacher.params, put(_padded(row_set, start, batch_size))))
        end = min(start + batch_size, m)
        for out, array in zip(outs, maps, strict=True):
            array[start:end] = as_bits(out[: end - start])
            array.flush()
        info['seconds'] += time.perf_counter() - began
        info['rows_done'] = end
        write_json(os.path.join(directory, INFO_FILE), info)  # after the rows are on disk
        if on_batch is not None:
            on_batch(end)
    del maps  # the writable maps, flushed
    return open_cache(directory)


def open_cache(directory: str) -> FeatureCache:
    """The complete cache in `directory`, read-only (its settings are not checked: build_or_load
    checks them); ValueError when it is absent or incomplete."""
    info = read_info(directory)
    if info is None or info['rows_done'] != info['identity']['features_shape'][0]:
        done = 'no ' + INFO_FILE if info is None else f'{info["rows_done"]} rows done'
        raise ValueError(f'{directory} holds no complete feature cache ({done})')
    features, logp = (_open(directory, name, 'r') for name in _FILES)
    return FeatureCache(directory, from_bits(features), from_bits(logp), info)


def rows(cache: FeatureCache, idx) -> dict:
    """{'features': bfloat16 [b, T, n, E], 'target_logp': bfloat16 [b, T, N]} of rows `idx`
    (read from disk into memory)."""
    idx = np.asarray(idx)
    return {'features': cache.features[idx], 'target_logp': cache.target_logp[idx]}
