"""EAGLE-3 draft checkpoints (specjax.interop.eagle3): an exported FeatureDraft computes what
vLLM's `llama_eagle3.py` computes from the same files (its forward rebuilt here in torch from
config.json and model.safetensors alone), the round trip is bit-exact, the config carries the
loaders' fields and the feature-layer mapping, and what does not fit is refused naming the
field or tensor; so does the export_eagle3 command, on a trained feature_draft workdir."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import test_feature_train as ft
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from specjax.checkpoint import write_workdir
from specjax.distill import feature_mode
from specjax.distill.results import FEATURE_DRAFT_HEADLINE_METRICS, headline_keys
from specjax.errors import USER_ERROR_EXIT_CODE
from specjax.interop.eagle3 import export_eagle3, import_eagle3
from specjax.models import Transformer, TransformerConfig
from specjax.models.feature_draft import FeatureDraftConfig, from_target

CFG = TransformerConfig(
    vocab_size=61, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=48, max_len=64,
    rope_theta=500.0,
)  # fmt: skip
LAYERS = (1, 3, 4)  # vLLM ids (2, 4, 5): inputs of those layers
SCALING = {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_len': 32}
IDS = np.random.default_rng(0).choice(CFG.vocab_size, 17, replace=False)


@pytest.fixture(scope='module')
def target():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _draft(target, seed=1, cfg=CFG, **kw):
    kw.setdefault('feature_layers', LAYERS)
    draft = from_target(target, FeatureDraftConfig.for_target(cfg, **kw), rngs=nnx.Rngs(seed))
    draft.lm_head[...] = draft.lm_head[...] * 20.0  # logits of order 1, not 0.1
    for norm in (draft.first.input_norm, draft.first.hidden_norm, draft.final_norm):
        scale = norm.scale[...]  # norm weights that are not all ones
        noise = 0.3 * np.random.default_rng(seed).standard_normal(scale.shape)
        norm.scale[...] = (1 + noise).astype(scale.dtype)
    return draft


# ------------------------------------------------------------- vLLM's forward, rebuilt in torch


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x_BTHD, pos_BT, theta):
    d = x_BTHD.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = pos_BT.double()[..., None] * inv
    cos, sin = (
        torch.cat([freqs.cos()] * 2, -1)[:, :, None],
        torch.cat([freqs.sin()] * 2, -1)[:, :, None],
    )
    x1, x2 = x_BTHD.chunk(2, -1)
    return x_BTHD * cos + torch.cat([-x2, x1], -1) * sin  # neox (rotate-half) style


def _attention(w, pre, x, pos, c):
    b, t, _ = x.shape
    h, k = c['num_attention_heads'], c['num_key_value_heads']
    d = c['head_dim']
    q = _rope((x @ w[f'{pre}q_proj.weight'].T).view(b, t, h, d), pos, c['rope_theta'])
    kk = _rope((x @ w[f'{pre}k_proj.weight'].T).view(b, t, k, d), pos, c['rope_theta'])
    v = (x @ w[f'{pre}v_proj.weight'].T).view(b, t, k, d)
    kk, v = (a.repeat_interleave(h // k, dim=2) for a in (kk, v))  # GQA: head i reads i // (h/k)
    scores = torch.einsum('bthd,bshd->bhts', q, kk) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float('-inf'))
    out = torch.einsum('bhts,bshd->bthd', scores.softmax(-1), v).reshape(b, t, h * d)
    return out @ w[f'{pre}o_proj.weight'].T


def _mlp(w, pre, x):
    gate, up = x @ w[f'{pre}gate_proj.weight'].T, x @ w[f'{pre}up_proj.weight'].T
    return (torch.nn.functional.silu(gate) * up) @ w[f'{pre}down_proj.weight'].T


def vllm_eagle3(directory, input_ids, positions, hidden):
    """Eagle3LlamaForCausalLM in float64: hidden [B, T, 3E] (aux states: fc) or [B, T, E] (a
    fed-back state) -> (logits over the TARGET vocabulary via d2t, -inf elsewhere; prenorm)."""
    c = json.loads((directory / 'config.json').read_text())
    w = {n: torch.from_numpy(a.astype(np.float64) if a.dtype.kind == 'f' else a)
         for n, a in load_file(directory / 'model.safetensors').items()}  # fmt: skip
    w = {n.replace('midlayer.', 'layers.0.'): a for n, a in w.items()}  # vLLM's load_weights
    eps, pos = c['rms_norm_eps'], torch.as_tensor(positions)
    embeds = w['embed_tokens.weight'][torch.as_tensor(input_ids)]
    hidden = torch.as_tensor(hidden, dtype=torch.float64)
    if hidden.shape[-1] != embeds.shape[-1]:
        hidden = hidden @ w['fc.weight'].T  # combine_hidden_states
    residual = None
    for i in range(c['num_hidden_layers']):
        pre = f'layers.{i}.'
        if i == 0:
            emb = _rms(embeds, w[pre + 'input_layernorm.weight'], eps)
            normed = _rms(hidden, w[pre + 'hidden_norm.weight'], eps)
            residual = normed if c.get('norm_before_residual') else hidden
            x = torch.cat([emb, normed], -1)
        else:
            residual = hidden + residual
            x = _rms(residual, w[pre + 'input_layernorm.weight'], eps)
        residual = _attention(w, pre + 'self_attn.', x, pos, c) + residual
        hidden = _mlp(
            w, pre + 'mlp.', _rms(residual, w[pre + 'post_attention_layernorm.weight'], eps)
        )
    prenorm = hidden + residual
    logits = _rms(prenorm, w['norm.weight'], eps) @ w['lm_head.weight'].T
    d2t = w.get('d2t', torch.zeros(c['draft_vocab_size'], dtype=torch.long))
    full = torch.full((*logits.shape[:-1], c['vocab_size']), float('-inf'), dtype=torch.float64)
    full[..., torch.arange(c['draft_vocab_size']) + d2t] = logits  # compute_logits
    return full.numpy(), prenorm.numpy()


@pytest.mark.parametrize(
    'kw, ids',
    [({'draft_vocab_size': IDS.size}, IDS), ({'n_layers': 2, 'norm_before_residual': True}, None)],
    ids=['one-layer-reduced-vocab', 'two-layers-norm-before-residual-vllm-only'],
)  # fmt: skip
def test_exported_draft_computes_what_vllm_computes_from_the_files(target, tmp_path, kw, ids):
    """Random aux states (fc) and a fed-back state, at offset positions: the specjax draft's
    logits (scattered to the target vocabulary by draft_vocab_ids) and output state equal the
    rebuilt vLLM forward's. Tolerance: float32 against float64, measured spread <= 2.5e-6
    absolute."""
    draft = _draft(target, **kw)
    export_eagle3(draft, ids, tmp_path / 'd', vllm_only='n_layers' in kw)
    rng = np.random.default_rng(1)
    b, t = 2, 7
    tokens = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    # From position 1 on: specjax's entry 0 (c_0, zero feature) has no vLLM counterpart and is
    # seen by itself only; RoPE makes any common offset irrelevant.
    positions = (np.arange(t)[None] + np.array([[1], [5]])).astype(np.int32)
    aux = rng.standard_normal((b, t, 3, CFG.d_model)).astype(np.float32)
    fused = draft.fuse_features(aux)
    logits, state = draft(tokens, fused, positions)
    for hidden, ours in (
        (aux.reshape(b, t, -1), (logits, state)),
        (state, draft(tokens, state, positions)),
    ):
        ref_full, ref_state = vllm_eagle3(tmp_path / 'd', tokens, positions, hidden)
        our_full = np.full(ref_full.shape, -np.inf)
        our_full[..., np.arange(CFG.vocab_size) if ids is None else ids] = ours[0]
        np.testing.assert_allclose(our_full, ref_full, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(ours[1], ref_state, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ round trip and config.json


def _params(draft):
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(draft, nnx.Param))}


def _same(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.mark.parametrize(
    'dtype, scaling', [('float32', None), ('bfloat16', None), ('float32', SCALING)]
)
def test_round_trip_is_bit_exact(tmp_path, dtype, scaling):
    cfg = dataclasses.replace(CFG, dtype=dtype, param_dtype=dtype, rope_scaling=scaling)
    target = Transformer(cfg, rngs=nnx.Rngs(0))
    draft = _draft(target, cfg=cfg, draft_vocab_size=IDS.size, freeze_embedding=False)
    export_eagle3(draft, IDS, tmp_path / 'd')
    back, ids = import_eagle3(tmp_path / 'd', cfg)
    assert back.config == draft.config
    np.testing.assert_array_equal(ids, IDS)
    _same(back, draft)
    full = _draft(target, cfg=cfg, n_layers=3, norm_before_residual=True)
    export_eagle3(full, None, tmp_path / 'full', vllm_only=True)
    back, ids = import_eagle3(tmp_path / 'full', cfg)
    assert ids is None and back.config == full.config
    _same(back, full)


def test_config_and_tensors_are_named_as_the_loaders_read_them(target, tmp_path):
    draft = _draft(target, draft_vocab_size=IDS.size)
    export_eagle3(draft, IDS, tmp_path / 'd')
    c = json.loads((tmp_path / 'd' / 'config.json').read_text())
    e, hd = CFG.d_model, CFG.head_dim
    assert c['architectures'] == ['LlamaForCausalLMEagle3'] and c['model_type'] == 'llama'
    assert c['eagle_aux_hidden_state_layer_ids'] == [2, 4, 5]  # vLLM: inputs of layers
    assert c['eagle_config']['eagle_aux_hidden_state_layer_ids'] == [1, 3, 4]  # SGLang adds 1
    assert c['specjax']['feature_layers'] == [1, 3, 4]
    expect = {
        'hidden_size': e, 'target_hidden_size': e, 'intermediate_size': CFG.d_ff,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': hd,
        'num_hidden_layers': 1, 'vocab_size': 61, 'draft_vocab_size': 17,
        'rms_norm_eps': CFG.norm_eps, 'rope_theta': 500.0, 'max_position_embeddings': 64,
        'tie_word_embeddings': False, 'norm_before_residual': False, 'torch_dtype': 'float32',
    }  # fmt: skip
    assert {k: c[k] for k in expect} == expect
    hf = transformers.AutoConfig.from_pretrained(tmp_path / 'd')  # how both loaders read it
    assert isinstance(hf, transformers.LlamaConfig) and hf.head_dim == hd
    assert hf.eagle_aux_hidden_state_layer_ids == [2, 4, 5] and hf.draft_vocab_size == 17
    assert hf.target_hidden_size == e and hf.eagle_config['use_aux_hidden_state'] is True
    w = load_file(tmp_path / 'd' / 'model.safetensors')
    shapes = {n: list(a.shape) for n, a in w.items()}
    mid = 'midlayer.'
    assert shapes == {
        'embed_tokens.weight': [61, e], 'fc.weight': [e, 3 * e],
        mid + 'input_layernorm.weight': [e], mid + 'hidden_norm.weight': [e],
        mid + 'self_attn.q_proj.weight': [4 * hd, 2 * e],
        mid + 'self_attn.k_proj.weight': [2 * hd, 2 * e],
        mid + 'self_attn.v_proj.weight': [2 * hd, 2 * e],
        mid + 'self_attn.o_proj.weight': [e, 4 * hd],
        mid + 'post_attention_layernorm.weight': [e],
        mid + 'mlp.gate_proj.weight': [CFG.d_ff, e], mid + 'mlp.up_proj.weight': [CFG.d_ff, e],
        mid + 'mlp.down_proj.weight': [e, CFG.d_ff],
        'norm.weight': [e], 'lm_head.weight': [17, e], 'd2t': [17], 't2d': [61],
    }  # fmt: skip
    assert w['d2t'].dtype == np.int64 and w['t2d'].dtype == np.bool_
    np.testing.assert_array_equal(np.arange(17) + w['d2t'], IDS)
    assert w['t2d'].sum() == 17 and w['t2d'][IDS].all()


def test_vllm_layer_names_and_a_checkpoint_without_embedding_import(target, tmp_path):
    """vLLM also reads layer 0 as `layers.0.`; a file without embed_tokens takes the target's."""
    draft = _draft(target)
    export_eagle3(draft, None, tmp_path / 'd')
    file = tmp_path / 'd' / 'model.safetensors'
    w = load_file(file)
    emb = w.pop('embed_tokens.weight')
    save_file({n.replace('midlayer.', 'layers.0.'): a for n, a in w.items()}, file)
    with pytest.raises(ValueError, match="lacks tensor 'embed_tokens.weight'"):
        import_eagle3(tmp_path / 'd', CFG)
    back, _ = import_eagle3(tmp_path / 'd', CFG, target_embed=emb)
    _same(back, draft)


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    'kw, ids, vllm_only, match',
    [
        ({'feature_layers': (1, 3, 5)}, None, False, r'feature_layers=\(1, 3, 5\).*below'),
        ({'feature_layers': (3, 1, 4)}, None, False, r'feature_layers=\(3, 1, 4\).*ascending'),
        ({'feature_layers': (0, 1, 2, 3)}, None, False, 'need 3 ascending'),
        ({'n_layers': 2}, None, False, r'FeatureDraftConfig.n_layers=2.*vllm_only=True'),
        ({'norm_before_residual': True}, None, False, 'norm_before_residual=True'),
        ({'draft_vocab_size': 17}, None, False, 'draft_vocab_ids is None.*draft_vocab_size=17'),
        ({'draft_vocab_size': 17}, IDS[:16], False, r'draft_vocab_ids must be int \[17\]'),
        ({'draft_vocab_size': 2}, np.array([3, 3]), False, 'distinct target ids'),
    ],
)  # fmt: skip
def test_export_refuses_what_the_loaders_cannot_represent(
    target, tmp_path, kw, ids, vllm_only, match
):
    draft = _draft(target, **kw)
    with pytest.raises(ValueError, match=match):
        export_eagle3(draft, ids, tmp_path / 'd', vllm_only=vllm_only)
    assert not (tmp_path / 'd').exists()


def _edit_config(directory, **changes):
    path = directory / 'config.json'
    c = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    path.write_text(json.dumps(c))


def _edit_tensor(directory, name, fn):
    file = directory / 'model.safetensors'
    w = load_file(file)
    w[name] = fn(w[name])
    save_file(w, file)


def test_import_refuses_a_draft_that_does_not_fit_naming_the_field(target, tmp_path):
    draft = _draft(target, draft_vocab_size=IDS.size)
    export_eagle3(draft, IDS, tmp_path / 'd')
    d = tmp_path / 'd'
    wide = dataclasses.replace(CFG, d_model=48, head_dim=None)
    with pytest.raises(
        ValueError, match='target_hidden_size=32 is not the target width d_model=48'
    ):
        import_eagle3(d, wide)
    with pytest.raises(
        ValueError, match=r'vocab_size=61 does not match the target \(vocab_size=64'
    ):
        import_eagle3(d, dataclasses.replace(CFG, vocab_size=64))
    with pytest.raises(ValueError, match=r'intermediate_size=48 .*d_ff=96'):
        import_eagle3(d, dataclasses.replace(CFG, d_ff=96))
    with pytest.raises(ValueError, match='rope_theta=500.0'):
        import_eagle3(d, dataclasses.replace(CFG, rope_theta=1e4))
    for changes, match in (
        ({'architectures': ['LlamaForCausalLM']}, 'architectures='),
        ({'eagle_aux_hidden_state_layer_ids': [2, 4, 6]}, 'must differ by 1'),
        ({'eagle_config': {'eagle_aux_hidden_state_layer_ids': [1, 3, 6]},
          'eagle_aux_hidden_state_layer_ids': None, 'specjax': None}, r'\(1, 3, 6\).*n_layers=6'),
        ({'draft_vocab_size': 16}, r'tensor d2t must be int \[16\]'),
        ({'num_hidden_layers': 2}, "lacks tensor 'layers.1.self_attn.q_proj.weight'"),
    ):  # fmt: skip
        export_eagle3(draft, IDS, tmp_path / 'e')
        _edit_config(tmp_path / 'e', **changes)
        with pytest.raises(ValueError, match=match):
            import_eagle3(tmp_path / 'e', CFG)
        for p in (tmp_path / 'e').iterdir():
            p.unlink()
    for name, fn, match in (
        ('d2t', lambda a: 5 - np.arange(a.size, dtype=a.dtype), 'outside .* or twice'),
        ('t2d', lambda a: ~a, 'not the target-id mask of d2t'),
        ('fc.weight', lambda a: a[:, :64], r"'fc.weight' has shape \[32, 64\]"),
    ):
        export_eagle3(draft, IDS, tmp_path / 'e')
        _edit_tensor(tmp_path / 'e', name, fn)
        with pytest.raises(ValueError, match=match):
            import_eagle3(tmp_path / 'e', CFG)
        for p in (tmp_path / 'e').iterdir():
            p.unlink()


# ------------------------------------------------------------------ the export_eagle3 command


@pytest.fixture(scope='module')
def feature_run(tmp_path_factory):
    """(root, target config, results): test_feature_train's config and stub data (2 draft layers,
    20 ids), one step on the rows; a 4-layer target, so layers (0, 1, 2) are below its last."""
    root = tmp_path_factory.mktemp('eagle3_cli')
    cfg = dataclasses.replace(ft._target().config, n_layers=4)
    write_workdir(Transformer(cfg, rngs=nnx.Rngs(0)), ft._Tok(), str(root / 'target'), source={})
    (root / 'vocab.json').write_text(json.dumps({'ids': ft.IDS}))
    c = ft._config(root, steps=1, feature_layers=(0, 1, 2))
    c.distill.source = 'dataset'  # (the last step is evaluated and saved whatever the period)
    return root, cfg, feature_mode.run_feature_draft(c, str(root / 'feature'), data=ft._data())


def _cli(*args):
    return subprocess.run(
        [sys.executable, '-m', 'specjax.interop', 'export_eagle3', *map(str, args)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS='cpu'),
    )  # fmt: skip


def test_cli_exports_a_feature_draft_workdir_that_imports_back_bit_exactly(feature_run):
    root, cfg, _ = feature_run
    out = root / 'eagle3'
    run = _cli(f'--workdir={root / "feature"}', f'--out={out}', '--vllm_only')
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)['eagle_aux_hidden_state_layer_ids'] == [1, 2, 3]
    assert sorted(os.listdir(out)) == ['config.json', 'model.safetensors']
    draft, ids = feature_mode.load_feature_draft(str(root / 'feature'))
    back, back_ids = import_eagle3(out, cfg)
    assert back.config == draft.config and back_ids.tolist() == ids.tolist() == ft.IDS
    _same(back, draft)


def test_cli_refuses_in_one_line_and_writes_nothing(feature_run):
    root, _, _ = feature_run
    before = sorted(root.rglob('*'))
    for workdir, out, match in (
        ('target', 'e', ["no 'feature_draft_config' (mode='import'): not a", str(root)]),
        ('feature', 'e', ['FeatureDraftConfig.n_layers=2', 'SGLang', 'vllm_only']),
        ('missing', 'e', ['no checkpoint in', str(root / 'missing')]),
        ('feature', 'target', [f'--out={root / "target"}', 'is not an empty directory']),
    ):  # fmt: skip
        run = _cli(f'--workdir={root / workdir}', f'--out={root / out}')
        last = run.stderr.strip().splitlines()[-1]
        assert run.returncode == USER_ERROR_EXIT_CODE, run.stderr[-3000:]
        assert last.startswith('FATAL ') and all(m in last for m in match), last
        assert 'Traceback' not in run.stderr  # a refusal is one line
        assert sorted(root.rglob('*')) == before  # no --out, no partial sibling, nothing added


def test_feature_draft_results_carry_their_headline_metrics(feature_run):
    root, _, res = feature_run
    written = json.loads((root / 'feature' / 'results.json').read_text())
    with open(root / 'feature' / 'metrics.jsonl') as f:
        last_eval = [r for r in map(json.loads, f) if r['split'] == 'eval'][-1]
    assert headline_keys(written) == list(FEATURE_DRAFT_HEADLINE_METRICS) == headline_keys(res)
    for key in FEATURE_DRAFT_HEADLINE_METRICS:  # the evaluation's own numbers, nothing derived
        assert written[key] == last_eval[key] == res[key], key
    assert not [k for k in written if k.startswith(('tau', 'acceptance'))]  # no speculative run
    assert headline_keys(dict(written, alpha_step3=0.5))[-1] == 'alpha_step3'  # a longer unroll
