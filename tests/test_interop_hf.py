"""Hugging Face Llama interop: config and tensor mapping, import and export vs transformers."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.interop import config_from_hf, hf_config_from, model_from_tensors, tensors_from_model
from specjax.models import Transformer, TransformerConfig
from specjax.models.config import RopeScaling
from specjax.models.layers import inv_frequencies

LLAMA3 = dict(
    rope_type='llama3',
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


def _cfg(**kw):
    base = dict(vocab_size=333, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=80)
    return TransformerConfig(**{**base, 'max_len': 64, **kw})


# --- TransformerConfig: head_dim and rope_scaling ---------------------------------------------


def test_config_json_round_trip_and_old_dicts():
    scaled = _cfg(head_dim=20, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    for cfg in (_cfg(), scaled, _cfg(head_dim=12)):
        back = TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert back == cfg and hash(back) == hash(cfg)
    assert scaled.head_dim == 20 and _cfg().head_dim == 12
    # A default head_dim is left out, so configs saved before the field existed stay identical.
    old = _cfg().to_dict()
    assert 'head_dim' not in old and old['rope_scaling'] is None
    del old['rope_scaling']
    assert TransformerConfig.from_dict(old) == _cfg()
    # Explicit head_dim: d_model need not be divisible by n_heads; num_params uses head_dim.
    odd = _cfg(d_model=50, head_dim=16)
    abstract = nnx.eval_shape(lambda: Transformer(odd, rngs=nnx.Rngs(0)))
    assert odd.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    ('kw', 'field'),
    [
        (dict(head_dim=0), 'head_dim'),
        (dict(head_dim=7), 'head_dim'),
        (dict(head_dim=2.0), 'head_dim'),
        (dict(d_model=50), 'd_model'),
        (dict(rope_scaling=dict(factor=8.0)), 'rope_scaling'),
        (dict(rope_scaling=(8.0, 1.0, 4.0, 16)), 'rope_scaling'),
        (
            dict(
                rope_scaling=dict(
                    factor=0, low_freq_factor=1, high_freq_factor=4, original_max_len=8
                )
            ),
            'factor',
        ),
        (
            dict(
                rope_scaling=dict(
                    factor=8, low_freq_factor=4, high_freq_factor=1, original_max_len=8
                )
            ),
            'high_freq_factor',
        ),
    ],
)
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        _cfg(**kw)


def test_llama3_frequencies_match_transformers():
    torch = pytest.importorskip('torch')
    transformers = pytest.importorskip('transformers')
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hc = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, head_dim=64, rope_theta=5e5, rope_scaling=LLAMA3
    )
    ref, _ = ROPE_INIT_FUNCTIONS['llama3'](hc, torch.device('cpu'))
    scaling = config_from_hf(hc.to_dict()).rope_scaling
    ours = inv_frequencies(64, 5e5, scaling)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    plain = inv_frequencies(64, 5e5)
    assert not np.allclose(ours, plain)  # negative control: the scaling changes frequencies


# --- the tensor mapping ------------------------------------------------------------------------


def _random_model(cfg, seed=0):
    return Transformer(cfg, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize('tie', [True, False])
def test_tensors_round_trip_bit_exact(tie):
    cfg = _cfg(head_dim=20, tie_embeddings=tie, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    model = _random_model(cfg)
    tensors = tensors_from_model(model)
    assert ('lm_head.weight' in tensors) is not tie
    assert tensors['model.layers.1.self_attn.q_proj.weight'].shape == (4 * 20, 48)
    assert tensors['model.layers.0.self_attn.o_proj.weight'].shape == (48, 4 * 20)
    back = model_from_tensors(config_from_hf(hf_config_from(cfg)), tensors.__getitem__)
    assert back.config == cfg
    tok = jnp.asarray(np.arange(10)[None] % cfg.vocab_size, jnp.int32)
    np.testing.assert_array_equal(back(tok), model(tok))
    for name, w in tensors_from_model(back).items():
        np.testing.assert_array_equal(w, tensors[name], err_msg=name)


def test_model_from_tensors_rejects_missing_and_misshapen():
    cfg = _cfg()
    tensors = tensors_from_model(_random_model(cfg))
    missing = {k: v for k, v in tensors.items() if k != 'model.layers.1.mlp.up_proj.weight'}
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        model_from_tensors(cfg, missing.__getitem__)
    bad = dict(tensors, **{'model.norm.weight': np.ones(47, np.float32)})
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' has shape \(47,\), expected \(48,\)"
    ):
        model_from_tensors(cfg, bad.__getitem__)


def test_model_from_tensors_casts_param_dtype():
    cfg = _cfg()
    tensors = tensors_from_model(_random_model(cfg))
    model = model_from_tensors(cfg, tensors.__getitem__, param_dtype='bfloat16')
    assert model.config == dataclasses.replace(cfg, param_dtype='bfloat16')
    assert model.embed[...].dtype == jnp.bfloat16
