"""Distillation: sources, bad input, learning, frozen teacher, resume, the cross-entropy-only step.

A session-scoped teacher (tests/distill_data.py: a tiny model briefly pretrained on synthetic
bigram data with two domains and an eos) backs every test that needs one; runs use the real
modes with injected data.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distill_data import (
    EOS,
    TOKENIZER,
    V,
    bigram_batch,
    distill_config,
    distill_data,
    params_bytes,
    teacher_model_cfg,
    train_cfg,
)

from specjax.checkpoint import Checkpoints
from specjax.distill import sources
from specjax.distill.config import model_config
from specjax.distill.distill_mode import build_distill, run_distill
from specjax.distill.steps import LossSettings, distill_step
from specjax.distill.teacher import params_fingerprint
from specjax.models import TransformerConfig, split
from specjax.train.loop import run_loop
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.state import TrainState

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
        run_distill(config, str(tmp_path / 'run'), data=distill_data())
    assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_draft_must_share_the_teachers_tokenizer_and_vocab(teacher_workdir, tmp_path):
    other = dict(TOKENIZER, hash='another')
    with pytest.raises(ValueError, match='tokenizer mismatch'):
        build_distill(distill_config(teacher_workdir), distill_data(tokenizer=other))
    config = distill_config(teacher_workdir)
    config.draft.vocab_size = V + 8
    with pytest.raises(ValueError, match=r'config\.draft\.vocab_size=40'):
        build_distill(config, distill_data())


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
        build_distill(distill_config(str(broken)), distill_data())


# ------------------------------------------------------------------ learning and frozen teacher


def test_distillation_raises_alpha_and_leaves_the_teacher_untouched(teacher_workdir, tmp_path):
    """30 FKL steps: held-out α at T = 1 rises by >= 0.15 over the initial draft's and ends >= 0.05
    above a cross-entropy-only draft trained for the same 30 steps."""
    before = params_bytes(teacher_workdir)
    ckpt_files = sorted(os.listdir(os.path.join(teacher_workdir, 'checkpoints')))
    task, parts = build_distill(distill_config(teacher_workdir), distill_data())
    teacher = parts['teacher']
    fingerprint = params_fingerprint(teacher.params)
    initial = parts['evaluator'](task.init_state().params, teacher.params)
    kd = run_loop(task, str(tmp_path / 'kd'), distill_config(teacher_workdir).train).eval
    ce = run_distill(
        distill_config(teacher_workdir, kd_weight=0.0, ce_weight=1.0),
        str(tmp_path / 'ce'),
        data=distill_data(),
    )
    a_kd, a_init, a_ce = kd['alpha_T1'], initial['alpha_T1'], ce['alpha_T1']
    assert a_kd >= a_init + 0.15, (a_kd, a_init)
    assert a_kd >= a_ce + 0.05, (a_kd, a_ce)
    assert kd['draft_loss'] < initial['draft_loss']
    # The teacher: bit-identical in memory and on disk, no new checkpoint, not in the draft's.
    assert params_fingerprint(teacher.params) == fingerprint
    for a, b in zip(before, params_bytes(teacher_workdir), strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(os.path.join(teacher_workdir, 'checkpoints'))) == ckpt_files
    ckpts = Checkpoints(str(tmp_path / 'kd'), read_only=True)
    meta = ckpts.metadata()
    ckpts.close()
    assert meta['teacher']['workdir'] == os.path.abspath(teacher_workdir)
    assert meta['teacher']['params_sha256'] == fingerprint
    draft = params_bytes(str(tmp_path / 'kd'))
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
    run_distill(config, str(tmp_path / 'straight'), data=distill_data())

    class Interrupt(Exception):
        pass

    def stop_at_3(step, state):
        if step == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_distill(config, str(tmp_path / 'resumed'), data=distill_data(), on_step=stop_at_3)
    assert Checkpoints(str(tmp_path / 'resumed'), read_only=True).all_steps() == [2]
    results = run_distill(config, str(tmp_path / 'resumed'), data=distill_data())
    assert results['step'] == 4
    for a, b in zip(
        params_bytes(str(tmp_path / 'straight')),
        params_bytes(str(tmp_path / 'resumed')),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_cross_entropy_only_step_never_reads_the_teacher():
    """kd_weight 0: the step skips the teacher's forward, so its update is the same whatever the
    teacher (NaN params included); with kd_weight > 0 the same NaN teacher poisons the update."""
    from flax import nnx

    from specjax.models import Transformer

    draft = Transformer(TransformerConfig.from_dict(model_config('test', V, 64)), rngs=nnx.Rngs(0))
    teacher = Transformer(TransformerConfig.from_dict(teacher_model_cfg()), rngs=nnx.Rngs(1))
    (dgd, dp), (tgd, tp) = split(draft), split(teacher)
    nan_tp = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tp)
    train = train_cfg(2)
    tx, schedule = make_optimizer(train), learning_rate_schedule(train)
    host = bigram_batch(np.random.default_rng(7))
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
