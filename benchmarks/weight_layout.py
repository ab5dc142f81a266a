r"""Whether the weights' layout changes XLA:CPU's small-row products: SmolLM2's block products.

A replica of SmolLM2-135M's per-layer matrix products (q, k, v, o, gate, up, down, between RMS
norms; no attention or cache) over --layers layers of random float32 weights, one jit, applied
to 1, 2, 5 and 9 rows (a decoding step and 1-, 4- and 8-proposal verifications). Two layouts of
the same weights: [in, out] as specjax stores them (`x @ w`), and [out, in] as PyTorch stores
them (both operands contracted on their minor axis). Both programs are timed round-robin in this
process (medians over --repeats rounds of --iters calls); v(w) is a row count's time over the
same layout's 1-row time. The two layouts' outputs are checked equal first. Prints one table;
writes JSON (--out).

  python -m benchmarks.weight_layout            # ~1 minute
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cli

E, Q, KV, F = 576, 9 * 64, 3 * 64, 1536  # SmolLM2-135M: width, q and k/v widths, MLP width
SHAPES = dict(q=(E, Q), k=(E, KV), v=(E, KV), o=(Q, E), gate=(E, F), up=(E, F), down=(F, E))
LAYOUTS = ('in_out', 'out_in')


def parser():
    p = cli.parser(__doc__, out='/tmp/specjax/weight_layout.json', repeats=4)
    p.add_argument('--layers', default=30, type=int, help="layers (SmolLM2's: 30)")
    p.add_argument('--rows', default='1,2,5,9', type=cli.ints, help='rows per call')
    p.add_argument('--iters', default=10, type=int, help='calls per round')
    return p


def blocks(layout: str):
    """jit of (x [w, E], per-layer weight dicts) -> x [w, E] through every layer's products."""
    if layout == 'in_out':
        mm = lambda x, w: x @ w
    else:
        mm = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))

    norm = lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def run(x, layers):  # pre-norm residual blocks, as the model's, so the stream stays finite
        for p in layers:
            h = norm(x)
            kv = mm(h, p['k']) + mm(h, p['v'])
            x = x + mm(mm(h, p['q']) * jnp.tile(kv, (1, Q // KV)), p['o'])
            h = norm(x)
            x = x + mm(jax.nn.silu(mm(h, p['gate'])) * mm(h, p['up']), p['down'])
        return x

    return jax.jit(run)


def main(argv=None):
    args = parser().parse_args(argv)
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    host = [
        {n: (rng.standard_normal(s, np.float32) * 0.02) for n, s in SHAPES.items()}
        for _ in range(args.layers)
    ]
    weights = {
        'in_out': [{n: jnp.asarray(w) for n, w in p.items()} for p in host],
        'out_in': [{n: jnp.asarray(w.T.copy()) for n, w in p.items()} for p in host],
    }
    fns = {layout: blocks(layout) for layout in LAYOUTS}
    times = {(layout, w): [] for layout in LAYOUTS for w in args.rows}
    for w in args.rows:  # compile, and the layouts compute the same thing
        x = jnp.asarray(rng.standard_normal((w, E), np.float32))
        outs = [np.asarray(fns[layout](x, weights[layout])) for layout in LAYOUTS]
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for _ in range(args.repeats):
        for w in args.rows:
            x = jnp.asarray(rng.standard_normal((w, E), np.float32))
            for layout in LAYOUTS:
                ts = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    fns[layout](x, weights[layout]).block_until_ready()
                    ts.append(time.perf_counter() - t0)
                times[layout, w].append(float(np.median(ts)))
    mb = sum(np.prod(s) for s in SHAPES.values()) * 4 * args.layers / 1e6
    rows = []
    for layout in LAYOUTS:
        one = np.median(times[layout, args.rows[0]])
        for w in args.rows:
            ms = 1e3 * float(np.median(times[layout, w]))
            rows.append(dict(layout=layout, rows=w, ms=ms, v=ms / 1e3 / one))
    table = '\n'.join(
        ['| layout | rows | ms per call | v (1 row = 1) |', '|---|---|---|---|']
        + [f'| {r["layout"]} | {r["rows"]} | {r["ms"]:.2f} | {r["v"]:.2f} |' for r in rows]
    )
    result = dict(
        layers=args.layers, weights_mb=mb, iters=args.iters, repeats=args.repeats, rows=rows,
        wall_s=time.perf_counter() - started,
    )  # fmt: skip
    return cli.emit(result, table, args.out)


if __name__ == '__main__':
    main()
