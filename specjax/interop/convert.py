"""The one mapping between specjax's Transformer and Hugging Face Llama: config and tensors.

Hugging Face names and layouts (torch `nn.Linear` weights are [out, in]):

    model.embed_tokens.weight                     [V, E]     specjax embed       [V, E]
    model.layers.{i}.self_attn.q_proj.weight      [H*D, E]   blocks[i].attn.q    [E, H, D]
    model.layers.{i}.self_attn.k_proj.weight      [K*D, E]   blocks[i].attn.k    [E, K, D]
    model.layers.{i}.self_attn.v_proj.weight      [K*D, E]   blocks[i].attn.v    [E, K, D]
    model.layers.{i}.self_attn.o_proj.weight      [E, H*D]   blocks[i].attn.o    [H, D, E]
    model.layers.{i}.mlp.gate_proj.weight         [F, E]     blocks[i].mlp.gate  [E, F]
    model.layers.{i}.mlp.up_proj.weight           [F, E]     blocks[i].mlp.up    [E, F]
    model.layers.{i}.mlp.down_proj.weight         [E, F]     blocks[i].mlp.down  [F, E]
    model.layers.{i}.input_layernorm.weight       [E]        blocks[i].attn_norm.scale
    model.layers.{i}.post_attention_layernorm.weight [E]     blocks[i].mlp_norm.scale
    model.norm.weight                             [E]        final_norm.scale
    lm_head.weight (untied only)                  [V, E]     lm_head             [E, V]

Both use RoPE's rotate-half layout, so q and k need no permutation. hf.py (safetensors) and
gguf.py (after undoing llama.cpp's q/k row permutation) both go through `model_from_tensors`.
The table is in the unstacked layout; a scan_layers model converts through it
(`specjax.models.layout`), so both layouts import and export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import Transformer, TransformerConfig
from specjax.models.config import RopeScaling
from specjax.models.layout import to_layout

SUPPORTED_ARCHITECTURES = ('LlamaForCausalLM',)
SUPPORTED_MODEL_TYPES = ('llama',)
SUPPORTED_ROPE_TYPES = ('default', 'llama3')
_DTYPES = {'float32': 'float32', 'bfloat16': 'bfloat16', 'float16': 'float16'}


REQUIRED_KEYS = (
    'vocab_size',
    'hidden_size',
    'num_hidden_layers',
    'num_attention_heads',
    'intermediate_size',
)


def config_from_hf(
    hf_config: dict, *, dtype: str | None = None, where: str = 'config.json'
) -> TransformerConfig:
    """TransformerConfig from a Llama `config.json` dict; ValueError for what specjax lacks.

    dtype (compute and storage) defaults to the checkpoint's `torch_dtype`/`dtype`, else float32.
    where names the dict in errors (e.g. 'config.json at /path/config.json'); a key of
    REQUIRED_KEYS absent or null raises "<where> lacks required key <key>".
    """
    c = dict(hf_config)
    _check_architecture(c, where)
    for flag in ('attention_bias', 'mlp_bias'):
        if c.get(flag):
            raise ValueError(f'{where} sets {flag}=true; specjax models have no biases')
    act = c.get('hidden_act', 'silu')
    if act != 'silu':
        raise ValueError(f'{where} hidden_act={act!r} is not supported (SwiGLU needs silu)')
    if c.get('pretraining_tp', 1) not in (1, None):
        raise ValueError(f'{where} pretraining_tp={c["pretraining_tp"]!r} is not supported')
    for key in REQUIRED_KEYS:
        if c.get(key) is None:
            raise ValueError(f'{where} lacks required key {key}')
    theta, scaling = _rope_from_hf(c, where)
    if dtype is None:
        stored = c.get('dtype') or c.get('torch_dtype') or 'float32'
        if stored not in _DTYPES:
            raise ValueError(f'{where} dtype={stored!r} is not supported; one of {sorted(_DTYPES)}')
        dtype = stored
    return TransformerConfig(
        vocab_size=c['vocab_size'],
        d_model=c['hidden_size'],
        n_layers=c['num_hidden_layers'],
        n_heads=c['num_attention_heads'],
        n_kv_heads=c.get('num_key_value_heads') or c['num_attention_heads'],
        d_ff=c['intermediate_size'],
        max_len=c.get('max_position_embeddings', 2048),
        rope_theta=float(theta),
        tie_embeddings=bool(c.get('tie_word_embeddings', False)),
        norm_eps=float(c.get('rms_norm_eps', 1e-6)),
        dtype=dtype,
        param_dtype=dtype,
        head_dim=c.get('head_dim'),
        rope_scaling=scaling,
    )


def _check_architecture(c: dict, where: str) -> None:
    archs = c.get('architectures') or []
    bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    model_type = c.get('model_type', 'llama')
    if bad or model_type not in SUPPORTED_MODEL_TYPES:
        what = f'architectures={archs!r}' if bad else f'model_type={model_type!r}'
        raise ValueError(
            f'{where} {what} is not supported; specjax imports '
            f'{", ".join(SUPPORTED_ARCHITECTURES)} (model_type {SUPPORTED_MODEL_TYPES})'
        )


def _rope_from_hf(c: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 4's rope_theta/rope_scaling or 5's rope_parameters."""
    params = dict(c.get('rope_parameters') or c.get('rope_scaling') or {})
    theta = params.get('rope_theta') or c.get('rope_theta') or 10000.0
    rope_type = params.get('rope_type', params.get('type', 'default'))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f'{where} rope scaling rope_type={rope_type!r} is not supported; '
            f'supported: {SUPPORTED_ROPE_TYPES}'
        )
    if params.get('partial_rotary_factor', 1.0) != 1.0:
        raise ValueError(
            f'{where} partial_rotary_factor={params["partial_rotary_factor"]!r} '
            'is not supported (rotary embeddings cover the whole head)'
        )
    if rope_type == 'default':
        return theta, None
    missing = [
        k
        for k in (
            'factor',
            'low_freq_factor',
            'high_freq_factor',
            'original_max_position_embeddings',
        )
        if k not in params
    ]
    if missing:
        raise ValueError(f'{where} llama3 rope scaling lacks {missing}')
    scaling = RopeScaling(
        factor=float(params['factor']),
        low_freq_factor=float(params['low_freq_factor']),
        high_freq_factor=float(params['high_freq_factor']),
        original_max_len=int(params['original_max_position_embeddings']),
    )
    return theta, scaling


def hf_config_from(cfg: TransformerConfig) -> dict:
    """The config.json of `cfg` that transformers' LlamaForCausalLM loads."""
    rope = {'rope_type': 'default', 'rope_theta': cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(
            rope_type='llama3',
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_len,
        )
    return {
        'architectures': ['LlamaForCausalLM'],
        'model_type': 'llama',
        'vocab_size': cfg.vocab_size,
        'hidden_size': cfg.d_model,
        'num_hidden_layers': cfg.n_layers,
        'num_attention_heads': cfg.n_heads,
        'num_key_value_heads': cfg.n_kv_heads,
        'head_dim': cfg.head_dim,
        'intermediate_size': cfg.d_ff,
        'max_position_embeddings': cfg.max_len,
        'hidden_act': 'silu',
        'rms_norm_eps': cfg.norm_eps,
        'rope_theta': cfg.rope_theta,  # transformers 4 reads these two,
        'rope_scaling': rope if cfg.rope_scaling is not None else None,
        'rope_parameters': rope,  # transformers 5 this one
        'tie_word_embeddings': cfg.tie_embeddings,
        'attention_bias': False,
        'mlp_bias': False,
        'torch_dtype': cfg.param_dtype,
        'dtype': cfg.param_dtype,
    }


class TensorSpec(NamedTuple):
    """One HF tensor: its name and shape, the specjax state path, and the two layout maps."""

    name: str
    shape: tuple[int, ...]
    path: tuple
    to_specjax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def tensor_specs(cfg: TransformerConfig) -> Iterator[TensorSpec]:
    """Every tensor of a Llama checkpoint of `cfg`, in checkpoint order (unstacked paths)."""
    v, e, h, k, d, f = (
        cfg.vocab_size,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
    )
    same = lambda w: w
    yield TensorSpec('model.embed_tokens.weight', (v, e), ('embed',), same, same)

    def proj_in(heads):  # [heads*D, E] <-> [E, heads, D]
        return (lambda w: w.T.reshape(e, heads, d), lambda w: w.reshape(e, heads * d).T)

    for i in range(cfg.n_layers):
        pre, blk = f'model.layers.{i}.', ('blocks', i)
        for name, heads in (('q', h), ('k', k), ('v', k)):
            yield TensorSpec(
                f'{pre}self_attn.{name}_proj.weight',
                (heads * d, e),
                (*blk, 'attn', name),
                *proj_in(heads),
            )
        yield TensorSpec(
            f'{pre}self_attn.o_proj.weight',
            (e, h * d),
            (*blk, 'attn', 'o'),
            lambda w: w.T.reshape(h, d, e),
            lambda w: w.reshape(h * d, e).T,
        )
        for name, shape in (('gate', (f, e)), ('up', (f, e)), ('down', (e, f))):
            yield TensorSpec(
                f'{pre}mlp.{name}_proj.weight',
                shape,
                (*blk, 'mlp', name),
                np.transpose,
                np.transpose,
            )
        yield TensorSpec(
            f'{pre}input_layernorm.weight', (e,), (*blk, 'attn_norm', 'scale'), same, same
        )
        yield TensorSpec(
            f'{pre}post_attention_layernorm.weight', (e,), (*blk, 'mlp_norm', 'scale'), same, same
        )
    yield TensorSpec('model.norm.weight', (e,), ('final_norm', 'scale'), same, same)
    if not cfg.tie_embeddings:
        yield TensorSpec('lm_head.weight', (v, e), ('lm_head',), np.transpose, np.transpose)


def model_from_tensors(
    cfg: TransformerConfig,
    get_tensor: Callable[[str], np.ndarray],
    *,
    param_dtype: str | None = None,
) -> Transformer:
    """A Transformer whose parameters are `get_tensor(hf_name)` in specjax layout.

    get_tensor raises KeyError for a missing name. Every tensor's shape is checked before use;
    parameters are cast to `param_dtype` (default cfg.param_dtype, recorded in the returned
    model's config). The model is built abstractly (no random initialisation); with
    cfg.scan_layers it is filled unstacked, then stacked.
    """
    if param_dtype is not None and param_dtype != cfg.param_dtype:
        cfg = dataclasses.replace(cfg, param_dtype=param_dtype)
    if cfg.scan_layers:
        unstacked = dataclasses.replace(cfg, scan_layers=False)
        return to_layout(model_from_tensors(unstacked, get_tensor), scan_layers=True)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    dtype = jnp.dtype(cfg.param_dtype)
    for spec in tensor_specs(cfg):
        try:
            w = get_tensor(spec.name)
        except KeyError:
            raise ValueError(f'checkpoint is missing tensor {spec.name!r}') from None
        if tuple(w.shape) != spec.shape:
            raise ValueError(
                f'tensor {spec.name!r} has shape {tuple(w.shape)}, expected {spec.shape}'
            )
        value = jnp.asarray(spec.to_specjax(np.asarray(w)), dtype=dtype)
        flat[spec.path].set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def tensors_from_model(model: Transformer) -> dict[str, np.ndarray]:
    """Every parameter under its HF name and layout, in its own dtype (either model layout)."""
    model = to_layout(model, scan_layers=False)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = {}
    for spec in tensor_specs(model.config):
        w = np.asarray(flat[spec.path].get_value())
        out[spec.name] = np.ascontiguousarray(spec.to_hf(w))
    return out
