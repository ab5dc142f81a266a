"""The feature_draft mode's bfloat16 feature cache (specjax.distill.feature_cache): its arrays are
the frozen target's features and restricted log-softmax up to bfloat16 rounding; a cached
training step's loss, metrics and update equal the online step's up to that rounding; an
interrupted build resumes to the same arrays, a complete cache is read without running the
target and one of other settings is refused naming the field; the SmolLM2 preset's stage trains
on it (config.feature.cache), resumes bit-identically from SIGTERM and reuses the cache."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_feature_train import IDS, B, T, V, _config, _data, _rows, _sigterm_at, _target, _Tok

from specjax.checkpoint import write_workdir
from specjax.distill import feature_cache as fc
from specjax.distill import feature_mode as fm
from specjax.distill import feature_ttt as ttt
from specjax.distill.sources import dataset_batch
from specjax.parallel import batch_sharding, param_shardings
from specjax.parallel.mesh import mesh_rules
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.runs import batch_placer

M = 6  # rows: a full batch of B = 4 and a padded one
LAYERS = (0, 1, 2)
# bfloat16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of itself (measured:
# 0.00386 for the features and the log-probs alike); 2^-7 leaves twice that
BF16_RTOL = 2.0**-7


@pytest.fixture(scope='module')
def target_dir(tmp_path_factory):
    """test_feature_train's tiny target (3 blocks, V = 32) and its 20-id vocab.json."""
    root = tmp_path_factory.mktemp('feature_cache')
    write_workdir(_target(), _Tok(), str(root / 'target'), source={})
    (root / 'vocab.json').write_text(json.dumps({'ids': IDS}))
    return root


@pytest.fixture(scope='module')
def target(target_dir):
    """(the frozen target, its mesh, its rules), loaded as the mode loads it."""
    return fm.load_target(_config(target_dir))


@pytest.fixture(scope='module')
def row_set():
    return _rows(np.random.default_rng(7), M)


def _ids():
    return np.asarray(IDS, np.int32)


def _build(target, row_set, directory, layers=LAYERS, ids=None, **kwargs):
    teacher, mesh, rules = target
    ids = _ids() if ids is None else ids
    return fc.build_or_load(
        teacher, row_set, layers, ids, B, str(directory), mesh=mesh, rules=rules, **kwargs
    )


@pytest.fixture(scope='module')
def built(target, row_set, tmp_path_factory):
    return _build(target, row_set, tmp_path_factory.mktemp('cache') / 'fc')


def _online(target, rows):
    """float32 (features, log-softmax over IDS) of the target on `rows`, one call."""
    teacher, _, _ = target
    logits, feats = jax.jit(ttt.target_forward, static_argnums=(0, 3))(
        teacher.graphdef, teacher.params, rows, LAYERS
    )
    logp = jax.nn.log_softmax(ttt.on_draft_vocab(logits, _ids()), axis=-1)
    return np.asarray(feats, np.float32), np.asarray(logp, np.float32)


def _bits(cache):
    return cache.features.view(np.uint16), cache.target_logp.view(np.uint16)


def test_the_cached_arrays_are_the_targets_outputs_in_bfloat16(target, row_set, built):
    feats, logp = _online(target, row_set)
    assert built.features.dtype == jnp.bfloat16 and built.target_logp.dtype == jnp.bfloat16
    assert isinstance(built.features.base, np.memmap)  # read from disk as batches draw rows
    cached_f = np.asarray(built.features, np.float32)
    cached_lp = np.asarray(built.target_logp, np.float32)
    assert cached_f.shape == (M, T, 3, 32) and cached_lp.shape == (M, T, len(IDS))
    np.testing.assert_allclose(cached_f, feats, rtol=BF16_RTOL, atol=1e-6)
    np.testing.assert_allclose(cached_lp, logp, rtol=BF16_RTOL, atol=1e-6)
    np.testing.assert_allclose(np.exp(cached_lp).sum(-1), 1.0, atol=1e-2)  # over the N ids
    info = fc.read_info(built.directory)
    assert info == built.info and info['rows_done'] == M and info['batch_size'] == B
    assert info['identity']['feature_layers'] == list(LAYERS)
    files = (fc.FEATURES_FILE, fc.LOGP_FILE)
    disk = sum(os.path.getsize(os.path.join(built.directory, f)) for f in files)
    assert info['bytes'] == disk and disk - 2 * M * T * (3 * 32 + len(IDS)) < 1024  # headers
    got = fc.rows(built, [4, 1])
    assert got['features'].dtype == jnp.bfloat16 and got['target_logp'].shape == (2, T, 20)
    np.testing.assert_array_equal(got['features'].view(np.uint16), _bits(built)[0][[4, 1]])


def test_a_cached_step_equals_the_online_step_up_to_bfloat16(target_dir, target, row_set, built):
    teacher, mesh, rules = target
    c = _config(target_dir, n_layers=1, ttt_steps=2)
    draft_cfg, ids = fm.prepare(c, data_config=False)
    tx = ttt.frozen_embedding(make_optimizer(c.train))
    draft_rules = mesh_rules(c.mesh)[1]
    graphdef, shardings, _, init = fm.plan_state(draft_cfg, teacher, tx, 0, mesh, draft_rules)
    b_sharding = batch_sharding(mesh, rules)
    all_shardings = (shardings, param_shardings(mesh, teacher.params, rules), b_sharding)
    s = fm.settings(c, draft_cfg)
    idx = np.array([5, 0, 3, 2])
    host = dataset_batch(dict({k: v[idx] for k, v in row_set.items()}))
    host.update(fc.rows(built, idx))
    batch = batch_placer(b_sharding, ttt.STEP_KEYS + ttt.CACHED_KEYS)(host)
    out = {}
    for cached in (False, True):
        step = ttt.jit_feature_step(
            graphdef, teacher.graphdef, tx, learning_rate_schedule(c.train), s, ids,
            all_shardings, mesh, cached=cached,
        )  # fmt: skip
        state = init().replace(step=jnp.ones((), jnp.int32))  # past warmup: lr > 0
        out[cached] = jax.device_get(step(state, teacher.params, batch))
    (online, m_online), (cached, m_cached) = out[False], out[True]
    assert sorted(m_online) == sorted(m_cached)
    # relative differences measured: alpha_step0 1.5e-4, alpha_step1 1.2e-4, grad_norm 3.4e-5,
    # kd_step1 2.3e-5, loss 1.3e-5; Adam's first update (lr * sign of the gradient) is equal
    for key in sorted(m_online):
        np.testing.assert_allclose(m_cached[key], m_online[key], rtol=4e-4, err_msg=key)
    for a, b in zip(jax.tree.leaves(cached.params), jax.tree.leaves(online.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=4e-4, atol=1e-6)


class _Stop(Exception):
    pass


def _stop_after_first(done):
    raise _Stop(done)


def _no_target(*args, **kwargs):
    raise AssertionError('the target ran for a complete cache')


def test_an_interrupted_build_resumes_a_complete_one_is_reused_others_are_refused(
    target, row_set, built, tmp_path, monkeypatch
):
    directory = tmp_path / 'fc'
    with pytest.raises(_Stop):
        _build(target, row_set, directory, on_batch=_stop_after_first)
    assert fc.read_info(str(directory))['rows_done'] == B < M
    resumed = _build(target, row_set, directory)
    assert resumed.info['rows_done'] == M
    for a, b in zip(_bits(resumed), _bits(built), strict=True):
        np.testing.assert_array_equal(a, b)  # as the uninterrupted build
    monkeypatch.setattr(fc, 'forward_fn', _no_target)
    again = _build(target, row_set, directory)
    for a, b in zip(_bits(again), _bits(built), strict=True):
        np.testing.assert_array_equal(a, b)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in directory.iterdir())
    with pytest.raises(ValueError, match=rf'{directory} .*feature_layers: \[0, 1, 2\] in the'):
        _build(target, row_set, directory, layers=(0, 2, 1))
    with pytest.raises(ValueError, match=r'draft_vocab_sha256: .* in the cache, None now'):
        fc.build_or_load(
            target[0], row_set, LAYERS, None, B, str(directory), mesh=target[1], rules=target[2]
        )
    other = dict(row_set, tokens=row_set['tokens'][::-1].copy())
    with pytest.raises(ValueError, match=r'rows_sha256: '):
        _build(target, other, directory)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in directory.iterdir()) == before


def _smollm2_root(target_dir, root):
    """<root>/target (the tiny target) and <root>/teacher_cache with M train rows."""
    from specjax.distill.reduced_train import save_cache

    rng, arrays = np.random.default_rng(5), {}
    for prefix, n in (('train', M), ('eval', 4)):
        rows = _rows(rng, n)
        arrays.update({f'{prefix}_{x}': rows[x] for x in ('tokens', 'positions', 'segment_ids')})
    os.symlink(target_dir / 'target', root / 'target')
    save_cache(str(root / 'teacher_cache'), {'ids': IDS, 'target_vocab_size': V}, arrays)
    return arrays


def _stage_config(root):
    c = _config(root, steps=4, n_layers=1, ttt_steps=2, cache=True)
    c.distill.source = 'dataset'
    c.train.update(log_every=2, eval_every=2, checkpoint_every=2)
    return c


def test_smollm2_stage_trains_on_the_cache_and_resumes_bit_identically(
    target_dir, tmp_path, monkeypatch
):
    from specjax.distill.reduced_task import RowOrder
    from specjax.quickstart import smollm2_feature as sf

    arrays = _smollm2_root(target_dir, tmp_path)
    full = str(tmp_path / 'full')
    res = sf.train_on_cache(_stage_config(tmp_path), full, str(tmp_path), _Tok())
    assert res['step'] == 4 and 0 < res['alpha_step0'] <= 1
    info = res['feature_cache']
    assert info['rows_done'] == M and info['dtype'] == 'bfloat16' and info['seconds'] > 0
    assert info['directory'] == os.path.join(full, sf.FEATURE_CACHE_DIR)
    assert info['bytes_per_row'] == info['bytes'] // M
    with open(os.path.join(full, 'results.json')) as f:
        assert json.load(f)['feature_cache']['bytes'] == info['bytes']
    # each training batch carries its rows' cached features (the RowOrder draws them)
    cache = fc.open_cache(info['directory'])
    data = sf.cache_data(str(tmp_path / 'teacher_cache'), _Tok(), B, 0, 1, features=cache)
    order = RowOrder(lambda rows: rows, M, B, 0)
    for _ in range(3):  # past the first permutation
        rows, batch = next(order), next(data.train)
        np.testing.assert_array_equal(batch['tokens'], arrays['train_tokens'][rows])
        for key, values in (('features', cache.features), ('target_logp', cache.target_logp)):
            np.testing.assert_array_equal(batch[key].view(np.uint16), values[rows].view(np.uint16))

    work = str(tmp_path / 'resumed')
    c = _stage_config(tmp_path)
    part = sf.train_on_cache(c, work, str(tmp_path), _Tok(), on_step=_sigterm_at(3))
    assert part['preempted'] and part['step'] == 3
    monkeypatch.setattr(fc, 'forward_fn', _no_target)  # the rerun reuses the complete cache
    done = sf.train_on_cache(_stage_config(tmp_path), work, str(tmp_path), _Tok())
    for key in ('step', 'val_loss', 'alpha_step0', 'alpha_step1'):
        assert done[key] == res[key], key
    a, _ = fm.load_feature_draft(full)
    b, _ = fm.load_feature_draft(work)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    online = _stage_config(tmp_path)
    online.feature.cache = False
    with pytest.raises(ValueError, match=r"feature_data: 'cached-bf16' in the checkpoint, 'online"):
        sf.train_on_cache(online, work, str(tmp_path), _Tok())  # the identity records the cache
    online.distill.source = 'teacher'
    online.feature.cache = True
    with pytest.raises(ValueError, match=r"source='teacher' must be 'dataset'.*feature.cache"):
        sf.check_config(online, T)


def test_cache_true_without_cached_data_is_refused_naming_the_field(target_dir, tmp_path):
    c = _config(target_dir, cache=True)
    with pytest.raises(ValueError, match=r'config.feature.cache=True needs config.distill.source'):
        fm.run_feature_draft(c, str(tmp_path / 'a'), data=_data())
    c.distill.source = 'dataset'
    with pytest.raises(ValueError, match=r'config.feature.cache=True needs training batches'):
        fm.run_feature_draft(c, str(tmp_path / 'b'), data=_data())
    assert not (tmp_path / 'a').exists() and not (tmp_path / 'b').exists()
