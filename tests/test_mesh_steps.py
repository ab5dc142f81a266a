"""The LM train, distill and co-train steps on 8 simulated devices equal one device.

One subprocess (XLA_FLAGS forces 8 host devices) runs each step a few times on meshes (2,2,2)
and (1,2,4) (data x fsdp x tensor; together they split every axis, and (2,2,2) all three at
once) with the default rules, and compares params, Adam moments and metrics with the same steps
on a 1-device mesh (highest matmul precision). It also checks the layout: the state comes out
sharded as the rules say (specs and per-device shard shapes of the embedding, an MLP weight
and their Adam moments).
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

    # Samplers: target FSDP + tensor parallel, a 2-kv-head draft replicated by draft_rules.
    from specjax.models import apply
    from specjax.sampling import (SamplingConfig, make_autoregressive_fn, make_speculative_fn,
                                  make_tree_speculative_fn)
    s_target = TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4,
                                 d_ff=64, max_len=32)
    s_draft = TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                                d_ff=64, max_len=32)
    t_gd, t_params = split(Transformer(s_target, rngs=nnx.Rngs(3)))
    d_gd, d_params = split(Transformer(s_draft, rngs=nnx.Rngs(4)))
    t_params = jax.tree.map(lambda x: x * 8 if x.ndim == 2 else x, t_params)  # sharp logits,
    d_params['embed'] = split(Transformer(s_target, rngs=nnx.Rngs(3)))[1]['embed']  # ~40% agree
    SB, SP, NEW, K = 8, 5, 8, 3
    s_prompts = rng.integers(1, V, (SB, SP)).astype(np.int32)
    s_lengths = np.array([5, 1, 3, 2, 5, 4, 1, 3], np.int32)
    GREEDY, T1 = SamplingConfig(0.0), SamplingConfig(1.0)
    TREE = ((0,), (1,), (0, 0), (0, 1))

    def sample(shape, devices, aot=False, tree=False):
        mc = default_mesh_config()
        mc.shape = shape
        mesh = make_mesh(mc, devices)
        kw = dict(max_new_tokens=NEW, mesh=mesh, rules=mc.rules)
        dr = dict(draft_rules='data_parallel')
        ar = make_autoregressive_fn(t_gd, sampling=GREEDY, **kw)
        fns = dict(
            ar=(ar, [t_params]),
            greedy=(make_speculative_fn(t_gd, d_gd, num_draft_tokens=K, sampling=GREEDY, **kw,
                                        **dr), [t_params, d_params]),
            t1=(make_speculative_fn(t_gd, d_gd, num_draft_tokens=K, sampling=T1, **kw, **dr),
                [t_params, d_params]),
        )
        if tree:
            fns['tree_t1'] = (make_tree_speculative_fn(t_gd, d_gd, tree=TREE, sampling=T1, **kw,
                                                       **dr), [t_params, d_params])
        out = {}
        for name, (fn, params) in fns.items():
            args = (*params, s_prompts, s_lengths, jax.random.key(5))
            if aot and name == 'greedy':  # the compiled program's cache layout, per device
                placed = fn.place(args)
                compiled = fn.lower(*args).compile()
                res = compiled(*placed)
                out['hlo'] = compiled.as_text()
                out['placed'] = placed
            else:
                res = fn(*args)
            out[name] = res
        return out, mesh, fns

    def top2_margin(prefix):
        logits = apply(t_gd, t_params, jnp.asarray([prefix], jnp.int32))
        top2 = np.sort(np.asarray(logits)[0, -1])[-2:]
        return top2[1] - top2[0]

    def same_greedy(a, b, where):
        a, b = np.asarray(a.tokens), np.asarray(b.tokens)
        for row in range(SB):
            diff = np.flatnonzero(a[row] != b[row])
            if len(diff):  # only a near tie of the target may flip an argmax
                prefix = [*s_prompts[row, :s_lengths[row]], *b[row, :diff[0]]]
                assert top2_margin(prefix) < 1e-4, (where, row, a[row], b[row])

    def check_sampler_layout(shape, out, mesh):
        dp, fsdp, tp = shape
        tp_params, dp_params = out['placed'][0], out['placed'][1]
        assert tp_params['embed'][...].sharding.spec == P('tensor', 'fsdp'), shape
        for leaf in jax.tree.leaves(dp_params):  # the draft: replicated by draft_rules
            assert leaf.sharding.is_fully_replicated, (shape, leaf.sharding)
        rows_sharding = jax.sharding.NamedSharding(mesh, P(('data', 'fsdp')))
        tokens = out['greedy'].tokens
        assert tokens.sharding.is_equivalent_to(rows_sharding, 2), (shape, tokens.sharding)
        assert out['greedy'].stats['accepted'].sharding.is_fully_replicated, shape
        hlo, cap = out['hlo'], SP + NEW + K + 1
        rows = SB // (dp * fsdp)
        # keys [B, K, C, D], values [B, K, D, C] (specjax.models.kv_cache), kv heads over tp
        assert f'f32[{rows},{4 // tp},{cap},8]' in hlo, (shape, 'target keys')
        assert f'f32[{rows},{4 // tp},8,{cap}]' in hlo, (shape, 'target values')
        assert f'f32[{rows},2,{cap},16]' in hlo, (shape, 'draft keys')  # draft: batch only
        for whole in (f'f32[{SB},4,{cap},8]', f'f32[{SB},4,8,{cap}]', f'f32[{SB},2,{cap},16]'):
            assert whole not in hlo, (shape, 'an unsharded cache', whole)

    t0 = time.perf_counter()
    ref = run((1, 1, 1), jax.devices()[:1])
    s_ref, _, _ = sample((1, 1, 1), jax.devices()[:1], tree=True)
    acc = [int(s_ref['greedy'].stats[k]) for k in ('accepted', 'examined')]
    assert 0 < acc[0] < acc[1], acc
    same_greedy(s_ref['greedy'], s_ref['ar'], 'speculative vs autoregressive, 1 device')
    for shape in ((2, 2, 2), (1, 2, 4)):
        got = run(shape, jax.devices())
        for name in ('train', 'distill', 'cotrain'):
            (s_ref_, m_ref), (s_got, m_got) = ref[name], got[name]
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
            for (p, a), (_, b) in zip(leaves(s_ref_), leaves(s_got), strict=True):
                # atol: 1% of one step's lr (Adam normalises, so float noise in a near-zero
                # gradient moves a weight by up to ~lr; a wrong layout moves many by ~lr).
                np.testing.assert_allclose(
                    np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5,
                    err_msg=f'{name} {shape} {jax.tree_util.keystr(p)}')
        print('MESH_OK', shape, round(time.perf_counter() - t0, 1), flush=True)
        s_got, mesh, fns = sample(shape, jax.devices(), aot=True, tree=shape == (2, 2, 2))
        check_sampler_layout(shape, s_got, mesh)
        for name in ('ar', 'greedy'):
            same_greedy(s_got[name], s_ref[name], (name, shape))
            np.testing.assert_array_equal(s_got[name].lengths, s_ref[name].lengths)
        for name in [n for n in ('t1', 'tree_t1') if n in s_got]:  # same key: same tokens
            np.testing.assert_array_equal(s_got[name].tokens, s_ref[name].tokens, (name, shape))
            for k in ('accepted', 'examined', 'batch_rounds'):
                assert int(s_got[name].stats[k]) == int(s_ref[name].stats[k]), (name, shape, k)
        print('SAMPLE_OK', shape, round(time.perf_counter() - t0, 1), flush=True)

    # Bad layouts fail on the host, before compiling, naming the field and value.
    mc = default_mesh_config()
    mc.shape = (1, 2, 4)
    mesh = make_mesh(mc)
    args = (t_params, d_params, s_prompts, s_lengths, 0)
    fn = make_speculative_fn(t_gd, d_gd, num_draft_tokens=K, max_new_tokens=NEW,
                             sampling=GREEDY, mesh=mesh, rules=mc.rules)
    for bad, match in (
        (args, 'draft TransformerConfig.n_heads=2 does not divide over mesh axes tensor'),
        ((t_params, d_params, s_prompts[:3], s_lengths[:3], 0), 'global batch size B=3'),
    ):
        try:
            fn.place(bad)
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(match)
    print('ALL_MESH_OK', round(time.perf_counter() - t0, 1))
    """
)


def test_train_distill_cotrain_steps_on_8_device_meshes_equal_one_device():
    env = dict(
        os.environ,
        # 8 host devices, added to conftest's flags (no LLVM optimisation passes)
        XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count=8',
        JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,  # conftest's cache
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0.2',
    )
    out = subprocess.run(
        [sys.executable, '-c', _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert 'ALL_MESH_OK' in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    # The embedding gradient on (2, 2, 2) no longer needs its cotangent gathered whole (checked
    # where the steps compile; a persistent-cache hit skips XLA's partitioner and its warnings).
    assert 'Involuntary full rematerialization' not in out.stderr, out.stderr[-4000:]
