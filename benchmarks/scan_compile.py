r"""Benchmark (not a test): compile time of scanned (scan_layers) vs unrolled blocks.

  python -m benchmarks.scan_compile [--layers=12] [--d_model=256] [--repeats=2] [--out=PATH]
  python -m benchmarks.scan_compile --shape=smollm2 --vocab_size=49152 --decode_only \
      --decode_batch=4 --capacity=1024

For each layout of one randomly initialised model (--shape: a specjax.models.presets.TARGETS
shape instead of --layers/--d_model): seconds to trace + lower and to XLA-compile the LM train
step (forward, backward, AdamW; specjax.train.steps.jit_train_step, state donated; skipped with
--decode_only) and the one-token cached decode call at --decode_batch rows and --capacity
positions, then their run times (medians of --steps train steps and 10 x --steps decode calls at
half capacity, after a warm-up). The persistent compilation cache
is off, a warm-up compile comes first, the layouts alternate in order and each compile figure is
the minimum over --repeats, so load from other processes inflates both alike; report the
unrolled/scanned ratios. Prints a table and one JSON line (also written to --out).
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cli
from specjax import jsonio
from specjax.models.presets import TARGETS


def _time(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _train_step(cfg, batch_size, seq_len):
    """(lower seconds, compile seconds, compiled step, plan, batch) of a fresh jit."""
    from specjax.parallel import DEFAULT_RULES, batch_sharding, default_mesh_config, make_mesh
    from specjax.train.config import default_train_config
    from specjax.train.optimizer import learning_rate_schedule, make_optimizer
    from specjax.train.state import plan_train_state
    from specjax.train.steps import BATCH_KEYS, jit_train_step

    mesh = make_mesh(default_mesh_config(), jax.devices()[:1])
    train = default_train_config()
    tx = make_optimizer(train)
    plan = plan_train_state(cfg, tx, 0, mesh, DEFAULT_RULES)
    bs = batch_sharding(mesh, DEFAULT_RULES)
    step = jit_train_step(
        plan.graphdef, tx, learning_rate_schedule(train), plan.shardings, bs, mesh
    )
    shape = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=bs)
    abstract_batch = {k: shape for k in BATCH_KEYS}
    lower_s, lowered = _time(lambda: step.lower(plan.abstract, abstract_batch))
    compile_s, compiled = _time(lowered.compile)
    return lower_s, compile_s, compiled, plan, abstract_batch


def _decode(cfg, batch_size, capacity):
    from flax import nnx

    from specjax.models import Transformer, apply_cached, init_cache, split

    graphdef, params = split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: init_cache(cfg, batch_size, capacity))
    tokens = jax.ShapeDtypeStruct((batch_size, 1), jnp.int32)
    fn = jax.jit(lambda p, t, n, c: apply_cached(graphdef, p, t, n, c))
    lower_s, lowered = _time(lambda: fn.lower(params, tokens, cache.lengths, cache))
    compile_s, compiled = _time(lowered.compile)
    return lower_s, compile_s, compiled


def _decode_seconds(compiled, cfg, batch_size, capacity, calls):
    """Median seconds of one-token cached calls at half capacity (no tokens kept)."""
    from flax import nnx

    from specjax.models import Transformer, init_cache, split

    _, params = split(Transformer(cfg, rngs=nnx.Rngs(0)))
    cache = init_cache(cfg, batch_size, capacity, lengths=np.full(batch_size, capacity // 2))
    tokens = jnp.ones((batch_size, 1), jnp.int32)
    zeros = jnp.zeros(batch_size, jnp.int32)
    times = []
    for _ in range(calls + 1):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, tokens, zeros, cache))
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _run_seconds(compiled, plan, abstract_batch, steps, vocab):
    state = plan.init()
    tokens = abstract_batch['tokens']
    b, t = tokens.shape
    rows = np.random.default_rng(0).integers(1, vocab, (b, t))
    host = {
        'tokens': rows,
        'segment_ids': np.ones((b, t)),
        'positions': np.broadcast_to(np.arange(t), (b, t)),
        'domain_ids': np.zeros((b, t)),
    }
    batch = {k: jax.device_put(np.asarray(host[k], np.int32), s.sharding)
             for k, s in abstract_batch.items()}  # fmt: skip
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def main(argv=None):
    p = cli.parser(__doc__, out='', repeats=2)  # no --compilation_cache: it is turned off here
    p.add_argument('--layers', type=int, default=12)
    p.add_argument('--d_model', type=int, default=256)
    p.add_argument('--batch_size', type=int, default=4)
    p.add_argument('--seq_len', type=int, default=128)
    p.add_argument('--steps', type=int, default=3)
    p.add_argument('--shape', default='', choices=('', *TARGETS), help='overrides the above')
    p.add_argument('--vocab_size', type=int, default=512)
    p.add_argument('--decode_batch', type=int, default=0, help='0: --batch_size')
    p.add_argument('--capacity', type=int, default=0, help='decode cache; 0: max(seq_len, 64)')
    p.add_argument('--decode_only', action='store_true', help='skip the train step')
    args = p.parse_args(argv)
    jax.config.update('jax_enable_compilation_cache', False)

    from specjax.models import TransformerConfig

    shape = dict(
        d_model=args.d_model, n_layers=args.layers, n_heads=4, n_kv_heads=2, d_ff=4 * args.d_model
    )
    if args.shape:
        shape = TARGETS[args.shape]
    capacity = args.capacity or max(args.seq_len, 64)
    decode_batch = args.decode_batch or args.batch_size
    base = TransformerConfig(
        vocab_size=args.vocab_size, max_len=max(args.seq_len, capacity, 64), **shape
    )
    layouts = {'unrolled': base, 'scanned': dataclasses.replace(base, scan_layers=True)}
    train = not args.decode_only
    keys = ('train_lower_s', 'train_compile_s') * train + ('decode_lower_s', 'decode_compile_s')
    best = {name: dict.fromkeys(keys, float('inf')) for name in layouts}
    # Warm-up: a process's first compile also pays one-off costs (tracing caches, XLA setup).
    if train:
        _train_step(dataclasses.replace(base, n_layers=1), args.batch_size, args.seq_len)
    _decode(dataclasses.replace(base, n_layers=1), decode_batch, capacity)
    compiled = {}
    for r in range(args.repeats):
        for name in sorted(layouts, reverse=bool(r % 2)):  # alternate which layout goes first
            cfg = layouts[name]
            figures, step = (), None
            if train:
                lower_s, compile_s, *step = _train_step(cfg, args.batch_size, args.seq_len)
                figures = (lower_s, compile_s)
            d_lower, d_compile, decode = _decode(cfg, decode_batch, capacity)
            for key, value in zip(keys, (*figures, d_lower, d_compile), strict=True):
                best[name][key] = min(best[name][key], value)
            compiled[name] = (step, decode)
    for name, (step, decode) in compiled.items():
        if train:
            best[name]['train_step_s'] = _run_seconds(*step, args.steps, base.vocab_size)
        best[name]['decode_call_s'] = _decode_seconds(
            decode, layouts[name], decode_batch, capacity, 10 * args.steps
        )
    u, s = best['unrolled'], best['scanned']
    timed = (*keys, 'train_step_s') if train else keys
    timed = (*timed, 'decode_call_s')
    ratios = {k: u[k] / s[k] for k in timed}
    print(f'{"":18}{"unrolled":>10}{"scanned":>10}{"ratio":>8}')
    for k in timed:
        print(f'{k:18}{u[k]:10.3f}{s[k]:10.3f}{ratios[k]:8.2f}')
    out = {'args': vars(args), 'num_params': base.num_params, 'unrolled': u, 'scanned': s,
           'ratio_unrolled_over_scanned': ratios}  # fmt: skip
    print(json.dumps(out))
    if args.out:
        jsonio.write_json(args.out, out)


if __name__ == '__main__':
    main()
