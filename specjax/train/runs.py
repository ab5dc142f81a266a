"""What every training mode (pretrain, distill, cotrain) shares around run_loop, inside the
workdir that specjax.workdir.opened holds: the mesh-rule check, the data it reads (RunData from
the real pipeline) and the host -> device batch placement."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from specjax.train.config import check_keys

LOGICAL_AXES = ('batch', 'length', 'vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp', 'norm')


def check_mesh_config(mesh) -> None:
    """ValueError unless config.mesh has axes/shape/rules and a rule for every logical axis."""
    check_keys(mesh, ('axes', 'shape', 'rules', 'draft_rules'), 'config.mesh')
    ruled = {name for name, _ in mesh.rules}
    missing = [a for a in LOGICAL_AXES if a not in ruled]
    if missing:
        raise ValueError(f'config.mesh.rules has no rule for logical axes {missing}')


@dataclasses.dataclass
class RunData:
    """What a training mode reads from the data layer (tests pass synthetic ones)."""

    train: Any  # iterator of host batch dicts (np.int32 [B/process_count, T]) with get/set_state
    eval_batches: list[dict]  # fixed held-out batches, same layout
    tokenizer: dict  # tokenizer identity (checked on resume; a teacher's must equal it)
    corpus: dict  # corpus identity (checked on resume)
    vocab_size: int  # tokenizer vocabulary size (a model's vocab_size must cover it)
    domains: tuple[str, ...]  # names of domain ids 0..D-1
    eos_id: int | None = None  # generation stops after eos (kept as the last generated token)
    baselines: dict[str, float] = dataclasses.field(default_factory=dict)  # validation nats


def load_data(config, *, num_eval_batches: int, baselines: bool = False) -> RunData:
    """RunData of the real pipeline (specjax.data) for config.data; `baselines`: the corpus's
    count-bigram / unigram validation losses too (pretrain reports them)."""
    from specjax import data as data_lib

    tok, train, eval_batches = open_pipeline(config, num_eval_batches=num_eval_batches)
    losses = data_lib.baseline_losses(config.data, tok, batches=eval_batches) if baselines else {}
    return RunData(
        train=train,
        eval_batches=eval_batches,
        tokenizer=tok.identity(),
        corpus=data_lib.corpus_identity(config.data),
        vocab_size=tok.vocab_size,
        domains=tuple(data_lib.open_dataset(config.data).domain_names),
        eos_id=tok.eos_id,
        baselines={k: float(losses[k]) for k in ('bigram', 'unigram') if k in losses},
    )


def check_vocab(model_cfg, data: RunData, field: str) -> None:
    """ValueError unless the model's vocabulary covers the tokenizer's (data.vocab_size)."""
    if model_cfg.vocab_size < data.vocab_size:
        raise ValueError(
            f'{field}.vocab_size={model_cfg.vocab_size} is below the tokenizer vocabulary '
            f'size {data.vocab_size}'
        )


def open_pipeline(config, *, num_eval_batches: int):
    """(tokenizer, train iterator, eval batches) of the real pipeline for config.data."""
    from specjax import data as data_lib

    tok = data_lib.build_tokenizer(config.data)
    train = data_lib.make_train_iterator(
        config.data, tok, global_batch_size=config.train.batch_size, seed=config.seed
    )
    eval_batches = list(
        data_lib.make_eval_batches(
            config.data,
            tok,
            global_batch_size=config.train.batch_size,
            max_batches=num_eval_batches,
        )
    )
    return tok, train, eval_batches


def batch_placer(b_sharding, keys):
    """host batch -> {key: global jax.Array} for `keys`, sharded by b_sharding (Task.put_batch)."""

    def put(batch):
        return {
            k: jax.make_array_from_process_local_data(b_sharding, np.asarray(batch[k]))
            for k in keys
        }

    return put


def train_flops(trained, frozen=(), *, seq_len: int, tokens: float) -> float:
    """Training FLOPs for `tokens` tokens of seq_len rows: forward + backward (3 x forward) of
    each trained TransformerConfig, one forward of each frozen one (a teacher). Generated
    continuations (distill sources teacher / on_policy) are not counted."""
    per_token = sum(3 * m.forward_flops_per_token(seq_len) for m in trained)
    per_token += sum(m.forward_flops_per_token(seq_len) for m in frozen)
    return float(per_token * tokens)
