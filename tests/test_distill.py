"""Distillation and co-training: sources, bad input, learning, frozen teacher, resume, cotrain step.

A session-scoped teacher (a tiny model briefly pretrained on synthetic bigram data with two
domains and an eos) backs every test that needs one; runs use the real modes with injected data.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from specjax.checkpoint import Checkpoints, load_model
from specjax.distill import sources
from specjax.distill.config import default_distill_config, model_config
from specjax.distill.cotrain import build_cotrain, run_cotrain
from specjax.distill.distill_mode import build_distill, run_distill
from specjax.distill.sources import DistillData
from specjax.distill.steps import LossSettings, distill_step
from specjax.distill.teacher import params_fingerprint
from specjax.models import TransformerConfig, split
from specjax.parallel import default_mesh_config
from specjax.train.config import default_train_config
from specjax.train.loop import run_loop
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.pretrain import PretrainData, pretrain
from specjax.train.state import TrainState
from specjax.train.steps import train_step

V, PAD, BOS, EOS = 32, 0, 1, 2
T, B = 32, 16
DOMAINS = ('a', 'b')
TOKENIZER = {'kind': 'synthetic-bigram', 'vocab_size': V, 'hash': 'bigram-v1'}
CORPUS = {'name': 'synthetic-bigram', 'manifest_hash': 'v1'}


# ------------------------------------------------------------------ synthetic data


def _transitions():
    rng = np.random.default_rng(0)
    mats = []
    for _ in DOMAINS:
        m = np.zeros((V, V))
        m[:, 3:] = rng.dirichlet(np.full(V - 3, 0.3), size=V) * 0.97
        m[:, EOS] = 0.03
        mats.append(m)
    return mats


_MATS = _transitions()


def _batch(rng, b=B, t=T):
    """One row per document: bos, a bigram chain of its row's domain, eos (maybe), padding."""
    tokens = np.zeros((b, t), np.int32)
    seg = np.zeros((b, t), np.int32)
    dom = np.full((b, t), -1, np.int32)
    for i in range(b):
        d, n = i % len(DOMAINS), t
        tokens[i, 0] = BOS
        for j in range(1, t):
            tokens[i, j] = rng.choice(V, p=_MATS[d][tokens[i, j - 1]])
            if tokens[i, j] == EOS:
                n = j + 1
                break
        tokens[i, n:] = PAD
        seg[i, :n], dom[i, :n] = 1, d
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    return {'tokens': tokens, 'segment_ids': seg, 'positions': pos, 'domain_ids': dom}


class _Batches:
    """Deterministic infinite batches with a JSON state, like the grain iterator."""

    def __init__(self, seed):
        self.seed, self.index = seed, 0

    def get_state(self):
        return {'index': self.index}

    def set_state(self, state):
        self.index = int(state['index'])

    def __iter__(self):
        return self

    def __next__(self):
        self.index += 1
        return _batch(np.random.default_rng([self.seed, self.index - 1]))


def _eval_batches(n=2):
    rng = np.random.default_rng(12345)
    return [_batch(rng) for _ in range(n)]


def _data(seed=1, tokenizer=TOKENIZER):
    return DistillData(_Batches(seed), _eval_batches(), dict(tokenizer), CORPUS, V, DOMAINS, EOS)


def _train_cfg(steps, lr=1e-2, **kw):
    c = default_train_config()
    c.update(
        steps=steps,
        batch_size=B,
        lr=lr,
        warmup_steps=2,
        log_every=10,
        eval_every=1000,
        eval_batches=2,
        checkpoint_every=1000,
        async_checkpointing=False,
    )
    c.update(kw)
    return c


def _teacher_model_cfg():
    c = model_config('test', V, 64)
    c.d_model, c.d_ff = 64, 128
    return c


def distill_config(teacher_workdir, steps=30, train=None, **distill):
    c = ml_collections.ConfigDict()
    c.mode, c.seed = 'distill', 0
    c.draft = model_config('test', V, 64)
    c.data = ml_collections.ConfigDict({'seq_len': T})
    c.distill = default_distill_config()
    c.distill.update(
        teacher_workdir=teacher_workdir,
        prompt_len=8,
        max_new_tokens=T - 8,
        calibrate=False,
        final_spec_k=0,
        eval_generate_batches=0,
        eval_temperatures=(1.0,),
    )
    c.distill.update(distill)
    c.sampling = ml_collections.ConfigDict({'temperature': 1.0, 'top_k': 0, 'top_p': 1.0})
    c.train = _train_cfg(steps, **(train or {}))
    c.mesh = default_mesh_config()
    return c


@pytest.fixture(scope='session')
def teacher_workdir(tmp_path_factory):
    """A tiny target pretrained for 80 steps on the synthetic bigram data."""
    workdir = str(tmp_path_factory.mktemp('teacher'))
    c = ml_collections.ConfigDict()
    c.mode, c.seed = 'pretrain', 0
    c.model = _teacher_model_cfg()
    c.data = ml_collections.ConfigDict({'seq_len': T})
    c.train = _train_cfg(80)
    c.mesh = default_mesh_config()
    data = PretrainData(_Batches(0), _eval_batches(), TOKENIZER, CORPUS, V, DOMAINS)
    pretrain(c, workdir, data=data)
    return workdir


def _params_bytes(workdir, **kw):
    model, _ = load_model(workdir, **kw)
    return [np.asarray(x) for x in jax.tree.leaves(split(model)[1])]


# ------------------------------------------------------------------ sources (no teacher)


def test_assemble_masks_prompt_generation_eos_and_padding():
    prompts = np.array([[5, 6, 7, 0], [5, 6, 7, 8]], np.int32)
    gen = np.array([[9, 10, EOS, 0, 0], [11, 12, 13, 14, 15]], np.int32)
    out = sources.assemble(prompts, np.array([3, 4]), gen, np.array([3, 5]))
    np.testing.assert_array_equal(out['tokens'][0], [5, 6, 7, 9, 10, EOS, 0, 0, 0])
    np.testing.assert_array_equal(out['tokens'][1], [5, 6, 7, 8, 11, 12, 13, 14, 15])
    np.testing.assert_array_equal(out['segment_ids'][0], [1, 1, 1, 1, 1, 1, 0, 0, 0])
    # loss_mask[t] predicts token t+1: generated tokens only (eos included, nothing after it).
    np.testing.assert_array_equal(out['loss_mask'][0], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(out['loss_mask'][1], [0, 0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(out['ce_mask'][0], [1, 1, 0, 0, 0, 0, 0, 0])


def test_prompts_take_the_first_document():
    batch = {
        'tokens': np.array([[1, 5, 6, 2, 1, 7], [1, 8, 9, 10, 11, 12]], np.int32),
        'segment_ids': np.array([[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1]]),
        'domain_ids': np.array([[0] * 6, [1] * 6]),
    }
    prompts, lengths, domains = sources.prompts_from_batch(batch, 5)
    np.testing.assert_array_equal(lengths, [4, 5])
    np.testing.assert_array_equal(prompts[0], [1, 5, 6, 2, 0])
    np.testing.assert_array_equal(domains, [0, 1])


def test_mixture_choice_is_deterministic_with_rate_lambda():
    kinds = [
        sources.source_for_step('mixture', s, seed=3, mixture_lambda=0.3, mixture_base='dataset')
        for s in range(2000)
    ]
    again = [
        sources.source_for_step('mixture', s, seed=3, mixture_lambda=0.3, mixture_base='dataset')
        for s in range(2000)
    ]
    assert kinds == again
    assert set(kinds) == {'on_policy', 'dataset'}
    assert abs(kinds.count('on_policy') / 2000 - 0.3) < 0.04


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    'field,value,match',
    [
        ('divergence', 'kl3', r"config\.distill\.divergence='kl3'"),
        ('source', 'web', r"config\.distill\.source='web'"),
        ('beta', 1.5, r'config\.distill\.beta'),
        ('beta', -0.1, r'config\.distill\.beta'),
        ('mixture_lambda', 2.0, r'config\.distill\.mixture_lambda'),
        ('divergence', 'expected_accepted_length', r"source='on_policy' or 'mixture'"),
        ('teacher_workdir', '/nonexistent/teacher', r'config\.distill\.teacher_workdir'),
        ('teacher_workdir', '', r'config\.distill\.teacher_workdir'),
    ],
)
def test_bad_distill_fields_fail_before_training(tmp_path, field, value, match):
    config = distill_config(str(tmp_path))
    config.distill[field] = value
    with pytest.raises(ValueError, match=match):
        run_distill(config, str(tmp_path / 'run'), data=_data())
    assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_cotrain_rejects_generated_sources_and_vocab_mismatch(tmp_path):
    config = _cotrain_config()
    config.distill.source = 'on_policy'
    with pytest.raises(ValueError, match=r"config\.distill\.source='on_policy'"):
        run_cotrain(config, str(tmp_path), data=_data())
    config = _cotrain_config()
    config.draft.vocab_size = V + 1
    with pytest.raises(ValueError, match=r'config\.draft\.vocab_size=33 differs'):
        run_cotrain(config, str(tmp_path), data=_data())


def test_draft_must_share_the_teachers_tokenizer_and_vocab(teacher_workdir, tmp_path):
    other = dict(TOKENIZER, hash='another')
    with pytest.raises(ValueError, match='tokenizer mismatch'):
        build_distill(distill_config(teacher_workdir), _data(tokenizer=other))
    config = distill_config(teacher_workdir)
    config.draft.vocab_size = V + 8
    with pytest.raises(ValueError, match=r'config\.draft\.vocab_size=40'):
        build_distill(config, _data())


def test_teacher_checkpoint_not_matching_its_config(teacher_workdir, tmp_path):
    broken = tmp_path / 'broken'
    shutil.copytree(teacher_workdir, broken)
    ckpts = Checkpoints(str(broken), read_only=True)
    step = ckpts.latest_step()
    ckpts.close()
    meta_dir = broken / 'checkpoints' / str(step) / 'meta'
    meta_file = next(p for p in meta_dir.iterdir() if p.suffix == '' or p.suffix == '.json')
    meta = json.loads(meta_file.read_text())
    meta['model_config']['d_model'] = 48
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match='does not match'):
        build_distill(distill_config(str(broken)), _data())


# ------------------------------------------------------------------ learning and frozen teacher


def test_distillation_raises_alpha_and_leaves_the_teacher_untouched(teacher_workdir, tmp_path):
    """30 FKL steps: held-out α at T = 1 rises by >= 0.15 over the initial draft's and ends >= 0.05
    above a cross-entropy-only draft trained for the same 30 steps."""
    before = _params_bytes(teacher_workdir)
    ckpt_files = sorted(os.listdir(os.path.join(teacher_workdir, 'checkpoints')))
    task, parts = build_distill(distill_config(teacher_workdir), _data())
    teacher = parts['teacher']
    fingerprint = params_fingerprint(teacher.params)
    initial = parts['evaluator'](task.init_state().params, teacher.params)
    kd = run_loop(task, str(tmp_path / 'kd'), distill_config(teacher_workdir).train).eval
    ce = run_distill(
        distill_config(teacher_workdir, kd_weight=0.0, ce_weight=1.0),
        str(tmp_path / 'ce'),
        data=_data(),
    )
    a_kd, a_init, a_ce = kd['alpha_T1'], initial['alpha_T1'], ce['alpha_T1']
    assert a_kd >= a_init + 0.15, (a_kd, a_init)
    assert a_kd >= a_ce + 0.05, (a_kd, a_ce)
    assert kd['draft_loss'] < initial['draft_loss']
    # The teacher: bit-identical in memory and on disk, no new checkpoint, not in the draft's.
    assert params_fingerprint(teacher.params) == fingerprint
    for a, b in zip(before, _params_bytes(teacher_workdir), strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(os.path.join(teacher_workdir, 'checkpoints'))) == ckpt_files
    ckpts = Checkpoints(str(tmp_path / 'kd'), read_only=True)
    meta = ckpts.metadata()
    ckpts.close()
    assert meta['teacher']['workdir'] == os.path.abspath(teacher_workdir)
    assert meta['teacher']['params_sha256'] == fingerprint
    draft = _params_bytes(str(tmp_path / 'kd'))
    draft_cfg = TransformerConfig.from_dict(meta['model_config'])
    assert sum(x.size for x in draft) == draft_cfg.num_params


# ------------------------------------------------------------------ resume


def test_interrupted_distillation_resumes_to_the_same_params(teacher_workdir, tmp_path):
    config = distill_config(
        teacher_workdir,
        steps=4,
        train={'checkpoint_every': 2},
        source='mixture',
        mixture_lambda=0.75,
        mixture_base='teacher',
    )
    kinds = [
        sources.source_for_step('mixture', s, seed=0, mixture_lambda=0.75, mixture_base='teacher')
        for s in range(4)
    ]
    assert kinds == ['on_policy', 'on_policy', 'teacher', 'on_policy']  # both sides of the resume
    run_distill(config, str(tmp_path / 'straight'), data=_data())

    class Interrupt(Exception):
        pass

    def stop_at_3(step, state):
        if step == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_distill(config, str(tmp_path / 'resumed'), data=_data(), on_step=stop_at_3)
    assert Checkpoints(str(tmp_path / 'resumed'), read_only=True).all_steps() == [2]
    results = run_distill(config, str(tmp_path / 'resumed'), data=_data())
    assert results['step'] == 4
    for a, b in zip(
        _params_bytes(str(tmp_path / 'straight')),
        _params_bytes(str(tmp_path / 'resumed')),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ co-training


def _cotrain_config(steps=2):
    c = distill_config(
        '',
        steps=steps,
        eval_generate_batches=1,
        final_spec_k=4,
        divergence='jsd',
        beta=0.4,
        loss_temperature=2.0,
        scale_by_t2=True,
        ce_weight=0.3,
    )
    c.mode = 'cotrain'
    c.model = _teacher_model_cfg()
    return c


def test_cotrain_step_is_target_step_plus_distill_step():
    """The jitted co-training step (one target forward) == a pretrain step of the target plus a
    distillation step of the draft against the pre-update target, on the same batch."""
    config = _cotrain_config()
    task, parts = build_cotrain(config, _data())
    tgd, dgd = parts['graphdefs']
    state = task.init_state()
    before = jax.tree.map(jnp.copy, state)  # the step donates its input
    host = _batch(np.random.default_rng(7))
    co, metrics = task.step(state, task.put_batch(host))
    tx = make_optimizer(config.train)
    schedule = learning_rate_schedule(config.train)
    loss = LossSettings.from_config(config.distill)
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    mask = sources.data_masks(batch['segment_ids'])
    target_state = TrainState(
        step=before.step, params=before.params, opt_state=before.opt_state, rng=before.rng
    )
    t_new, _ = jax.jit(lambda s, b: train_step(tgd, s, b, tx=tx, schedule=schedule))(
        target_state, batch
    )
    draft_state = TrainState(
        step=before.step,
        params=before.draft_params,
        opt_state=before.draft_opt_state,
        rng=before.rng,
    )
    d_batch = dict(batch, loss_mask=mask, ce_mask=mask)
    d_new, _ = jax.jit(
        lambda s, tp, b: distill_step(dgd, tgd, s, tp, b, tx=tx, schedule=schedule, loss=loss)
    )(draft_state, before.params, d_batch)
    for got, want in ((co.params, t_new.params), (co.draft_params, d_new.params)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert np.isfinite(float(metrics['draft_loss']))


def test_cotrain_run_writes_results_and_both_models(tmp_path):
    workdir = str(tmp_path / 'co')
    results = run_cotrain(_cotrain_config(), workdir, data=_data())
    with open(os.path.join(workdir, 'results.json')) as f:
        saved = json.load(f)
    for key in (
        'alpha_T1',
        'alpha_generated_T1',
        'alpha_target_generated_T1',
        'tau_pred_k4_T1',
        'tau_pred_k8_T1',
        'acceptance_k4_T1',
        'tau_k4_T1',
        'predicted_speedup_k4_T1',
        'draft_val_loss',
        'target_val_loss',
        'alpha_T1/a',
        'alpha_generated_T1/b',
    ):
        assert key in saved and key in results, key
    assert 0.0 <= saved['acceptance_k4_T1'] <= 1.0 and 1.0 <= saved['tau_k4_T1'] <= 5.0
    draft, meta = load_model(workdir, params_key='draft_params', config_key='draft_config')
    assert draft.config.d_model == 32 and meta['mode'] == 'cotrain'
    target, _ = load_model(workdir)
    assert target.config.d_model == 64


def test_cotrain_from_a_pretrain_step_continues_its_target_exactly(tmp_path):
    """init.target_workdir: the target resumes the pretrain run (params, optimizer, data
    position), so after co-training to the same step it equals the pretrain run's target."""
    pre = str(tmp_path / 'pre')
    c = ml_collections.ConfigDict()
    c.mode, c.seed = 'pretrain', 0
    c.model = _teacher_model_cfg()
    c.data = ml_collections.ConfigDict({'seq_len': T})
    c.train = _train_cfg(8, checkpoint_every=4)
    c.mesh = default_mesh_config()
    pretrain(c, pre, data=PretrainData(_Batches(0), _eval_batches(), TOKENIZER, CORPUS, V, DOMAINS))

    config = _cotrain_config(steps=8)
    config.train = _train_cfg(8)
    config.distill.update(eval_generate_batches=0, final_spec_k=0)
    config.init = ml_collections.ConfigDict({'target_workdir': pre, 'target_step': 4})
    for field, value, match in (
        ('target_step', 3, r'config\.init\.target_step=3'),
        ('target_step', 8, r'config\.init\.target_step=8'),
    ):
        bad = ml_collections.ConfigDict(config.to_dict())
        bad.init[field] = value
        with pytest.raises(ValueError, match=match):
            run_cotrain(bad, str(tmp_path / 'bad'), data=_data(seed=0))
    bad = ml_collections.ConfigDict(config.to_dict())
    bad.train.lr = 0.5
    with pytest.raises(ValueError, match=r'config\.train\.lr=0\.5'):
        run_cotrain(bad, str(tmp_path / 'bad'), data=_data(seed=0))
    assert not os.path.exists(tmp_path / 'bad' / 'checkpoints')

    co = str(tmp_path / 'co')
    steps_seen = []
    run_cotrain(config, co, data=_data(seed=0), on_step=lambda s, _: steps_seen.append(s))
    assert steps_seen == [5, 6, 7, 8]  # the draft trains for train.steps - init.target_step
    got, want = _params_bytes(co), _params_bytes(pre)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    start = _params_bytes(pre, step=4)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, start)) > 1e-3  # it did train


def test_cross_entropy_only_step_never_reads_the_teacher():
    """kd_weight 0: the step skips the teacher's forward, so its update is the same whatever the
    teacher (NaN params included); with kd_weight > 0 the same NaN teacher poisons the update."""
    from flax import nnx

    from specjax.models import Transformer

    draft = Transformer(TransformerConfig.from_dict(model_config('test', V, 64)), rngs=nnx.Rngs(0))
    teacher = Transformer(TransformerConfig.from_dict(_teacher_model_cfg()), rngs=nnx.Rngs(1))
    (dgd, dp), (tgd, tp) = split(draft), split(teacher)
    nan_tp = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tp)
    train = _train_cfg(2)
    tx, schedule = make_optimizer(train), learning_rate_schedule(train)
    host = _batch(np.random.default_rng(7))
    mask = sources.data_masks(jnp.asarray(host['segment_ids']))
    batch = {k: jnp.asarray(host[k]) for k in ('tokens', 'positions', 'segment_ids')}
    batch.update(loss_mask=mask, ce_mask=mask)

    @functools.cache
    def jitted(kd_weight):
        loss = LossSettings(kd_weight=kd_weight, ce_weight=1.0)
        return jax.jit(
            lambda s, t, b: distill_step(dgd, tgd, s, t, b, tx=tx, schedule=schedule, loss=loss)
        )

    def step(teacher_params, kd_weight):
        state = TrainState(jnp.int32(0), dp, tx.init(dp), jax.random.PRNGKey(0))
        return jitted(kd_weight)(state, teacher_params, batch)

    (real, m), (nan, _) = step(tp, 0.0), step(nan_tp, 0.0)
    for a, b in zip(jax.tree.leaves(real.params), jax.tree.leaves(nan.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(float(m['loss'])) and float(m['loss']) == float(m['ce'])
    poisoned, _ = step(nan_tp, 0.5)
    assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(poisoned.params))
