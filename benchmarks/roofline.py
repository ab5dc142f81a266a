"""Memory-bandwidth roofline for decoding (not a test): how close a decode rate is to the limit.

  python -m benchmarks.roofline [--out=PATH] [--mib=512] [--repeats=5]

At small batch one decode step reads every weight once, so a step cannot take less than
weight bytes / memory bandwidth. `bandwidth()` measures the bandwidth an XLA reduction reaches on
this machine's default device (the sum of a float32 array far larger than the caches, minimum
over repeats); `fraction(step_tokens_per_s, batch, weight_bytes, bytes_per_s)` is the share of
that roofline a decoder reaches: steps per second x weight bytes / bandwidth (1.0 = at the
limit; KV-cache reads and activations come on top, so a well-tuned decoder at batch 1 sits
somewhat below 1). Other benchmarks (benchmarks.sampling) print it beside their tokens/s, so the
same command tells a GPU or TPU user how close to the limit they are.
"""

from __future__ import annotations

import time

from benchmarks import cli
from specjax import jsonio

_CACHE: dict[tuple, float] = {}


def bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a jitted float32 sum over `mib` MiB on the default device: the
    minimum time over `repeats` calls after one warm-up (memoised per size and repeats)."""
    key = (int(mib), int(repeats))
    if key in _CACHE:
        return _CACHE[key]
    import jax
    import jax.numpy as jnp

    n = int(mib) * 2**20 // 4
    x = jax.device_put(jnp.ones((n,), jnp.float32))
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()  # compile and warm up
    best = float('inf')
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    _CACHE[key] = n * 4 / best
    return _CACHE[key]


def weight_bytes(params) -> int:
    """Bytes of every array leaf of a parameter pytree (what one decode step reads)."""
    import jax

    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params)))


def fraction(step_tokens_per_s: float, batch: int, weight_bytes_: int, bytes_per_s: float):
    """Share of the weight-read roofline a decoder reaches: (tokens/s / batch) steps per second,
    each reading `weight_bytes_`, over the measured bandwidth."""
    return step_tokens_per_s / batch * weight_bytes_ / bytes_per_s


def run(args) -> dict:
    import jax

    bw = bandwidth(args.mib, args.repeats)
    result = {
        'bandwidth_bytes_per_s': bw,
        'array_mib': args.mib,
        'repeats': args.repeats,
        'device': str(jax.devices()[0]),
    }
    jsonio.write_json(args.out, result)
    print(f'measured memory bandwidth: {bw / 1e9:.1f} GB/s ({args.mib} MiB float32 sum, min of '
          f'{args.repeats}) on {result["device"]}; wrote {args.out}')  # fmt: skip
    return result


def parser():
    p = cli.parser(__doc__, out='/tmp/specjax/bench_roofline.json', repeats=5)
    p.add_argument('--mib', default=512, type=int, help='size of the summed array')
    return p


def main(argv=None):
    return run(parser().parse_args(argv))


if __name__ == '__main__':
    main()
