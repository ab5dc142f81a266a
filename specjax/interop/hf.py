"""Hugging Face Llama directories in and out: config.json plus safetensors (one file or shards).

Only safetensors are read: a directory holding only pickle weights (`*.bin`, `*.pt`, `*.pth`,
`*.ckpt`) is refused, and nothing ever unpickles. Tensors are read lazily, one at a time, with the
`safetensors` numpy API (bfloat16 arrives as an `ml_dtypes.bfloat16` array, no torch needed) and
go through the one mapping in `specjax.interop.convert`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specjax.interop.convert import (
    config_from_hf,
    hf_config_from,
    model_from_tensors,
    tensor_specs,
    tensors_from_model,
)
from specjax.interop.errors import CorruptModelFileError
from specjax.interop.integrity import check_finite, check_safetensors
from specjax.models import Transformer

INDEX = 'model.safetensors.index.json'
WEIGHTS = 'model.safetensors'
PICKLE_SUFFIXES = ('.bin', '.pt', '.pth', '.ckpt', '.pkl')
# Buffers some checkpoints store that carry no parameters (recomputed from the config).
_IGNORED = re.compile(r'(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq')


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF directory; ValueError for pickle-only, FileNotFoundError."""
    if (directory / INDEX).is_file():
        index = read_json(directory / INDEX)
        weight_map = index.get('weight_map') if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CorruptModelFileError(directory / INDEX, 'it has no "weight_map" object')
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f'{directory / INDEX} names shard(s) {absent} that are absent')
        return files
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    found = sorted(directory.glob('*.safetensors'))
    if found:
        return found
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f'{directory} holds only pickle weights ({", ".join(pickles)}); specjax reads '
            'safetensors only and never unpickles. Convert them where you trust the file, e.g. '
            "transformers' `model.save_pretrained(out_dir, safe_serialization=True)`."
        )
    raise FileNotFoundError(f'{directory} has no {WEIGHTS}, {INDEX} or *.safetensors file')


def import_llama(path: str | os.PathLike, *, dtype: str | None = None) -> Transformer:
    """A Transformer from a Llama-architecture HF directory (config.json + safetensors).

    dtype (compute and parameter storage) defaults to the checkpoint's own dtype. Unsupported
    configurations, missing config keys, missing, misshapen or unexpected tensors raise
    ValueError naming them (and config.json's path); a config.json, index or safetensors file
    that is truncated or malformed raises CorruptModelFileError (a ValueError) naming the file
    and the tensor, before any tensor is read; so does a tensor holding NaN or Inf.
    """
    directory = Path(path)
    config = directory / 'config.json'
    if not config.is_file():
        raise FileNotFoundError(f'{directory} has no config.json (a Hugging Face model directory)')
    hf_config = read_json(config)
    if not isinstance(hf_config, dict):
        raise CorruptModelFileError(config, 'it is not a JSON object')
    cfg = config_from_hf(hf_config, dtype=dtype, where=f'config.json at {config}')
    files = weight_files(directory)
    for file in files:
        check_safetensors(file)  # every tensor's bytes inside the file, before any is read
    with contextlib.ExitStack() as stack:
        where = {}  # tensor name -> (file, open safetensors file)
        for file in files:
            try:
                handle = stack.enter_context(safe_open(file, framework='np'))
                names = list(handle.keys())
            except SafetensorError as e:
                raise CorruptModelFileError(file, f'safetensors cannot open it: {e}') from e
            where.update(dict.fromkeys(names, (file, handle)))
        expected = {spec.name for spec in tensor_specs(cfg)}
        unexpected = sorted(
            n for n in set(where) - expected if not _IGNORED.fullmatch(n) and n != 'lm_head.weight'
        )
        if unexpected:
            raise ValueError(
                f'{directory} has tensors a specjax Llama lacks, e.g. {unexpected[:4]} '
                f'({len(unexpected)} in all); biases or other architectures are not supported'
            )

        def get_tensor(name):
            file, handle = where[name]  # KeyError when absent
            try:
                w = handle.get_tensor(name)
            except SafetensorError as e:
                raise CorruptModelFileError(
                    file, f'safetensors cannot read it: {e}', tensor=name
                ) from e
            check_finite(file, name, w)
            return w

        return model_from_tensors(cfg, get_tensor)


def read_json(path: Path):
    """The parsed JSON file; CorruptModelFileError naming it if it is not valid JSON."""
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptModelFileError(path, f'it is not valid JSON ({e})') from e


def export_llama(model: Transformer, path: str | os.PathLike, tokenizer=None) -> Path:
    """Writes a directory that `transformers.LlamaForCausalLM.from_pretrained` loads.

    config.json and model.safetensors (the parameters in their own dtype); with a tokenizer (any
    object with `save(directory)`, e.g. specjax's Hugging Face tokenizer) also its files, its
    bos/eos/pad ids in config.json and a generation_config.json. Returns the directory.
    """
    if tokenizer is not None and not callable(getattr(tokenizer, 'save', None)):
        raise TypeError(
            f'export_llama(tokenizer=...) needs an object with save(directory) writing '
            f'tokenizer.json, got {type(tokenizer).__name__}'
        )
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config_from(model.config)
    if tokenizer is not None:
        ids = {
            'bos_token_id': int(tokenizer.bos_id),
            'eos_token_id': int(tokenizer.eos_id),
            'pad_token_id': int(tokenizer.pad_id),
        }
        config.update(ids)
        (directory / 'generation_config.json').write_text(json.dumps(ids, indent=2) + '\n')
        tokenizer.save(directory)
    save_file(tensors_from_model(model), directory / WEIGHTS, metadata={'format': 'pt'})
    (directory / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
    return directory
