"""Meshes and sharding rules, including a 4-device simulated mesh in one subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flax import nnx

from specjax.models import Transformer, TransformerConfig, split
from specjax.parallel import (
    DEFAULT_RULES,
    default_mesh_config,
    logical_to_spec,
    make_mesh,
    param_shardings,
)
from specjax.parallel.mesh import mesh_rules, resolve_shape
from specjax.sampling import SamplingConfig, speculative_sample

_SCRIPT = textwrap.dedent(
    """
  import jax, jax.numpy as jnp, numpy as np
  from flax import nnx
  from specjax.models import Transformer, TransformerConfig, apply, split
  from specjax.parallel import (batch_sharding, check_divisible, default_mesh_config, make_mesh,
                                param_shardings)
  assert jax.device_count() == 4, jax.devices()
  jax.config.update('jax_default_matmul_precision', 'highest')
  cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=64, max_len=32)
  graphdef, params = split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
  loss = lambda p, t: jnp.mean(apply(graphdef, p, t) ** 2)
  ref_logits = np.asarray(jax.jit(apply, static_argnums=0)(graphdef, params, tokens))
  ref_grad = jax.jit(jax.grad(loss))(params, tokens)
  mc = default_mesh_config()
  mc.shape = (2, 1, 2)  # data x fsdp x tensor
  mesh = make_mesh(mc)
  shardings = param_shardings(mesh, params, mc.rules)
  check_divisible(params, shardings)
  sharded = jax.device_put(params, shardings)
  emb = sharded['embed'][...]
  assert emb.sharding.spec == jax.sharding.PartitionSpec('tensor', 'fsdp'), emb.sharding
  tok = jax.device_put(tokens, batch_sharding(mesh, mc.rules))
  fwd = jax.jit(apply, static_argnums=0, in_shardings=(shardings, batch_sharding(mesh, mc.rules)))
  np.testing.assert_allclose(fwd(graphdef, sharded, tok), ref_logits, atol=1e-5)
  grad = jax.jit(jax.grad(loss), out_shardings=shardings)(sharded, tok)
  for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # A scanned target (its KV cache stacked [n_layers, ...], kv heads over 'tensor') samples on
  # the mesh what the unrolled one samples on one device.
  import dataclasses
  from specjax.models import layout
  from specjax.sampling import SamplingConfig, autoregressive_sample, speculative_sample
  scanned = layout.to_layout(nnx.merge(graphdef, params), True)
  prompts, lens = np.asarray(tokens[:, :6]), np.array([6, 4, 5, 6], np.int32)
  greedy = SamplingConfig(temperature=0.0)
  ref = autoregressive_sample(nnx.merge(graphdef, params), prompts, lens, max_new_tokens=8,
                              sampling=greedy, rng=0)
  for fn in (autoregressive_sample, lambda m, *a, **k: speculative_sample(m, m, *a,
             num_draft_tokens=2, **k)):
    out = fn(scanned, prompts, lens, max_new_tokens=8, sampling=greedy, rng=0, mesh=mesh,
             rules=mc.rules)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
  # A grammar and per-row stops (replicated tables, per-row arrays beside the sharded batch).
  from specjax.sampling import Grammar, Stops
  class Tok:  # 64 ids: pad 0, eos 1, then the characters '0'..'m'
    vocab_size, pad_id, bos_id, eos_id = 64, 0, 0, 1
    def token_bytes(self):
      return (b'', b'') + tuple(bytes([48 + i]) for i in range(62))
  tok = Tok()
  task = dict(grammar=Grammar.from_regex(tok, '([a-f]|[0-9])+;[A-Z]{1,3}'),
              stops=[Stops(tok, strings=('a1',)), None, Stops(tok, token_ids=(50,)),
                     Stops(tok, min_new_tokens=2)])
  ref = autoregressive_sample(nnx.merge(graphdef, params), prompts, lens, max_new_tokens=8,
                              sampling=greedy, rng=0, **task)
  for fn in (autoregressive_sample, lambda m, *a, **k: speculative_sample(m, m, *a,
             num_draft_tokens=2, **k)):
    out = fn(scanned, prompts, lens, max_new_tokens=8, sampling=greedy, rng=0, mesh=mesh,
             rules=mc.rules, **task)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.finish_reason, ref.finish_reason)
  print('SHARDED_OK')
  """
)


def test_four_device_mesh_matches_single_device():
    env = dict(
        os.environ,
        XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count=4',
    )
    out = subprocess.run(
        [sys.executable, '-c', _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert 'SHARDED_OK' in out.stdout, out.stderr[-3000:]


def test_rules_map_every_parameter_axis():
    cfg = TransformerConfig(
        vocab_size=64,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_len=32,
        tie_embeddings=False,
    )
    _, params = split(Transformer(cfg, rngs=nnx.Rngs(0)))
    mc = default_mesh_config()
    shardings = param_shardings(make_mesh(mc), params, mc.rules)
    assert shardings['lm_head'].get_value().spec == logical_to_spec(('embed', 'vocab'), mc.rules)


def test_missing_rule_and_bad_mesh_shape_name_the_field():
    with pytest.raises(ValueError, match="logical axis 'mlp'"):
        logical_to_spec(('embed', 'mlp'), (('embed', 'fsdp'),))
    with pytest.raises(ValueError, match='config.mesh.shape'):
        resolve_shape(('data', 'tensor'), (3, -1), 4)
    with pytest.raises(ValueError, match='config.mesh.shape'):
        resolve_shape(('data', 'tensor'), (-1, -1), 4)
    assert resolve_shape(('data', 'fsdp', 'tensor'), (-1, 2, 1), 8) == (4, 2, 1)
    # A mesh axis is never used twice in one spec.
    assert logical_to_spec(('heads', 'mlp'), (('heads', 'tensor'), ('mlp', 'tensor'))) == (
        logical_to_spec(('heads', None), (('heads', 'tensor'),))
    )


def test_draft_rules_presets_resolve_and_bad_names_name_the_field():
    mc = default_mesh_config()
    rules, draft = mesh_rules(mc)
    assert draft == rules == DEFAULT_RULES  # 'same'
    mc.draft_rules = 'data_parallel'
    _, draft = mesh_rules(mc)
    assert dict(draft) == {n: (('data', 'fsdp') if n == 'batch' else None) for n, _ in rules}
    mc.draft_rules = 'sharded_somehow'
    with pytest.raises(ValueError, match="config.mesh.draft_rules='sharded_somehow'"):
        mesh_rules(mc)
    pairs = (('batch', 'data'), *((n, None) for n, _ in DEFAULT_RULES if n != 'batch'))
    assert mesh_rules(default_mesh_config(draft_rules=pairs))[1] == pairs


def test_sampler_rule_errors_come_before_compiling():
    cfg = TransformerConfig(
        vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_len=16
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    prompts, lengths = np.ones((2, 3), np.int32), np.array([3, 1], np.int32)
    no_kv = tuple(r for r in DEFAULT_RULES if r[0] != 'kv_heads')
    kw = dict(num_draft_tokens=2, max_new_tokens=4, sampling=SamplingConfig(0.0), rng=0)
    with pytest.raises(ValueError, match="logical axis 'kv_heads' has no rule"):
        speculative_sample(model, model, prompts, lengths, **kw, draft_rules=no_kv)
    with pytest.raises(ValueError, match="draft_rules='tp'"):
        speculative_sample(model, model, prompts, lengths, **kw, draft_rules='tp')
