"""The memory planner's figures equal the per-device sizes of real sharded arrays (8 devices)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from specjax.preflight.memory_plan import DEVICE_MEMORY_GIB, GIB, Item, MemoryPlan, device_bytes

_SCRIPT = textwrap.dedent(
    """
  import math
  import jax, numpy as np
  from specjax.models import init_cache
  from specjax.parallel import make_mesh
  from specjax.preflight.memory_plan import cache_item, cache_shardings
  from specjax.preflight.plans import plan_for_config
  from specjax.train.optimizer import make_optimizer
  from specjax.train.state import plan_train_state
  from specjax.models import TransformerConfig
  from specjax.config_files import load_config
  assert jax.device_count() == 8, jax.devices()

  def device_bytes(tree):
    # Bytes that device 0 really holds for every leaf of `tree`.
    dev = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
      total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == dev)
    return total

  for shape in [(8, 1, 1), (2, 2, 2), (1, 4, 2)]:
    config = load_config('configs/pretrain.py:size=tiny')
    config.mesh.shape = shape
    mesh = make_mesh(config.mesh)
    plan = plan_for_config(config, mesh, compile_step=shape == (2, 2, 2))
    items = {i.name: i.bytes_per_device for i in plan.items}
    cfg = TransformerConfig.from_dict(config.model)
    state = plan_train_state(cfg, make_optimizer(config.train), 0, mesh, config.mesh.rules).init()
    assert items['model params'] == device_bytes(state.params), (shape, items)
    assert items['model optimizer state'] == device_bytes(state.opt_state), (shape, items)
    cache = init_cache(cfg, 8, 64)
    cache = jax.device_put(cache, cache_shardings(mesh, config.mesh.rules, cache))
    item = cache_item('model', cfg, 8, 64, mesh, config.mesh.rules)
    assert item.bytes_per_device == device_bytes(cache), (shape, item)
    assert item.total_bytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    if shape == (2, 2, 2):
      assert plan.temporaries and plan.temporaries > 0, plan
    if shape == (8, 1, 1):  # pure data parallelism: every device holds every parameter
      assert items['model params'] == sum(x.nbytes for x in jax.tree.leaves(state.params))

  config = load_config('configs/spec_eval.py:random')
  config.mesh.shape = (2, 2, 2)
  plan = plan_for_config(config, compile_step=True)
  names = [i.name for i in plan.items]
  assert names[:2] == ['target params', 'draft params'], names
  assert any(n.startswith('target KV cache') for n in names), names
  assert plan.temporaries > 0
  config = load_config('configs/cotrain.py:size=tiny')
  config.mesh.shape = (2, 2, 2)
  plan = plan_for_config(config, compile_step=False)
  assert [i.name for i in plan.items] == ['target params', 'target optimizer state',
      'draft params', 'draft optimizer state']
  print('PLANNER_OK')
  """
)


def test_planner_figures_equal_real_sharded_arrays():
    env = dict(
        os.environ,
        XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count=8',
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, '-c', _SCRIPT],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert 'PLANNER_OK' in out.stdout, out.stderr[-3000:]


def test_fits_and_unknown_device():
    plan = MemoryPlan('pretrain', {'data': 1}, (Item('model params', 10 * GIB, 10 * GIB),), 7 * GIB)
    assert plan.bytes_per_device == 17 * GIB
    assert not plan.fits('tpu-v5e') and plan.fits('tpu-v4') and plan.fits('h200')
    assert plan.to_dict()['fits']['tpu-v5e'] is False
    assert 'does NOT fit' in plan.table('tpu-v5e')
    assert set(DEVICE_MEMORY_GIB) >= {'tpu-v4', 'tpu-v5e', 'tpu-v5p', 'tpu-v6e', 'h100', 'h200'}
    with pytest.raises(ValueError, match="unknown device 'tpu-v9'"):
        device_bytes('tpu-v9')


def test_unknown_mode_and_missing_workdir_name_the_field():
    import ml_collections

    from specjax.preflight.plans import plan_for_config

    with pytest.raises(ValueError, match='config.mode'):
        plan_for_config(ml_collections.ConfigDict({'mode': 'sweep'}), mesh=object())
    cfg = ml_collections.ConfigDict(
        {'mode': 'spec_eval', 'random_init': False, 'target_workdir': '', 'mesh': {'rules': ()}}
    )
    with pytest.raises(ValueError, match='config.target_workdir is empty'):
        plan_for_config(cfg, mesh=object(), compile_step=False)
