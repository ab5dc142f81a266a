"""FeatureDraft <-> the EAGLE-3 draft checkpoints vLLM and SGLang load (`llama_eagle3.py`).

A directory of config.json + model.safetensors, named as both loaders read them (torch
`nn.Linear` weights are [out, in]; n = 3 feature layers, D the head dim):

    embed_tokens.weight                     [V, E]        embed (vLLM loads it when present;
                                                          SGLang shares the target's)
    fc.weight                               [E, n*E]      fuse [n*E, E]
    midlayer.input_layernorm.weight         [E]           first.input_norm.scale
    midlayer.hidden_norm.weight             [E]           first.hidden_norm.scale
    midlayer.self_attn.{q,k,v}_proj.weight  [heads*D, 2E] first.attn.{q,k,v} [2E, heads, D]
    midlayer.self_attn.o_proj.weight        [E, H*D]      first.attn.o [H, D, E]
    midlayer.post_attention_layernorm.weight [E]          first.post_norm.scale
    midlayer.mlp.{gate,up,down}_proj.weight [F,E]/[E,F]   first.mlp.{gate,up,down}
    layers.{i}.*  (i >= 1; vLLM only)       Llama names   blocks[i - 1]
    norm.weight                             [E]           final_norm.scale
    lm_head.weight                          [V_d, E]      lm_head [E, V_d]
    d2t  int64 [V_d]   target id of draft id i = i + d2t[i]  (reduced vocabularies only)
    t2d  bool  [V]     which target ids the draft vocabulary holds

vLLM maps `midlayer.` to `layers.0.`, SGLang loads `midlayer.` only, so layer 0 is written as
`midlayer.` (both names are read back). RoPE uses the rotate-half layout on both sides: q and k
need no permutation (specjax.interop.convert).

Feature layers. specjax's feature_layers are the blocks whose OUTPUT is read. vLLM's LlamaModel
captures `eagle_aux_hidden_state_layer_ids` (top-level in config.json, read first) at the INPUT
of those layers (hidden_states + residual before layer id), so ids = feature_layers + 1; SGLang
reads `eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 itself, so there ids =
feature_layers. Both concatenate the captured states in layer order and neither can capture the
last block's output, so export needs 3 ascending layers below target n_layers - 1. The mapping is
recorded under config.json's `specjax` key and checked on import.

Later layers. vLLM builds layers 1.. as standard Llama layers (specjax Block); SGLang's loader
builds them differently (a norm of the previous MLP output, the residual reset) and silently
skips the `layers.{i}` names, as it has no norm_before_residual option: export refuses
n_layers > 1 or norm_before_residual unless `vllm_only=True`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specjax.interop.convert import config_from_hf, hf_config_from
from specjax.interop.errors import CorruptModelFileError
from specjax.interop.hf import WEIGHTS, read_json
from specjax.interop.integrity import check_finite, check_safetensors
from specjax.interop.staging import staged
from specjax.models import TransformerConfig
from specjax.models.feature_draft import FeatureDraft, FeatureDraftConfig

ARCHITECTURES = ('LlamaForCausalLMEagle3', 'Eagle3LlamaForCausalLM')  # SGLang's, vLLM's alias
N_FEATURES = 3  # both loaders' fc reads 3 * target_hidden_size


def _specs(cfg: FeatureDraftConfig):
    """(name, shape, state path, to_specjax, to_torch) of every parameter, in file order."""
    t = cfg.target
    v, e, h, k, d, f = t.vocab_size, t.d_model, t.n_heads, t.n_kv_heads, t.head_dim, t.d_ff
    n, same, tr = len(cfg.feature_layers), (lambda w: w), np.transpose
    yield 'embed_tokens.weight', (v, e), ('embed',), same, same
    yield 'fc.weight', (e, n * e), ('fuse',), tr, tr

    def layer(pre, path, width, norms):
        for name, heads in (('q', h), ('k', k), ('v', k)):
            yield (
                f'{pre}self_attn.{name}_proj.weight', (heads * d, width), (*path, 'attn', name),
                lambda w, hs=heads: w.T.reshape(width, hs, d),
                lambda w, hs=heads: w.reshape(width, hs * d).T,
            )  # fmt: skip
        yield (
            f'{pre}self_attn.o_proj.weight', (e, h * d), (*path, 'attn', 'o'),
            lambda w: w.T.reshape(h, d, e), lambda w: w.reshape(h * d, e).T,
        )  # fmt: skip
        for name, shape in (('gate', (f, e)), ('up', (f, e)), ('down', (e, f))):
            yield f'{pre}mlp.{name}_proj.weight', shape, (*path, 'mlp', name), tr, tr
        for hf_name, ours in norms:
            yield f'{pre}{hf_name}.weight', (e,), (*path, ours, 'scale'), same, same

    yield from layer('midlayer.', ('first',), 2 * e, (
        ('input_layernorm', 'input_norm'), ('hidden_norm', 'hidden_norm'),
        ('post_attention_layernorm', 'post_norm'),
    ))  # fmt: skip
    for i in range(1, cfg.n_layers):
        yield from layer(f'layers.{i}.', ('blocks', i - 1), e, (
            ('input_layernorm', 'attn_norm'), ('post_attention_layernorm', 'mlp_norm'),
        ))  # fmt: skip
    yield 'norm.weight', (e,), ('final_norm', 'scale'), same, same
    yield 'lm_head.weight', (cfg.vocab_size, e), ('lm_head',), tr, tr


def _check_vocab_ids(ids, cfg: FeatureDraftConfig) -> np.ndarray | None:
    v = cfg.target.vocab_size
    if ids is None:
        if cfg.vocab_size != v:
            raise ValueError(
                f'draft_vocab_ids is None but FeatureDraftConfig.draft_vocab_size='
                f'{cfg.draft_vocab_size} (a reduced vocabulary needs its ids for d2t)'
            )
        return None
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in 'iu' or ids.shape[0] != cfg.vocab_size:
        raise ValueError(
            f'draft_vocab_ids must be int [{cfg.vocab_size}] (FeatureDraftConfig.vocab_size), '
            f'got {ids.dtype} {list(ids.shape)}'
        )
    if ids.size and (ids.min() < 0 or ids.max() >= v or np.unique(ids).size != ids.size):
        raise ValueError(f'draft_vocab_ids must be distinct target ids in [0, vocab_size={v})')
    return ids.astype(np.int64)


def export_eagle3(
    draft: FeatureDraft, draft_vocab_ids, out_dir: str | os.PathLike, *, vllm_only: bool = False
) -> Path:
    """Writes `out_dir` (config.json + model.safetensors) for vLLM's and SGLang's EAGLE-3
    loaders; parameters in their own dtype. draft_vocab_ids: None (the draft predicts the whole
    target vocabulary) or the int [N] target ids of draft indices 0..N-1. ValueError naming the
    field for what the loaders cannot represent (module docstring); written whole or not at all
    (specjax.interop.staging). Returns the directory."""
    cfg, t = draft.config, draft.config.target
    layers = cfg.feature_layers
    if len(layers) != N_FEATURES or list(layers) != sorted(layers) or layers[-1] > t.n_layers - 2:
        raise ValueError(
            f'FeatureDraftConfig.feature_layers={layers}: the loaders need {N_FEATURES} '
            f'ascending blocks below target n_layers - 1 = {t.n_layers - 1} (they capture the '
            'input of block l + 1, in layer order)'
        )
    if not vllm_only and (cfg.n_layers > 1 or cfg.norm_before_residual):
        field = 'n_layers' if cfg.n_layers > 1 else 'norm_before_residual'
        raise ValueError(
            f"FeatureDraftConfig.{field}={getattr(cfg, field)}: SGLang's llama_eagle3 loader "
            'supports only one draft layer without norm_before_residual (it would compute a '
            'different model); pass vllm_only=True to write the layout only vLLM loads'
        )
    ids = _check_vocab_ids(draft_vocab_ids, cfg)
    flat = dict(nnx.to_flat_state(nnx.state(draft, nnx.Param)))
    tensors = {}
    for name, _, path, _, to_torch in _specs(cfg):
        tensors[name] = np.ascontiguousarray(to_torch(np.asarray(flat.pop(path).get_value())))
    if flat:  # a parameter the table does not name would be lost silently
        raise AssertionError(f'export_eagle3 has no checkpoint name for {sorted(flat)}')
    if ids is not None:
        tensors['d2t'] = ids - np.arange(ids.size, dtype=np.int64)
        t2d = np.zeros(t.vocab_size, bool)
        t2d[ids] = True
        tensors['t2d'] = t2d
    with staged(os.fspath(out_dir)) as directory:
        save_file(tensors, os.path.join(directory, WEIGHTS), metadata={'format': 'pt'})
        with open(os.path.join(directory, 'config.json'), 'w') as fh:
            fh.write(json.dumps(_config_json(cfg), indent=2) + '\n')
    return Path(out_dir)


def _config_json(cfg: FeatureDraftConfig) -> dict:
    """convert's Llama config.json of the draft's decoder (width, heads, MLP, norm, RoPE in
    both transformers 4's and 5's keys, dtype) plus the EAGLE-3 fields the loaders read."""
    t = cfg.target
    return hf_config_from(cfg.decoder) | {
        'architectures': [ARCHITECTURES[0]],
        'target_hidden_size': t.d_model,
        'vocab_size': t.vocab_size,
        'draft_vocab_size': cfg.vocab_size,  # always set: SGLang takes the target's head if null
        'tie_word_embeddings': False,
        'norm_before_residual': cfg.norm_before_residual,
        'eagle_aux_hidden_state_layer_ids': [i + 1 for i in cfg.feature_layers],  # vLLM
        'eagle_config': {  # SGLang (adds 1 itself); vLLM reads the top-level key first
            'eagle_aux_hidden_state_layer_ids': list(cfg.feature_layers),
            'use_aux_hidden_state': True,
        },
        'specjax': {
            'feature_layers': list(cfg.feature_layers),
            'feature_layers_mapping': 'eagle_aux_hidden_state_layer_ids = feature_layers + 1; '
            'eagle_config.eagle_aux_hidden_state_layer_ids = feature_layers',
            'freeze_embedding': cfg.freeze_embedding,
        },
    }


def _feature_layers(c: dict, n_target: int, where: str) -> tuple[int, ...]:
    """specjax feature_layers from the loaders' ids (module docstring); ValueError if the
    vLLM and SGLang ids disagree."""
    top = c.get('eagle_aux_hidden_state_layer_ids')
    nested = (c.get('eagle_config') or {}).get('eagle_aux_hidden_state_layer_ids')
    if top:
        layers = tuple(int(i) - 1 for i in top)
        if nested and tuple(int(i) for i in nested) != layers:
            raise ValueError(
                f'{where} eagle_aux_hidden_state_layer_ids={list(top)} (vLLM: inputs of layers) '
                f'and eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (SGLang: '
                'outputs) name different target layers; they must differ by 1'
            )
    elif nested:
        layers = tuple(int(i) for i in nested)
    else:  # both loaders' default capture: inputs of (2, n // 2, n - 3)
        layers = (1, n_target // 2 - 1, n_target - 4)
    recorded = (c.get('specjax') or {}).get('feature_layers')
    if recorded is not None and tuple(recorded) != layers:
        raise ValueError(
            f'{where} specjax.feature_layers={recorded} disagrees with its eagle ids ({layers})'
        )
    return layers


def _check_matches_target(c: dict, t: TransformerConfig, where: str) -> None:
    """ValueError naming the config.json field that differs from what a FeatureDraft of `t`
    computes (its width, heads, MLP, norm, RoPE and vocabulary are the target's)."""
    if not set(c.get('architectures') or []) & set(ARCHITECTURES):
        raise ValueError(
            f'{where} architectures={c.get("architectures")!r}: not one of {ARCHITECTURES}'
        )
    if c.get('tie_word_embeddings'):
        raise ValueError(f'{where} tie_word_embeddings=true: an EAGLE-3 draft has its own head')
    if (c.get('eagle_config') or {}).get('use_aux_hidden_state', True) is not True:
        raise ValueError(f'{where} eagle_config.use_aux_hidden_state must be true')
    target_width = c.get('target_hidden_size', c.get('hidden_size'))
    if target_width != t.d_model:
        raise ValueError(
            f'{where} target_hidden_size={target_width!r} is not the target width d_model='
            f'{t.d_model}'
        )
    # the draft's decoder is a Llama config: convert's reader checks biases, activation, RoPE
    llama = config_from_hf(
        {**c, 'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'},
        dtype=t.param_dtype, where=where,
    )  # fmt: skip
    fields = {
        'hidden_size': 'd_model', 'intermediate_size': 'd_ff', 'num_attention_heads': 'n_heads',
        'num_key_value_heads': 'n_kv_heads', 'head_dim': 'head_dim', 'vocab_size': 'vocab_size',
        'rms_norm_eps': 'norm_eps', 'rope_theta': 'rope_theta', 'rope_scaling': 'rope_scaling',
    }  # fmt: skip
    for key, ours in fields.items():
        got, want = getattr(llama, ours), getattr(t, ours)
        if got != want:
            raise ValueError(
                f'{where} {key}={got!r} does not match the target ({ours}={want!r}); a specjax '
                "FeatureDraft has its target's width, heads, MLP, norm, RoPE and vocabulary"
            )


def import_eagle3(
    path: str | os.PathLike, target_config: TransformerConfig, *, target_embed=None
) -> tuple[FeatureDraft, np.ndarray | None]:
    """(FeatureDraft, draft_vocab_ids int64 [N] or None) from an EAGLE-3 draft directory for a
    target of `target_config`; parameters in target_config.param_dtype. A checkpoint without
    embed_tokens takes `target_embed` [V, E] (the target's table, as the loaders do). ValueError
    naming the config field or tensor for a draft that does not fit the target, a missing,
    misshapen or unexpected tensor, or a d2t / t2d pair that is not one vocabulary map;
    CorruptModelFileError for a truncated file or a NaN."""
    directory = Path(path)
    where = f'config.json at {directory / "config.json"}'
    if not (directory / 'config.json').is_file():
        raise FileNotFoundError(f'{directory} has no config.json (an EAGLE-3 draft directory)')
    c = read_json(directory / 'config.json')
    if not isinstance(c, dict):
        raise CorruptModelFileError(directory / 'config.json', 'it is not a JSON object')
    _check_matches_target(c, target_config, where)
    n_layers = c.get('num_hidden_layers')
    v = target_config.vocab_size
    v_d = c.get('draft_vocab_size') or v
    file = directory / WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f'{directory} has no {WEIGHTS}')
    check_safetensors(str(file))
    with contextlib.ExitStack() as stack:
        try:
            handle = stack.enter_context(safe_open(file, framework='np'))
            names = set(handle.keys())
        except SafetensorError as e:
            raise CorruptModelFileError(file, f'safetensors cannot open it: {e}') from e

        def get(name):
            try:
                w = handle.get_tensor(name)
            except SafetensorError as e:
                raise CorruptModelFileError(file, f'cannot read it: {e}', tensor=name) from e
            check_finite(file, name, w)
            return w

        ids = _vocab_ids(get, names, v, v_d, where)
        try:
            cfg = FeatureDraftConfig.for_target(
                target_config, feature_layers=_feature_layers(c, target_config.n_layers, where),
                n_layers=n_layers, draft_vocab_size=None if ids is None else int(v_d),
                freeze_embedding=bool((c.get('specjax') or {}).get('freeze_embedding', True)),
                norm_before_residual=bool(c.get('norm_before_residual', False)),
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f'{where}: {e}') from None
        if len(cfg.feature_layers) != N_FEATURES:
            raise ValueError(
                f'{where} names {len(cfg.feature_layers)} aux layers, not {N_FEATURES}'
            )
        if ids is None and v_d != v:
            raise ValueError(f'{where} draft_vocab_size={v_d} < vocab_size={v} but there is no d2t')
        abstract = nnx.eval_shape(lambda: FeatureDraft(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        flat = dict(nnx.to_flat_state(state))
        dtype = jnp.dtype(target_config.param_dtype)
        seen = {'d2t', 't2d'}
        for name, shape, spath, to_specjax, _ in _specs(cfg):
            stored = name
            if name not in names and name.startswith('midlayer.'):
                stored = 'layers.0.' + name[len('midlayer.') :]  # vLLM's own name for layer 0
            if stored in names:
                w = np.asarray(get(stored))
            elif name == 'embed_tokens.weight' and target_embed is not None:
                w = np.asarray(target_embed)
            else:
                raise ValueError(f'{file} lacks tensor {name!r}')
            seen.add(stored)
            if tuple(w.shape) != shape:
                raise ValueError(
                    f'{file}: tensor {stored!r} has shape {list(w.shape)}, expected {list(shape)}'
                )
            flat[spath].set_value(jnp.asarray(to_specjax(w), dtype=dtype))
        unexpected = sorted(names - seen)
        if unexpected:
            raise ValueError(f'{file} has tensors a specjax FeatureDraft lacks: {unexpected[:6]}')
        return nnx.merge(graphdef, nnx.from_flat_state(flat)), ids


def _vocab_ids(get, names, v: int, v_d: int, where: str) -> np.ndarray | None:
    """draft_vocab_ids from d2t (checked against t2d when present), or None without d2t."""
    if 'd2t' not in names:
        if 't2d' in names:
            raise ValueError(f'{where}: the checkpoint has t2d but no d2t')
        return None
    d2t = np.asarray(get('d2t'))
    if d2t.dtype.kind not in 'iu' or d2t.shape != (v_d,):
        raise ValueError(
            f'tensor d2t must be int [{v_d}] (draft_vocab_size), got {d2t.dtype} {list(d2t.shape)}'
        )
    ids = np.arange(v_d, dtype=np.int64) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= v or np.unique(ids).size != ids.size:
        raise ValueError(f'tensor d2t maps draft ids outside [0, vocab_size={v}) or twice')
    if 't2d' in names:
        t2d = np.asarray(get('t2d'))
        want = np.zeros(v, bool)
        want[ids] = True
        if t2d.shape != (v,) or not np.array_equal(t2d.astype(bool), want):
            raise ValueError(f'tensor t2d {list(t2d.shape)} is not the target-id mask of d2t')
    return ids
