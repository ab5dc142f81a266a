r"""What a verification call costs on SmolLM2-135M at batch 1: v(k) with the 1-token call as unit.

Times SmolLM2's cached call for 1 and k + 1 new tokens (every --ks) at a fixed cache position
(specjax.sampling.calibrate: each call inside one jitted fori_loop, all programs timed
round-robin in this process, medians of per-repeat ratios), and counts in each compiled call the
copy and transpose ops by kind: copies of the KV cache (per layer) and of weight-shaped arrays are
work a verification should not do. Prints one table; writes JSON (--out).

  python -m benchmarks.verify_cost                      # ~2 minutes
  python -m benchmarks.verify_cost --ks=1,2,4,8,12,16 --context=64 --capacity=256
"""

from __future__ import annotations

import collections
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cli
from specjax import jsonio


def parser():
    p = cli.parser(__doc__, out='/tmp/specjax/verify_cost.json', compilation_cache=True)
    p.add_argument('--ks', default='1,2,4,8,12', type=cli.ints, help='proposals k: k+1 tokens')
    p.add_argument('--context', default=64, type=int, help='tokens already in the cache')
    p.add_argument('--capacity', default=256, type=int, help='KV cache capacity')
    p.add_argument('--iters', default=8, type=int, help='calls per timed loop')
    p.add_argument('--repeats', default=7, type=int, help='timed repeats (round-robin)')
    return p


OP = re.compile(r'= (\w+)\[([^\]]*)\](?:\{[^}]*\})? (copy|transpose)\(')


def copy_ops(hlo_text: str, weight_shapes: set, cache_shape: tuple) -> dict:
    """Counts of copy/transpose ops in compiled HLO text: of weight shape, of one layer's KV
    cache shape (any axis order), and the rest."""
    counts = collections.Counter()
    cache_sorted = tuple(sorted(cache_shape))
    for _dtype, dims, op in OP.findall(hlo_text):
        shape = tuple(int(x) for x in dims.split(',') if x)
        if shape in weight_shapes:
            counts[f'{op} of a weight'] += 1
        elif tuple(sorted(shape)) == cache_sorted and len(shape) == len(cache_shape):
            counts[f'{op} of a KV cache layer'] += 1
        elif np.prod(shape or (1,)) > 1:
            counts[f'{op}, other'] += 1
    return dict(counts)


def main(argv=None):
    args = parser().parse_args(argv)
    cli.setup_cache(args)
    from specjax.interop.gguf import import_gguf
    from specjax.interop.workdir import bundled_path
    from specjax.models import DECODE_COMPILER_OPTIONS, apply_cached, init_cache, split
    from specjax.sampling import NGramDraft
    from specjax.sampling.calibrate import calibrate

    started = time.perf_counter()
    target, _ = import_gguf(bundled_path('smollm2-135m'))
    cal = calibrate(
        target, NGramDraft(), batch_size=1, ks=args.ks, context_len=args.context,
        capacity=args.capacity, iters=args.iters, repeats=args.repeats,
    )  # fmt: skip
    tgd, tparams = split(target)
    cfg = target.config
    weights = {tuple(x.shape) for x in jax.tree.leaves(tparams) if x.ndim >= 2}
    cache_shape = (1, args.capacity, cfg.n_kv_heads, cfg.head_dim)
    call = jax.jit(
        lambda p, t, c: apply_cached(tgd, p, t, jnp.zeros((1,), jnp.int32), c),
        donate_argnums=2,
        compiler_options=DECODE_COMPILER_OPTIONS,
    )
    ops = {}
    for k in (0, *args.ks):
        cache = init_cache(cfg, 1, args.capacity, lengths=jnp.array([args.context], jnp.int32))
        text = call.lower(tparams, jnp.ones((1, k + 1), jnp.int32), cache).compile().as_text()
        ops[k + 1] = copy_ops(text, weights, cache_shape)
    rows = [dict(tokens=1, ms=1e3 * cal.target_step_s, v=1.0, ops=ops[1])]
    for k in args.ks:
        rows.append(dict(tokens=k + 1, ms=1e3 * cal.verify_s[k], v=cal.v[k], ops=ops[k + 1]))
    print('| new tokens | ms per call | v (1-token call = 1) | copies / transposes |')
    print('|---|---|---|---|')
    for r in rows:
        text = ', '.join(f'{n} {name}' for name, n in sorted(r['ops'].items())) or 'none'
        print(f'| {r["tokens"]} | {r["ms"]:.1f} | {r["v"]:.2f} | {text} |')
    result = dict(
        model='SmolLM2-135M-Instruct (float32)', batch=1, context=args.context,
        capacity=args.capacity, iters=args.iters, repeats=args.repeats, rows=rows,
        xla_flags=os.environ.get('XLA_FLAGS', ''), wall_s=time.perf_counter() - started,
    )  # fmt: skip
    jsonio.write_json(args.out, result)
    print(f'wrote {args.out} ({result["wall_s"]:.0f} s)')
    return result


if __name__ == '__main__':
    main()
