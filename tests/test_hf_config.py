"""Hugging Face Llama configs: TransformerConfig's head_dim and rope_scaling (round trip, bad
values), llama3 rope frequencies against transformers, and config.json fields read or refused."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from test_interop_hf import LLAMA3, SCALING, llama_config

from specjax.interop import config_from_hf, hf_config_from
from specjax.models import Transformer, TransformerConfig
from specjax.models.layers import inv_frequencies

# --- TransformerConfig: head_dim and rope_scaling ---------------------------------------------


def test_config_json_round_trip_and_old_dicts():
    scaled = llama_config(head_dim=20, rope_scaling=SCALING)
    for cfg in (llama_config(), scaled, llama_config(head_dim=12)):
        back = TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert back == cfg and hash(back) == hash(cfg)
    assert scaled.head_dim == 20 and llama_config().head_dim == 12
    assert llama_config(rope_scaling=dataclasses.asdict(SCALING)).rope_scaling == SCALING
    # A default head_dim is left out, so configs saved before the field existed stay identical.
    old = llama_config().to_dict()
    assert 'head_dim' not in old and old['rope_scaling'] is None
    del old['rope_scaling']
    assert TransformerConfig.from_dict(old) == llama_config()
    # Explicit head_dim: d_model need not be divisible by n_heads; num_params uses head_dim.
    odd = llama_config(d_model=50, head_dim=16)
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
        (dict(rope_scaling='llama3'), 'rope_scaling'),
    ],
)
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        llama_config(**kw)


@pytest.mark.parametrize(
    ('kw', 'field'),
    [
        (dict(factor=0), 'factor'),
        (dict(low_freq_factor=-1.0), 'low_freq_factor'),
        (dict(low_freq_factor=4.0, high_freq_factor=1.0), 'high_freq_factor'),
        (dict(original_max_len=8.5), 'original_max_len'),
    ],
)
def test_rope_scaling_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=f'RopeScaling.{field}'):
        dataclasses.replace(SCALING, **kw)


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


# --- config.json from transformers -----------------------------------------------------------


def _hf_dict(**kw):
    return dict(hf_config_from(llama_config()), **kw)


@pytest.mark.parametrize(
    ('kw', 'match'),
    [
        (dict(architectures=['Qwen2ForCausalLM']), r"architectures=\['Qwen2ForCausalLM'\].*Llama"),
        (dict(model_type='gemma', architectures=None), r"model_type='gemma'.*LlamaForCausalLM"),
        (dict(rope_parameters=dict(rope_type='yarn', factor=4.0)), r"rope_type='yarn'.*llama3"),
        (dict(rope_parameters=None, rope_scaling=dict(type='linear')), "rope_type='linear'"),
        (dict(attention_bias=True), 'attention_bias'),
        (dict(mlp_bias=True), 'mlp_bias'),
        (dict(hidden_act='gelu'), "hidden_act='gelu'"),
        (dict(dtype='int8', torch_dtype=None), "dtype='int8'"),
        (dict(rope_parameters=dict(rope_type='llama3', factor=8.0)), 'lacks'),
    ],
)
def test_config_from_hf_rejects_unsupported(kw, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(_hf_dict(**kw))


def test_config_from_hf_reads_transformers_4_and_5_rope_fields():
    v5 = config_from_hf(_hf_dict(rope_parameters=dict(LLAMA3, rope_theta=5e5), rope_theta=None))
    v4 = config_from_hf(_hf_dict(rope_parameters=None, rope_scaling=LLAMA3, rope_theta=5e5))
    assert v4 == v5 and v5.rope_theta == 5e5 and v5.rope_scaling == SCALING
