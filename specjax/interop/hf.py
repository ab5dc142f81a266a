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

from safetensors import safe_open
from safetensors.numpy import save_file

from specjax.interop.convert import (
    config_from_hf,
    hf_config_from,
    model_from_tensors,
    tensor_specs,
    tensors_from_model,
)
from specjax.models import Transformer

INDEX = 'model.safetensors.index.json'
WEIGHTS = 'model.safetensors'
PICKLE_SUFFIXES = ('.bin', '.pt', '.pth', '.ckpt', '.pkl')
# Buffers some checkpoints store that carry no parameters (recomputed from the config).
_IGNORED = re.compile(r'(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq')


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF directory; ValueError for pickle-only, FileNotFoundError."""
    if (directory / INDEX).is_file():
        index = json.loads((directory / INDEX).read_text())
        return [directory / name for name in sorted(set(index['weight_map'].values()))]
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
    configurations, missing, misshapen or unexpected tensors raise ValueError naming them.
    """
    directory = Path(path)
    if not (directory / 'config.json').is_file():
        raise FileNotFoundError(f'{directory} has no config.json (a Hugging Face model directory)')
    cfg = config_from_hf(json.loads((directory / 'config.json').read_text()), dtype=dtype)
    files = weight_files(directory)
    with contextlib.ExitStack() as stack:
        where = {}  # tensor name -> open safetensors file
        for file in files:
            handle = stack.enter_context(safe_open(file, framework='np'))
            where.update(dict.fromkeys(handle.keys(), handle))
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
            return where[name].get_tensor(name)  # KeyError when absent

        return model_from_tensors(cfg, get_tensor)


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
