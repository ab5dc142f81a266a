"""Ahead-of-time compiles side by side (specjax.sampling.aot): the same programs as one after
another, and the compile seconds they report."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import aot


def _programs(n: int):
    """n distinct jitted programs and their arguments."""
    x = jnp.arange(12.0).reshape(3, 4)
    fns = [jax.jit(lambda a, i=i: jnp.tanh(a @ a.T + i).sum(0)) for i in range(n)]
    return fns, x


@pytest.mark.parametrize('n', [1, 3, 6])
def test_side_by_side_compiles_give_the_jitted_results_in_order(n):
    fns, x = _programs(n)
    compiled, own, wall = aot.compile_lowered([f.lower(x) for f in fns])
    assert len(compiled) == len(own) == n
    for c, f in zip(compiled, fns):
        np.testing.assert_array_equal(c(x), f(x))
    assert all(s >= 0 for s in own) and wall >= 0
    shares = aot.shares(own, wall)
    assert sum(shares) == pytest.approx(wall)
    assert aot.shares([0.0, 0.0], 1.0) == [0.0, 0.0]


def test_compile_benchmark_runs_and_writes_json(tmp_path):
    from benchmarks import compile_side_by_side

    out = tmp_path / 'out.json'
    enabled = jax.config.jax_enable_compilation_cache  # the benchmark turns the cache off
    try:
        compile_side_by_side.main(
            ['--shape=tiny', '--vocab_size=64', '--capacity=16', '--programs=2', '--repeats=1',
             f'--out={out}']
        )  # fmt: skip
    finally:
        jax.config.update('jax_enable_compilation_cache', enabled)
    got = json.loads(out.read_text())
    assert got['one_by_one']['wall_s'] > 0 and got['side']['wall_s'] > 0
    assert got['ratio_wall'] > 0
