"""GGUF (llama.cpp) files in: Llama-architecture weights, dequantised, with their tokenizer.

`import_gguf(path)` checks that every tensor's bytes lie inside the file
(`specjax.interop.integrity`), reads the file with the `gguf` package, checks everything it needs
before dequantising anything (architecture, quantisation types, tensor names and shapes), maps
GGUF metadata to a Hugging Face Llama config and GGUF tensor names to Hugging Face names, and
builds the model through `specjax.interop.convert` (the one HF <-> specjax mapping).

Two GGUF conventions to undo: shapes are stored fastest-axis first (`tensor.shape` [E, V] is the
numpy array [V, E]), and llama.cpp permutes the rows of attn_q / attn_k within each head for its
interleaved RoPE (pairs (2i, 2i+1)); specjax, like Hugging Face, rotates halves (i, i + D/2).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from specjax.data.hf_tokenizer import HuggingFaceTokenizer
from specjax.interop.errors import CorruptModelFileError
from specjax.interop.integrity import check_finite, check_gguf

SUPPORTED_ARCHITECTURES = ('llama',)
SUPPORTED_TYPES = ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1', 'Q4_K', 'Q5_K', 'Q6_K')

# GGUF tensor name -> Hugging Face Llama name ({i} = layer).
_GLOBAL_NAMES = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}
_LAYER_NAMES = {
    'attn_q.weight': 'self_attn.q_proj.weight',
    'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight',
    'attn_output.weight': 'self_attn.o_proj.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight',
    'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
    'attn_norm.weight': 'input_layernorm.weight',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if it is not part of a Llama."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split('.', 2)
    if len(parts) == 3 and parts[0] == 'blk' and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f'model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}'
    return None


def gguf_name(hf: str) -> str:
    """The GGUF name of a Hugging Face Llama tensor name (inverse of hf_name)."""
    for g, h in _GLOBAL_NAMES.items():
        if h == hf:
            return g
    _, _, i, rest = hf.split('.', 3)
    return f'blk.{i}.' + next(g for g, h in _LAYER_NAMES.items() if h == rest)


def unpermute_rows(w_RE: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved-RoPE row order of a q/k projection [n_heads*D, E] -> rotate-half.

    llama.cpp stores, per head, rows (0, D/2, 1, D/2+1, ...) at (0, 1, 2, 3, ...); this inverts
    that: [H, D/2, 2, E] -> [H, 2, D/2, E].
    """
    rows = w_RE.shape[0]
    half = rows // n_heads // 2
    return w_RE.reshape(n_heads, half, 2, *w_RE.shape[1:]).swapaxes(1, 2).reshape(w_RE.shape)


def permute_rows(w_RE: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of unpermute_rows (what llama.cpp's converter does); for writing GGUF files."""
    rows = w_RE.shape[0]
    half = rows // n_heads // 2
    return w_RE.reshape(n_heads, 2, half, *w_RE.shape[1:]).swapaxes(1, 2).reshape(w_RE.shape)


def read_metadata(reader) -> dict[str, Any]:
    """Every key -> value of a gguf.GGUFReader (strings, numbers, lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith('GGUF.')}


def hf_config_from_metadata(meta: Mapping[str, Any], tensor_names: set[str]) -> dict:
    """A Llama config.json dict from GGUF metadata (`{arch}.*` keys); ValueError naming the key."""
    arch = meta.get('general.architecture')
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f'GGUF general.architecture={arch!r} is not supported; specjax imports '
            f'{list(SUPPORTED_ARCHITECTURES)}'
        )

    def get(key, default=None):
        value = meta.get(f'{arch}.{key}', default)
        if value is None:
            raise ValueError(f'GGUF metadata has no {arch}.{key!r}')
        return value

    scaling = meta.get(f'{arch}.rope.scaling.type')
    if scaling not in (None, 'none') or 'rope_freqs.weight' in tensor_names:
        what = scaling if scaling not in (None, 'none') else 'rope_freqs.weight (llama3 factors)'
        raise ValueError(
            f'GGUF rope scaling {what!r} is not supported for GGUF import; import the Hugging '
            'Face checkpoint (hf:DIR) instead'
        )
    n_heads = int(get('attention.head_count'))
    d_model = int(get('embedding_length'))
    head_dim = int(meta.get(f'{arch}.attention.key_length') or d_model // n_heads)
    rot = meta.get(f'{arch}.rope.dimension_count')
    if rot is not None and int(rot) != head_dim:
        raise ValueError(
            f'GGUF {arch}.rope.dimension_count={rot} differs from head_dim={head_dim}: partial '
            'rotary embeddings are not supported'
        )
    vocab = meta.get(f'{arch}.vocab_size') or len(meta.get('tokenizer.ggml.tokens') or ())
    if not vocab:
        raise ValueError(f'GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens')
    return {
        'architectures': ['LlamaForCausalLM'],
        'model_type': 'llama',
        'vocab_size': int(vocab),
        'hidden_size': d_model,
        'num_hidden_layers': int(get('block_count')),
        'num_attention_heads': n_heads,
        'num_key_value_heads': int(meta.get(f'{arch}.attention.head_count_kv') or n_heads),
        'head_dim': head_dim,
        'intermediate_size': int(get('feed_forward_length')),
        'max_position_embeddings': int(get('context_length')),
        'rope_theta': float(meta.get(f'{arch}.rope.freq_base', 10000.0)),
        'rms_norm_eps': float(get('attention.layer_norm_rms_epsilon')),
        'tie_word_embeddings': 'output.weight' not in tensor_names,
        'hidden_act': 'silu',
    }


def _check_tensors(tensors, cfg) -> None:
    """Names, shapes and quantisation types, before anything is dequantised."""
    from specjax.interop import convert

    unknown = sorted(t.name for t in tensors if hf_name(t.name) is None)
    if unknown:
        raise ValueError(
            f'GGUF tensor(s) {unknown[:5]} are not part of a Llama model (no biases, no extra '
            'tensors are supported)'
        )
    for t in tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(
                f'GGUF tensor {t.name!r} has quantisation type {kind}, which is not supported; '
                f'supported: {list(SUPPORTED_TYPES)}'
            )
    by_name = {t.name: t for t in tensors}
    for spec in convert.tensor_specs(cfg):
        name = gguf_name(spec.name)
        if name not in by_name:
            raise ValueError(f'GGUF file is missing tensor {name!r} ({spec.name})')
        shape = tuple(int(n) for n in reversed(by_name[name].shape))
        if shape != spec.shape:
            raise ValueError(
                f'GGUF tensor {name!r} has shape {shape} (numpy order), expected {spec.shape}'
            )


def _tensor_getter(path: str, tensors, hf_cfg: dict):
    """get_tensor(hf_name) -> float32 numpy array in HF layout (dequantised, q/k un-permuted);
    CorruptModelFileError for a tensor holding NaN or Inf."""
    from gguf import quants

    by_hf = {hf_name(t.name): t for t in tensors}

    def get_tensor(name: str) -> np.ndarray:
        t = by_hf[name]  # KeyError -> convert reports the missing tensor
        shape = tuple(int(n) for n in reversed(t.shape))
        w = quants.dequantize(t.data, t.tensor_type)
        if w.size != int(np.prod(shape)):
            raise ValueError(f'GGUF tensor {t.name!r}: {w.size} values for shape {shape}')
        w = np.asarray(w, np.float32).reshape(shape)
        check_finite(path, t.name, w)
        if name.endswith('q_proj.weight'):
            w = unpermute_rows(w, hf_cfg['num_attention_heads'])
        elif name.endswith('k_proj.weight'):
            w = unpermute_rows(w, hf_cfg['num_key_value_heads'])
        return w

    return get_tensor


def import_gguf(path: str, *, dtype: str | None = None):
    """A Llama GGUF file -> (Transformer, HuggingFaceTokenizer).

    dtype: compute and parameter dtype of the model (default float32; weights are dequantised
    to float32 first). Errors (ValueError) name the offending key, tensor or type; a truncated
    or malformed file raises CorruptModelFileError (a ValueError) naming the file and tensor
    before any tensor is read.
    """
    import gguf

    from specjax.interop import convert

    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f'no GGUF file at {path!r}')
    check_gguf(path)  # every tensor's bytes inside the file, before the reader maps them
    try:
        reader = gguf.GGUFReader(path)
        meta = read_metadata(reader)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as e:
        raise CorruptModelFileError(path, f'the GGUF reader failed: {type(e).__name__}: {e}') from e
    names = {t.name for t in reader.tensors}
    hf_cfg = hf_config_from_metadata(meta, names)
    cfg = convert.config_from_hf(hf_cfg, dtype=dtype or 'float32', where=f'GGUF file {path}')
    _check_tensors(reader.tensors, cfg)
    tokenizer = HuggingFaceTokenizer.from_gguf_metadata(meta)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f'GGUF tokenizer has {tokenizer.vocab_size} tokens but the model vocab_size is '
            f'{cfg.vocab_size}'
        )
    model = convert.model_from_tensors(cfg, _tensor_getter(path, reader.tensors, hf_cfg))
    return model, tokenizer
