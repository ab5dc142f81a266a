"""Tiny Llama GGUF files written with gguf.GGUFWriter, for the interop tests.

Weights are random; q/k rows are stored permuted as llama.cpp's converter does; tensors use a
mix of the supported quantisation types (K-quants as random blocks with finite scales, since
gguf.quants cannot quantise to them).
"""

from __future__ import annotations

import numpy as np

from specjax.interop.gguf import permute_rows

V_BYTES = 256
SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
MERGES = ['Ġ t', 'h e', 'Ġt he', 'i n', 'Ġ a']
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DIMS = dict(d_model=64, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=3, max_len=128)
# K-quant block sizes (bytes per 256 values) and where their float16 scales sit.
_K_BLOCKS = {'Q4_K': (144, (0, 2)), 'Q5_K': (176, (0, 2)), 'Q6_K': (210, (208,))}


def byte_alphabet() -> list[str]:
    from specjax.data.hf_tokenizer import _byte_alphabet

    return [_byte_alphabet()[b] for b in range(256)]


def vocabulary() -> list[str]:
    return SPECIALS + byte_alphabet() + [m.replace(' ', '') for m in MERGES]


def _k_quant(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    size, scale_at = _K_BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        scale = rng.uniform(0.001, 0.004, (rows, cols // 256)).astype(np.float16)
        blocks[..., at : at + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _add(writer, rng, name, w, kind):
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == 'F32':
        writer.add_tensor(name, w.astype(np.float32))
    elif kind in _K_BLOCKS:
        writer.add_tensor(name, _k_quant(rng, *w.shape, kind), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)


def layer_types(i: int) -> dict[str, str]:
    """Quantisation type per tensor of layer i: every supported type appears."""
    down = ('Q4_K', 'Q5_K', 'Q6_K')[i % 3]
    return {
        'attn_q.weight': 'Q8_0',
        'attn_k.weight': 'Q4_0',
        'attn_v.weight': 'Q4_1',
        'attn_output.weight': 'F16',
        'ffn_gate.weight': 'BF16',
        'ffn_up.weight': 'Q8_0',
        'ffn_down.weight': down,
        'attn_norm.weight': 'F32',
        'ffn_norm.weight': 'F32',
    }


def write_tiny_gguf(
    path: str,
    *,
    arch: str = 'llama',
    tied: bool = False,
    drop: str | None = None,
    reshape: str | None = None,
    override_type: tuple[str, str] | None = None,
    extra: str | None = None,
    seed: int = 0,
) -> str:
    """Writes a 3-layer Llama GGUF with a byte-level BPE tokenizer; the keyword arguments make
    the bad inputs (a tensor dropped, misshapen, of another type, or an extra one)."""
    import gguf

    rng = np.random.default_rng(seed)
    d, h, kv, f, n = (DIMS[k] for k in ('d_model', 'n_heads', 'n_kv_heads', 'd_ff', 'n_layers'))
    hd = d // h
    tokens = vocabulary()
    v = len(tokens)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n)
    w.add_context_length(DIMS['max_len'])
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(5e5)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(v)
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model('gpt2')
    w.add_tokenizer_pre('gpt2')
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (v - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)

    normal = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
    tensors = {'token_embd.weight': (normal(v, d), 'Q8_0')}
    for i in range(n):
        types = layer_types(i)
        shapes = {
            'attn_q.weight': (h * hd, d),
            'attn_k.weight': (kv * hd, d),
            'attn_v.weight': (kv * hd, d),
            'attn_output.weight': (d, h * hd),
            'ffn_gate.weight': (f, d),
            'ffn_up.weight': (f, d),
            'ffn_down.weight': (d, f),
        }
        for name, shape in shapes.items():
            x = normal(*shape)
            if name == 'attn_q.weight':
                x = permute_rows(x, h)
            elif name == 'attn_k.weight':
                x = permute_rows(x, kv)
            tensors[f'blk.{i}.{name}'] = (x, types[name])
        for name in ('attn_norm.weight', 'ffn_norm.weight'):
            tensors[f'blk.{i}.{name}'] = (1 + normal(d), 'F32')
    tensors['output_norm.weight'] = (1 + normal(d), 'F32')
    if not tied:
        tensors['output.weight'] = (normal(v, d), 'F16')
    if extra:
        tensors[extra] = (normal(d), 'F32')
    if drop:
        del tensors[drop]
    if reshape:
        x, kind = tensors[reshape]
        tensors[reshape] = (x[:, : x.shape[1] // 2] if x.ndim == 2 else x[: len(x) // 2], kind)
    if override_type:
        name, kind = override_type
        tensors[name] = (tensors[name][0], kind)
    for name, (x, kind) in tensors.items():
        _add(w, rng, name, x, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
