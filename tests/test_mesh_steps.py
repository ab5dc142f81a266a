"""The LM train, distill and co-train steps on 8 simulated devices equal one device.

One subprocess (XLA_FLAGS forces 8 host devices) runs each step a few times on meshes (8,1,1),
(2,2,2) and (1,2,4) (data x fsdp x tensor) with the default rules, and compares params, Adam
moments and metrics with the same steps on a 1-device mesh (highest matmul precision). It also
checks the layout: the state comes out sharded as the rules say (specs and per-device shard
shapes of the embedding, an MLP weight and their Adam moments).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax

_SCRIPT = textwrap.dedent(
    """
    import time
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from specjax.distill.cotrain import plan_cotrain_state
    from specjax.distill.steps import LossSettings, jit_cotrain_step, jit_distill_step
    from specjax.models import Transformer, TransformerConfig, split
    from specjax.parallel import batch_sharding, default_mesh_config, make_mesh, param_shardings
    from specjax.train.config import default_train_config
    from specjax.train.optimizer import learning_rate_schedule, make_optimizer
    from specjax.train.state import plan_train_state
    from specjax.train.steps import jit_train_step

    assert jax.device_count() == 8, jax.devices()
    jax.config.update('jax_default_matmul_precision', 'highest')
    V, B, T, STEPS = 64, 8, 8, 2
    target_cfg = TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4,
                                   d_ff=64, max_len=16)
    draft_cfg = TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4,
                                  d_ff=64, max_len=16, tie_embeddings=False)
    tc = default_train_config()
    tc.update(dict(steps=10, lr=1e-3, warmup_steps=1, weight_decay=0.1))
    tx, schedule = make_optimizer(tc), learning_rate_schedule(tc)
    loss = LossSettings(divergence='fkl', ce_weight=0.5)
    rng = np.random.default_rng(0)
    segs = np.ones((B, T), np.int32)
    segs[:, T // 2:] = 2
    segs[::2, -3:] = 0  # padding
    pos = np.where(segs == 2, np.arange(T) - T // 2, np.arange(T)).astype(np.int32)
    tokens = np.where(segs > 0, rng.integers(1, V, (B, T)), 0).astype(np.int32)
    mask = (segs[:, 1:] == segs[:, :-1]) & (segs[:, :-1] != 0)
    host_batch = dict(tokens=tokens, positions=pos, segment_ids=segs, loss_mask=mask, ce_mask=mask)
    _, teacher_params = split(Transformer(target_cfg, rngs=nnx.Rngs(7)))

    def run(shape, devices):
        mc = default_mesh_config()
        mc.shape = shape
        mesh, rules = make_mesh(mc, devices), mc.rules
        bs = batch_sharding(mesh, rules)
        out = {}
        plan = plan_train_state(target_cfg, tx, 0, mesh, rules)
        step = jit_train_step(plan.graphdef, tx, schedule, plan.shardings, bs, mesh)
        lm_batch = {k: jax.device_put(host_batch[k], bs) for k in ('tokens', 'positions',
                                                                      'segment_ids')}
        state, ms = plan.init(), []
        for _ in range(STEPS):
            state, m = step(state, lm_batch)
            ms.append(m)
        out['train'] = (state, ms)

        dplan = plan_train_state(draft_cfg, tx, 1, mesh, rules)
        t_sh = param_shardings(mesh, teacher_params, rules)
        dstep = jit_distill_step(dplan.graphdef, plan.graphdef, tx, schedule, loss,
                                 dplan.shardings, t_sh, bs, mesh)
        batch = {k: jax.device_put(v, bs) for k, v in host_batch.items()}
        teacher = jax.device_put(teacher_params, t_sh)
        state, ms = dplan.init(), []
        for _ in range(STEPS):
            state, m = dstep(state, teacher, batch)
            ms.append(m)
        out['distill'] = (state, ms)

        tgd, dgd, c_sh, _, c_init = plan_cotrain_state(target_cfg, draft_cfg, tx, 2, mesh, rules)
        cstep = jit_cotrain_step(tgd, dgd, tx, schedule, loss, c_sh, bs, mesh)
        state, ms = c_init(), []
        for _ in range(STEPS):
            state, m = cstep(state, lm_batch)
            ms.append(m)
        out['cotrain'] = (state, ms)
        return out

    def leaves(tree):
        return jax.tree_util.tree_flatten_with_path(tree)[0]

    def named(tree, *parts):
        hits = [x for p, x in leaves(tree) if all(s in jax.tree_util.keystr(p) for s in parts)]
        assert hits, parts
        return hits

    def check_layout(shape, state, where):
        dp, fsdp, tp = shape
        emb, = named(state.params, "'embed'")
        assert emb.sharding.spec == P('tensor', 'fsdp'), (where, emb.sharding.spec)
        assert emb.addressable_shards[0].data.shape == (V // tp, 32 // fsdp), where
        for moment in named(state.opt_state, 'mu', "'embed'") + named(state.opt_state, 'nu',
                                                                       "'embed'"):
            assert moment.sharding.spec == emb.sharding.spec, (where, moment.sharding.spec)
            assert moment.addressable_shards[0].data.shape == (V // tp, 32 // fsdp), where
        mlp = [x for x in named(state.params, "'blocks'") if x.ndim == 2 and 64 in x.shape]
        assert mlp, where
        for w in mlp:
            axis = w.shape.index(64)
            assert w.sharding.spec[axis] == 'tensor', (where, w.shape, w.sharding.spec)
            assert w.addressable_shards[0].data.shape[axis] == 64 // tp, where
        assert len(emb.sharding.device_set) == 8, where

    t0 = time.perf_counter()
    ref = run((1, 1, 1), jax.devices()[:1])
    for shape in ((8, 1, 1), (2, 2, 2), (1, 2, 4)):
        got = run(shape, jax.devices())
        for name in ('train', 'distill', 'cotrain'):
            (s_ref, m_ref), (s_got, m_got) = ref[name], got[name]
            check_layout(shape, s_got, (name, shape))
            if name == 'cotrain':
                check_layout(shape, type('D', (), dict(params=s_got.draft_params,
                                                      opt_state=s_got.draft_opt_state)),
                             ('cotrain draft', shape))
            for a, b in zip(m_ref, m_got, strict=True):
                assert a.keys() == b.keys()
                for k in a:
                    np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), rtol=2e-5,
                                               atol=2e-6, err_msg=f'{name} {shape} metric {k}')
            for (p, a), (_, b) in zip(leaves(s_ref), leaves(s_got), strict=True):
                # atol: 1% of one step's lr (Adam normalises, so float noise in a near-zero
                # gradient moves a weight by up to ~lr; a wrong layout moves many by ~lr).
                np.testing.assert_allclose(
                    np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5,
                    err_msg=f'{name} {shape} {jax.tree_util.keystr(p)}')
        print('MESH_OK', shape, round(time.perf_counter() - t0, 1), flush=True)
    print('ALL_MESH_OK')
    """
)


def test_train_distill_cotrain_steps_on_8_device_meshes_equal_one_device():
    env = dict(
        os.environ,
        XLA_FLAGS='--xla_force_host_platform_device_count=8',
        JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,  # conftest's cache
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0.2',
    )
    out = subprocess.run(
        [sys.executable, '-c', _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert 'ALL_MESH_OK' in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
