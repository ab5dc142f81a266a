"""Co-training (mode cotrain): its step is a target step plus a distillation step, a run writes
results and both models, a run started from a pretrain step continues that target exactly, and
generated sources or a draft of another vocabulary are refused.

Data and configs: tests/distill_data.py (synthetic two-domain bigram rows).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from distill_data import (
    CORPUS,
    DOMAINS,
    TOKENIZER,
    Batches,
    T,
    V,
    bigram_batch,
    cotrain_config,
    distill_data,
    eval_batches,
    params_bytes,
    teacher_model_cfg,
    train_cfg,
)

from specjax.checkpoint import load_model
from specjax.distill import sources
from specjax.distill.cotrain import build_cotrain, run_cotrain
from specjax.distill.steps import LossSettings, distill_step
from specjax.parallel import default_mesh_config
from specjax.train.optimizer import learning_rate_schedule, make_optimizer
from specjax.train.pretrain import PretrainData, pretrain
from specjax.train.state import TrainState
from specjax.train.steps import train_step

# ------------------------------------------------------------------ co-training


def test_cotrain_step_is_target_step_plus_distill_step():
    """The jitted co-training step (one target forward) == a pretrain step of the target plus a
    distillation step of the draft against the pre-update target, on the same batch."""
    config = cotrain_config()
    task, parts = build_cotrain(config, distill_data())
    tgd, dgd = parts['graphdefs']
    state = task.init_state()
    before = jax.tree.map(jnp.copy, state)  # the step donates its input
    host = bigram_batch(np.random.default_rng(7))
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
    results = run_cotrain(cotrain_config(), workdir, data=distill_data())
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
    c.model = teacher_model_cfg()
    c.data = ml_collections.ConfigDict({'seq_len': T})
    c.train = train_cfg(8, checkpoint_every=4)
    c.mesh = default_mesh_config()
    pretrain(c, pre, data=PretrainData(Batches(0), eval_batches(), TOKENIZER, CORPUS, V, DOMAINS))

    config = cotrain_config(steps=8)
    config.train = train_cfg(8)
    config.distill.update(eval_generate_batches=0, final_spec_k=0)
    config.init = ml_collections.ConfigDict({'target_workdir': pre, 'target_step': 4})
    for field, value, match in (
        ('target_step', 3, r'config\.init\.target_step=3'),
        ('target_step', 8, r'config\.init\.target_step=8'),
    ):
        bad = ml_collections.ConfigDict(config.to_dict())
        bad.init[field] = value
        with pytest.raises(ValueError, match=match):
            run_cotrain(bad, str(tmp_path / 'bad'), data=distill_data(seed=0))
    bad = ml_collections.ConfigDict(config.to_dict())
    bad.train.lr = 0.5
    with pytest.raises(ValueError, match=r'config\.train\.lr=0\.5'):
        run_cotrain(bad, str(tmp_path / 'bad'), data=distill_data(seed=0))
    assert not os.path.exists(tmp_path / 'bad' / 'checkpoints')

    co = str(tmp_path / 'co')
    steps_seen = []
    run_cotrain(config, co, data=distill_data(seed=0), on_step=lambda s, _: steps_seen.append(s))
    assert steps_seen == [5, 6, 7, 8]  # the draft trains for train.steps - init.target_step
    got, want = params_bytes(co), params_bytes(pre)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    start = params_bytes(pre, step=4)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, start)) > 1e-3  # it did train


def test_cotrain_rejects_generated_sources_and_vocab_mismatch(tmp_path):
    config = cotrain_config()
    config.distill.source = 'on_policy'
    with pytest.raises(ValueError, match=r"config\.distill\.source='on_policy'"):
        run_cotrain(config, str(tmp_path), data=distill_data())
    config = cotrain_config()
    config.draft.vocab_size = V + 1
    with pytest.raises(ValueError, match=r'config\.draft\.vocab_size=33 differs'):
        run_cotrain(config, str(tmp_path), data=distill_data())
