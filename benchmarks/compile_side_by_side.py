r"""Benchmark (not a test): XLA compiles one after another against side by side in threads.

  python -m benchmarks.compile_side_by_side [--shape=smollm2] [--programs=3] [--repeats=3]

Lowers --programs one-token cached decode programs of one --shape model (specjax.models.presets
.TARGETS; each at another batch size, so each is a distinct program; --vocab_size, capacity
--capacity) and compiles them one after another and side by side
(specjax.sampling.aot.compile_lowered), alternating which goes first, with the persistent
compilation cache off. Each figure is the minimum over --repeats of the group's wall seconds
(and this process's CPU seconds); side by side is what spec_eval, serve and calibration do.
Prints a table and one JSON line (also written to --out).
"""

from __future__ import annotations

import json
import resource
import time

import jax
import jax.numpy as jnp

from benchmarks import cli
from specjax import jsonio
from specjax.models.presets import TARGETS


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _lowered(cfg, batch_size: int, capacity: int):
    from specjax.models import abstract_model, apply_cached, init_cache

    graphdef, params = abstract_model(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch_size, capacity))
    tokens = jax.ShapeDtypeStruct((batch_size, 1), jnp.int32)
    fn = jax.jit(lambda p, t, n, c: apply_cached(graphdef, p, t, n, c))
    return fn.lower(params, tokens, cache.lengths, cache)


def main(argv=None):
    p = cli.parser(__doc__, out='', repeats=3)
    p.add_argument('--shape', default='smollm2', choices=tuple(TARGETS))
    p.add_argument('--vocab_size', type=int, default=49152)
    p.add_argument('--capacity', type=int, default=128)
    p.add_argument('--programs', type=int, default=3)
    args = p.parse_args(argv)
    jax.config.update('jax_enable_compilation_cache', False)

    from specjax.models import TransformerConfig
    from specjax.sampling import aot

    cfg = TransformerConfig(
        vocab_size=args.vocab_size, max_len=args.capacity, **TARGETS[args.shape]
    )
    _lowered(cfg, 64, args.capacity).compile()  # warm-up: XLA's one-off costs
    batch = 1
    best = {m: {'wall_s': float('inf'), 'cpu_s': float('inf')} for m in ('one_by_one', 'side')}
    for r in range(args.repeats):
        for mode in ('one_by_one', 'side') if r % 2 == 0 else ('side', 'one_by_one'):
            lowered = [_lowered(cfg, batch + i, args.capacity) for i in range(args.programs)]
            batch += args.programs  # fresh programs every time: nothing comes from a cache
            t0, c0 = time.perf_counter(), _cpu_s()
            if mode == 'side':
                aot.compile_lowered(lowered)
            else:
                for program in lowered:
                    program.compile()
            figures = {'wall_s': time.perf_counter() - t0, 'cpu_s': _cpu_s() - c0}
            for k, v in figures.items():
                best[mode][k] = min(best[mode][k], v)
    ratio = best['one_by_one']['wall_s'] / best['side']['wall_s']
    print(f'{"":12}{"wall s":>8}{"CPU s":>8}')
    for mode, f in best.items():
        print(f'{mode:12}{f["wall_s"]:8.2f}{f["cpu_s"]:8.2f}')
    print(f'one by one / side by side, wall: {ratio:.2f}')
    out = {'args': vars(args), 'threads': aot.COMPILE_THREADS, **best, 'ratio_wall': ratio}
    print(json.dumps(out))
    if args.out:
        jsonio.write_json(args.out, out)


if __name__ == '__main__':
    main()
