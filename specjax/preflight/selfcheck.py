r"""A multi-process self-check: tiny sharded runs whose results must not depend on process count.

  launch/local_multiprocess.sh 2 2 -- --workdir=/tmp/selfcheck      # SPECJAX_MODULE=this module
  python -m specjax.preflight.selfcheck --workdir=/tmp/selfcheck_1   # one process, same devices

On every process: jax.distributed start-up (specjax.parallel.distributed), a mesh over all global
devices, then with tiny random models (identical on every process, placed by the rules):
two LM train steps, a distill step on teacher-generated continuations of this process's own
prompt rows, a T = 1 speculative sampling call on host-local prompts (a replicated draft via
draft rules), and an orbax checkpoint save + restore (collective). Process 0 alone writes
results.json (losses, tokens, checksums) and arrays.npz; the tests run it on 2 processes x 2
CPU devices and on 1 process x 4 devices and compare. On a real slice it checks that
collectives, sharded steps and checkpointing work before a long run is launched.
"""

from __future__ import annotations

import argparse
import logging

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from specjax.parallel.distributed import (
    barrier,
    host_rows,
    initialize_from_env,
    is_main_process,
    to_host,
)

V, B, T, PROMPT, NEW, K = 64, 8, 12, 4, 6, 3  # vocab, global batch, seq, prompt, new tokens, k


def _progress(stage: str) -> None:
    logging.info('selfcheck: %s', stage)


def compiled(fn, *args):
    """fn's executable for args, compiled on every process before any of them runs it.

    gloo sets up each new group of devices lazily, at a program's first collective, and gives
    up after 30 s: a process still compiling (a loaded machine) must not make the others wait.
    """
    executable = fn.lower(*args).compile()
    barrier('selfcheck compiled')
    return executable


def run(workdir: str, mesh_shape) -> dict:
    """Every check in one function, on purpose (it is over 80 lines): each process must issue
    the same device programs in the same order, and every array and compiled step it makes stays
    alive to the end. Split into helpers that returned early, the two-process run deadlocked in
    the checkpoint save's finiteness check (tests/test_multiprocess.py timed out); kept whole."""
    from specjax.checkpoint import Checkpoints, abstract_with_shardings
    from specjax.distill.sources import Generator
    from specjax.distill.steps import LossSettings, jit_distill_step
    from specjax.models import Transformer, TransformerConfig, split
    from specjax.parallel import batch_sharding, default_mesh_config, make_mesh, param_shardings
    from specjax.parallel.mesh import mesh_rules
    from specjax.sampling import SamplingConfig, make_autoregressive_fn, make_speculative_fn
    from specjax.train.config import default_train_config
    from specjax.train.optimizer import learning_rate_schedule, make_optimizer
    from specjax.train.state import plan_train_state
    from specjax.train.steps import jit_train_step
    from specjax.workdir import write_results

    jax.config.update('jax_default_matmul_precision', 'highest')
    mc = default_mesh_config(draft_rules='data_parallel')
    mc.shape = tuple(mesh_shape)
    mesh = make_mesh(mc)
    rules, draft_rules = mesh_rules(mc)
    bs = batch_sharding(mesh, rules)
    target_cfg = TransformerConfig(
        vocab_size=V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_len=32
    )
    draft_cfg = TransformerConfig(
        vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_len=32
    )
    tc = default_train_config()
    tc.update(dict(steps=10, lr=1e-3, warmup_steps=1))
    tx, schedule = make_optimizer(tc), learning_rate_schedule(tc)
    rng = np.random.default_rng(0)  # the same global data on every process; each feeds its rows
    tokens = rng.integers(1, V, (B, T)).astype(np.int32)
    lm = dict(tokens=tokens, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)))
    lm['segment_ids'] = np.ones((B, T), np.int32)
    to_global = lambda x: jax.make_array_from_process_local_data(bs, host_rows(bs, x))
    out = {}

    # Sharded LM train steps.
    plan = plan_train_state(target_cfg, tx, 0, mesh, rules)
    step = jit_train_step(plan.graphdef, tx, schedule, plan.shardings, bs, mesh)
    state, losses = plan.init(), []
    lm_global = {k: to_global(v) for k, v in lm.items()}
    step = compiled(step, state, lm_global)
    for _ in range(3):  # the first step's learning rate is 0 (warm-up)
        state, metrics = step(state, lm_global)
        losses.append(float(metrics['loss']))
    out['train_loss'] = losses

    _progress('# A distill step on teacher')
    # A distill step on teacher-generated continuations of this process's prompt rows.
    teacher_gd, teacher = split(Transformer(target_cfg, rngs=nnx.Rngs(7)))
    t_sh = param_shardings(mesh, teacher, rules)
    teacher = jax.device_put(teacher, t_sh)
    dplan = plan_train_state(draft_cfg, tx, 1, mesh, draft_rules)
    dstep = jit_distill_step(
        dplan.graphdef, teacher_gd, tx, schedule, LossSettings(divergence='fkl'),
        dplan.shardings, t_sh, bs, mesh,
    )  # fmt: skip
    gen = Generator(teacher_gd, PROMPT, NEW, SamplingConfig(1.0), None, mesh, rules, bs)
    host = {k: host_rows(bs, v) for k, v in lm.items()}
    host['domain_ids'] = np.zeros_like(host['tokens'])
    # The Generator's own (lru-cached) sampler: compiled here, its call hits the persistent cache.
    sampler = make_autoregressive_fn(
        teacher_gd, max_new_tokens=NEW, sampling=SamplingConfig(1.0), mesh=mesh, rules=rules
    )
    compiled(sampler, teacher, *gen.prompts(host)[:2], jax.random.key(3))
    batch = gen(teacher, host, jax.random.key(3))
    batch.pop('domain_ids')
    dstate = dplan.init()
    dstate, dmetrics = compiled(dstep, dstate, teacher, batch)(dstate, teacher, batch)
    out['distill_loss'] = float(dmetrics['loss'])
    generated = to_host(batch['tokens'])

    _progress('# T = 1 speculative sampling')
    # T = 1 speculative sampling on host-local prompts; the draft replicated by draft_rules.
    _, draft = split(Transformer(draft_cfg, rngs=nnx.Rngs(8)))
    fn = make_speculative_fn(
        teacher_gd, dplan.graphdef, num_draft_tokens=K, max_new_tokens=NEW,
        sampling=SamplingConfig(1.0), mesh=mesh, rules=rules, draft_rules=draft_rules,
    )  # fmt: skip
    lengths = np.array([4, 1, 3, 2, 4, 4, 1, 3], np.int32)
    args = (teacher, draft, host_rows(bs, tokens[:, :PROMPT]), host_rows(bs, lengths), 5)
    res = compiled(fn, *args)(*fn.place(args))
    sampled = to_host(res.tokens)
    out['spec_accepted'] = int(res.stats['accepted'])
    out['spec_lengths'] = to_host(res.lengths).tolist()

    _progress('# spec_eval and distillation evaluation')
    placed_draft = jax.device_put(draft, param_shardings(mesh, draft, draft_rules))
    pair = (teacher_gd, teacher, dplan.graphdef, placed_draft)
    out.update(pair_evaluations(*pair, mesh, rules, draft_rules, bs, lm))

    _progress('# Orbax save and restore')
    # Orbax save and restore, collectively, of the sharded train state.
    ckpts = Checkpoints(str(epath.Path(workdir) / 'ckpt'), async_save=False)
    ckpts.save(3, state, data_state={'step': 3}, metadata={'selfcheck': True})
    _progress('ckpts.wait')
    ckpts.wait()
    abstract = abstract_with_shardings(plan.abstract, plan.shardings)
    _progress('restored, data_state, _ = ckpt')
    restored, data_state, _ = ckpts.restore(abstract)
    _progress('ckpts.close')
    ckpts.close()
    # Per process, its own shards (no device collective per leaf), then one gather of the flags.
    local = [
        all(
            np.array_equal(x.data, y.data)
            for x, y in zip(a.addressable_shards, b.addressable_shards)
        )
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True)
    ]
    flags = multihost_utils.process_allgather(np.asarray([all(local)]))
    out['restore_equal'] = bool(np.all(flags))
    out['restored_sharding_equal'] = all(
        a.sharding == b.sharding for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored))
    )
    out['restored_step'] = int(data_state['step'])

    _progress('params = gather')
    params = to_host(state.params)
    draft_params = to_host(dstate.params)
    out['process_count'] = jax.process_count()
    out['device_count'] = jax.device_count()
    out['written_by'] = jax.process_index()
    _progress('write_results')
    write_results(workdir, 'selfcheck', out, mc)
    if is_main_process():
        flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
        dflat = jax.tree_util.tree_leaves_with_path(draft_params)
        flat.update({'draft' + jax.tree_util.keystr(p): v for p, v in dflat})
        with (epath.Path(workdir) / 'arrays.npz').open('wb') as f:  # gs:// too
            np.savez(f, generated=generated, sampled=sampled, **flat)
    barrier('selfcheck done')
    return out


def pair_evaluations(target_gd, target, draft_gd, draft, mesh, rules, draft_rules, bs, lm):
    """spec_eval's per-sampling evaluation (autoregressive and speculative decoding of host-global
    prompts, a padded last batch, alpha re-scored from the target's samples, the row table) and
    distillation's Evaluator (held-out loss and alpha, alpha on generated continuations,
    measured acceptance and tau) on this process's rows; the figures that must not depend on
    the process count (timings do: a fixed calibration stands in for measured c and v(k))."""
    import ml_collections

    from specjax.distill.evaluation import Evaluator
    from specjax.evaluation import spec_eval_sampling
    from specjax.evaluation.prompts import Prompts
    from specjax.models import merge
    from specjax.sampling import SamplingConfig
    from specjax.sampling import stats as st
    from specjax.sampling.calibrate import Calibration

    rng = np.random.default_rng(1)
    n = B + 3  # two batches, the last padded
    lengths = rng.integers(1, PROMPT + 1, n).astype(np.int32)
    tokens = rng.integers(1, V, (n, PROMPT)) * (np.arange(PROMPT)[None] < lengths[:, None])
    domains = np.array(['a', 'b', 'c'])[np.arange(n) % 3]
    prompts = Prompts(tokens.astype(np.int32), lengths, domains, np.arange(n))
    ev = ml_collections.ConfigDict(
        dict(batch_size=B, max_new_tokens=NEW, timing_repeats=1, acceptance='probabilistic')
    )
    ev.prompt_len_edges, ev.gen_len_edges = (2,), (4,)
    cal = Calibration(B, PROMPT, 32, 1.0, 0.25, {K: 1.5})
    models = (merge(target_gd, target), merge(draft_gd, draft), target_gd, draft_gd)
    runs, buckets, optimal = spec_eval_sampling.evaluate_sampling(
        (*models, target, draft, None), prompts, SamplingConfig(1.0), (K,), cal, ev, seed=11,
        eos_id=None, mesh=mesh, rules=rules, draft_rules=draft_rules,
    )  # fmt: skip
    ar, spec = runs
    names = ('acceptance_rate', 'block_efficiency', 'alpha', 'predicted_speedup')
    out = {'spec_eval': {name: spec[name] for name in (*names, *st.COUNT_FIELDS)}}
    out['spec_eval'].update(
        ar_alpha=ar['alpha'], ar_tokens=ar['generated_tokens'], tokens=spec['generated_tokens'],
        buckets=len(buckets['all']), optimal_k=optimal['predicted_optimal_k'],
    )  # fmt: skip

    d = ml_collections.ConfigDict(
        dict(prompt_len=PROMPT, max_new_tokens=NEW, eval_temperatures=(1.0,), eval_ks=(2,))
    )
    d.update(dict(eval_generate_batches=1, final_spec_k=K, final_spec_batches=1, calibrate=False))
    host = {k: host_rows(bs, v) for k, v in lm.items()}
    host['domain_ids'] = host_rows(bs, np.arange(B * T, dtype=np.int32).reshape(B, T) // T % 2)
    evaluator = Evaluator(
        draft_gd, target_gd, eval_batches=[host], domains=('a', 'b'), distill_cfg=d,
        sampling=SamplingConfig(1.0), eos_id=None, mesh=mesh, rules=rules, batch_sharding=bs,
        seed=5, draft_rules=draft_rules,
    )  # fmt: skip
    out['distill_eval'] = dict(evaluator(draft, target), **evaluator.speculative(draft, target))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--workdir', required=True)
    parser.add_argument('--mesh_shape', default='2,1,2', help='data,fsdp,tensor (-1 = the rest)')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
    initialize_from_env()
    out = run(args.workdir, [int(s) for s in args.mesh_shape.split(',')])
    if is_main_process():
        print('SELFCHECK_OK', out, flush=True)


if __name__ == '__main__':
    main()
