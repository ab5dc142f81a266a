"""Hugging Face Llama interop: the tensor mapping, import and export vs transformers, bad
directories (configs and config.json fields: tests/test_hf_config.py)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax.interop import config_from_hf, hf_config_from, model_from_tensors, tensors_from_model
from specjax.interop.convert import tensor_specs
from specjax.interop.hf import export_llama, import_llama
from specjax.models import TransformerConfig, apply, apply_cached, init_cache, split
from specjax.models.config import RopeScaling

LLAMA3 = dict(
    rope_type='llama3',
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
SCALING = RopeScaling(8.0, 1.0, 4.0, 16)
# transformers LlamaConfig kwargs: grouped-query, untied, odd vocabulary, rope θ 5e5, llama3
# scaling, head_dim 20 != 48 / 4; and a tied multi-head one with default rope.
HF_MODELS = {
    'gqa_untied_llama3': dict(
        vocab_size=333,
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=20,
        intermediate_size=80,
        rope_theta=5e5,
        rope_scaling=LLAMA3,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    'tied': dict(
        vocab_size=257,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    ),
}
_jit_apply = jax.jit(apply, static_argnums=0)
_jit_cached = jax.jit(apply_cached, static_argnums=0)


def llama_config(**kw):
    base = dict(vocab_size=333, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=80)
    return TransformerConfig(**{**base, 'max_len': 64, **kw})


def _random_tensors(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return {s.name: rng.normal(0, 0.3, s.shape).astype(np.float32) for s in tensor_specs(cfg)}


def _logits(model, tokens):
    graphdef, params = split(model)
    return np.asarray(_jit_apply(graphdef, params, jnp.asarray(tokens, jnp.int32)))


def _tokens(vocab, shape=(2, 24), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


# --- the tensor mapping ------------------------------------------------------------------------


@pytest.mark.parametrize('tie', [True, False])
def test_tensors_round_trip_bit_exact(tie):
    cfg = llama_config(head_dim=20, tie_embeddings=tie, rope_scaling=SCALING)
    tensors = _random_tensors(cfg)
    assert ('lm_head.weight' in tensors) is not tie
    model = model_from_tensors(cfg, tensors.__getitem__)
    back = model_from_tensors(config_from_hf(hf_config_from(cfg)), tensors_from_model(model).get)
    assert back.config == cfg
    for name, w in tensors_from_model(back).items():
        np.testing.assert_array_equal(w, tensors[name], err_msg=name)
    # The layouts are the ones specjax computes with: q is [E, H, D], o is [H, D, E].
    q = tensors['model.layers.1.self_attn.q_proj.weight']
    np.testing.assert_array_equal(back.blocks[1].attn.q[...][:, 2, :], q[40:60].T)
    o = tensors['model.layers.0.self_attn.o_proj.weight']
    np.testing.assert_array_equal(back.blocks[0].attn.o[...][3], o[:, 60:80].T)


def test_model_from_tensors_rejects_missing_and_misshapen():
    cfg = llama_config()
    tensors = _random_tensors(cfg)
    missing = {k: v for k, v in tensors.items() if k != 'model.layers.1.mlp.up_proj.weight'}
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        model_from_tensors(cfg, missing.__getitem__)
    bad = dict(tensors, **{'model.norm.weight': np.ones(47, np.float32)})
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' has shape \(47,\), expected \(48,\)"
    ):
        model_from_tensors(cfg, bad.__getitem__)


def test_model_from_tensors_casts_param_dtype():
    cfg = llama_config()
    model = model_from_tensors(cfg, _random_tensors(cfg).__getitem__, param_dtype='bfloat16')
    assert model.config == dataclasses.replace(cfg, param_dtype='bfloat16')
    assert model.embed[...].dtype == jnp.bfloat16


# --- against transformers ----------------------------------------------------------------------


@pytest.fixture(scope='module')
def hf_models(tmp_path_factory):
    """name -> (LlamaForCausalLM, its save_pretrained directory), float32, spread-out logits."""
    torch = pytest.importorskip('torch')
    transformers = pytest.importorskip('transformers')
    out = {}
    for i, (name, kw) in enumerate(HF_MODELS.items()):
        torch.manual_seed(i)
        hc = transformers.LlamaConfig(
            num_hidden_layers=2, max_position_embeddings=64, initializer_range=0.2, **kw
        )
        hc.architectures = ['LlamaForCausalLM']
        model = transformers.LlamaForCausalLM(hc).eval()
        model.generation_config.eos_token_id = None  # greedy runs never stop early
        model.generation_config.pad_token_id = 0
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory, safe_serialization=True)
        out[name] = (model, directory)
    return out


def _hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.parametrize('name', list(HF_MODELS))
def test_import_export_match_transformers(hf_models, name, tmp_path, highest_precision):
    import transformers

    hf_model, directory = hf_models[name]
    model = import_llama(directory)
    assert model.config.head_dim == HF_MODELS[name].get('head_dim', model.config.head_dim)
    tokens = _tokens(model.config.vocab_size)
    ref = _hf_logits(hf_model, tokens)
    assert ref.std() > 0.1  # logits far from uniform, so the tolerance below means something
    np.testing.assert_allclose(_logits(model, tokens), ref, atol=1e-4, rtol=0)
    # Export: transformers loads it and computes the same logits; re-import is bit-exact.
    export_llama(model, tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(_hf_logits(reloaded, tokens), ref, atol=1e-6, rtol=0)
    back = import_llama(tmp_path)
    assert back.config == model.config
    original = tensors_from_model(model)
    for key, w in tensors_from_model(back).items():
        np.testing.assert_array_equal(w, original[key], err_msg=key)


def test_import_into_scan_layout(hf_models, highest_precision):
    """model_from_tensors fills a scan_layers model (through the unstacked layout): the same
    logits as transformers and the unstacked import, and the same tensors back out."""
    hf_model, directory = hf_models['gqa_untied_llama3']
    flat = import_llama(directory)
    tensors = load_file(directory / 'model.safetensors')
    cfg = dataclasses.replace(flat.config, scan_layers=True)
    scanned = model_from_tensors(cfg, tensors.__getitem__)
    assert scanned.config == cfg and scanned.blocks.attn.q.shape == (2, 48, 4, 20)
    tokens = _tokens(cfg.vocab_size)
    got = _logits(scanned, tokens)
    np.testing.assert_allclose(got, _hf_logits(hf_model, tokens), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, _logits(flat, tokens), atol=1e-6, rtol=0)
    original = tensors_from_model(flat)
    for key, w in tensors_from_model(scanned).items():
        np.testing.assert_array_equal(w, original[key], err_msg=key)


def test_sharded_and_bfloat16_checkpoints_import(hf_models, tmp_path):
    import torch

    hf_model, directory = hf_models['gqa_untied_llama3']
    hf_model.save_pretrained(tmp_path / 'sharded', max_shard_size='40KB')
    assert len(list((tmp_path / 'sharded').glob('*.safetensors'))) > 3
    single = tensors_from_model(import_llama(directory))
    for key, w in tensors_from_model(import_llama(tmp_path / 'sharded')).items():
        np.testing.assert_array_equal(w, single[key], err_msg=key)
    # bfloat16 on disk (no torch on the read path): kept as bfloat16, or cast on request.
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / 'bf16')
    hf_model.to(torch.float32)
    bf16 = import_llama(tmp_path / 'bf16')
    assert bf16.config.param_dtype == bf16.config.dtype == 'bfloat16'
    assert bf16.embed[...].dtype == jnp.bfloat16
    as_f32 = import_llama(tmp_path / 'bf16', dtype='float32')
    emb = single['model.embed_tokens.weight']
    np.testing.assert_array_equal(as_f32.embed[...], emb.astype(jnp.bfloat16).astype(np.float32))


def test_cached_decoding_and_greedy_match(hf_models, highest_precision):
    from specjax.sampling import SamplingConfig, autoregressive_sample

    hf_model, directory = hf_models['gqa_untied_llama3']
    model = import_llama(directory)
    graphdef, params = split(model)
    tokens = _tokens(model.config.vocab_size, (2, 12), seed=1)
    full = _logits(model, tokens)
    # Cached: an 8-token prefill, then one token at a time.
    cache = init_cache(model.config, 2, 16)
    logits, cache = _jit_cached(graphdef, params, jnp.asarray(tokens[:, :8]), jnp.full(2, 8), cache)
    steps = [logits]
    for t in range(8, 12):
        step = jnp.asarray(tokens[:, t : t + 1], jnp.int32)
        logits, cache = _jit_cached(graphdef, params, step, jnp.ones(2, jnp.int32), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5, rtol=0)
    # Greedy decoding of ragged prompts equals transformers' generate, row by row.
    new, lengths = 6, np.array([7, 4])
    prompts = np.where(np.arange(8)[None] < lengths[:, None], tokens[:, :8], 0).astype(np.int32)
    out = autoregressive_sample(
        model, prompts, lengths, max_new_tokens=new, sampling=SamplingConfig(0.0), rng=0
    )
    for b, n in enumerate(lengths):
        ref = _hf_generate(hf_model, prompts[b : b + 1, :n], new)
        np.testing.assert_array_equal(np.asarray(out.tokens)[b], ref, err_msg=f'row {b}')


def _hf_generate(hf_model, prompt, new):
    import torch

    res = hf_model.generate(
        torch.as_tensor(prompt),
        do_sample=False,
        max_new_tokens=new,
        output_scores=True,
        return_dict_in_generate=True,
    )
    top2 = torch.stack(res.scores).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, 'near tie: greedy comparison meaningless'
    return res.sequences[0, prompt.shape[1] :].numpy()


# --- bad input ---------------------------------------------------------------------------------


def _write_dir(path, cfg, tensors):
    path.mkdir()
    (path / 'config.json').write_text(json.dumps(hf_config_from(cfg)))
    save_file(tensors, path / 'model.safetensors', metadata={'format': 'pt'})
    return path


def test_import_llama_rejects_bad_directories(tmp_path):
    cfg = llama_config()
    tensors = _random_tensors(cfg)
    missing = {k: v for k, v in tensors.items() if 'layers.1.self_attn.k_proj' not in k}
    with pytest.raises(
        ValueError, match=r"missing tensor 'model.layers.1.self_attn.k_proj.weight'"
    ):
        import_llama(_write_dir(tmp_path / 'missing', cfg, missing))
    bad = dict(tensors, **{'model.layers.0.mlp.down_proj.weight': np.zeros((48, 81), np.float32)})
    with pytest.raises(ValueError, match=r'down_proj.weight.*\(48, 81\), expected \(48, 80\)'):
        import_llama(_write_dir(tmp_path / 'misshapen', cfg, bad))
    extra = dict(tensors, **{'model.layers.0.self_attn.q_proj.bias': np.zeros(48, np.float32)})
    with pytest.raises(ValueError, match=r'q_proj.bias'):
        import_llama(_write_dir(tmp_path / 'bias', cfg, extra))
    pickled = tmp_path / 'pickled'
    pickled.mkdir()
    (pickled / 'config.json').write_text(json.dumps(hf_config_from(cfg)))
    (pickled / 'pytorch_model.bin').write_bytes(b'not unpickled')
    with pytest.raises(ValueError, match=r'only pickle weights \(pytorch_model.bin\)'):
        import_llama(pickled)
    with pytest.raises(FileNotFoundError, match='config.json'):
        import_llama(tmp_path / 'nowhere')
    other = _write_dir(tmp_path / 'other', cfg, tensors)
    (other / 'config.json').write_text(
        json.dumps(dict(hf_config_from(cfg), architectures=['MistralForCausalLM']))
    )
    with pytest.raises(ValueError, match='MistralForCausalLM'):
        import_llama(other)


class _Tokenizer:
    vocab_size, pad_id, bos_id, eos_id = 333, 0, 1, 2

    def save(self, directory):
        (directory / 'tokenizer.json').write_text('{}')


def test_export_writes_tokenizer_and_ids(tmp_path):
    cfg = llama_config()
    tensors = _random_tensors(cfg)
    model = model_from_tensors(cfg, tensors.__getitem__)
    with pytest.raises(TypeError, match='save'):
        export_llama(model, tmp_path / 'x', tokenizer=object())
    assert not (tmp_path / 'x').exists()  # refused before writing anything
    out = export_llama(model, tmp_path / 'y', tokenizer=_Tokenizer())
    assert (out / 'tokenizer.json').is_file()
    generation = json.loads((out / 'generation_config.json').read_text())
    assert generation == dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert json.loads((out / 'config.json').read_text())['eos_token_id'] == 2
    saved = load_file(out / 'model.safetensors')
    assert sorted(saved) == sorted(tensors)
