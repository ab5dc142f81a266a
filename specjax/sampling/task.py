"""A sampler's task: its stops and grammar as one pytree of jit arguments, and why rows end.

The samplers take `stops=` (a `Stops`, or one per row) and `grammar=` (a `Grammar`); `build`
checks them against each other and the model before anything compiles and returns the
`TaskTables` the compiled loop reads (None for neither: the plain program runs). Every check
raises one ValueError naming the argument and the value: stops of another tokenizer than the
grammar's (vocabulary digests differ), a tokenizer larger than the model's vocabulary, per-row
stops for a batch of another size. Under a grammar its tokenizer's eos id always ends a row.

`FinishReason` names the codes of `SampleOutput.finish_reason` (int32 [B]).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.sampling.grammar import Grammar, GrammarTables
from specjax.sampling.stops import Stops, StopTables, stop_tables


class FinishReason(enum.IntEnum):
    """Why a row ended: LENGTH (max_new_tokens; also where nothing else ended it), STOP_TOKEN
    (a stop token id or eos_id, kept), STOP_STRING (its last token completed a stop string),
    GRAMMAR (the grammar reached an accepting state with no way on). A token that ends a row
    for several reasons reports the first of STOP_TOKEN, STOP_STRING, GRAMMAR."""

    LENGTH = 0
    STOP_TOKEN = 1
    STOP_STRING = 2
    GRAMMAR = 3


@struct.dataclass
class TaskTables:
    """stop: StopTables (every task has one: at least the grammar's eos); grammar:
    GrammarTables or None."""

    stop: StopTables
    grammar: GrammarTables | None = None


@struct.dataclass
class TaskState:
    """Per row [B]: grammar (automaton state after the row's tokens; 0 without a grammar), ac
    (stop-string automaton state), finish (FinishReason of a finished row, else LENGTH)."""

    grammar: object
    ac: object
    finish: object


def build(grammar, stops, vocab_size: int, who: str) -> TaskTables | None:
    """The TaskTables of `grammar` (a Grammar or None) and `stops` (None, a Stops, or a sequence
    of Stops / None, one per row) for a model of `vocab_size` tokens; ValueError naming the
    argument before any compile."""
    if grammar is None and stops is None:
        return None
    if grammar is not None and not isinstance(grammar, Grammar):
        raise ValueError(f'{who}: grammar must be a specjax.sampling.Grammar, got {grammar!r}')
    rows = _rows(stops, who)
    digests = {s.digest for s in rows if s is not None}
    if len(digests) > 1:
        raise ValueError(f'{who}: per-row stops were built for different tokenizers {digests}')
    if grammar is not None:
        for s in rows:
            if s is not None and s.digest != grammar.digest:
                raise ValueError(
                    f'{who}: stops were built for a tokenizer with vocabulary digest {s.digest} '
                    f'but the grammar for {grammar.digest}: use one tokenizer for both'
                )
    extra = () if grammar is None else (grammar.eos_id,)
    tables = stop_tables(rows, vocab_size, extra_ids=extra)
    gtables = None if grammar is None else grammar.device_tables(vocab_size)
    return TaskTables(stop=tables, grammar=gtables)


def _rows(stops, who) -> list:
    if stops is None or isinstance(stops, Stops):
        return [stops]
    if isinstance(stops, str) or not isinstance(stops, Sequence) or not len(stops):
        raise ValueError(
            f'{who}: stops must be a Stops, or a non-empty sequence of one Stops (or None) per '
            f'row, got {stops!r}'
        )
    for i, s in enumerate(stops):
        if s is not None and not isinstance(s, Stops):
            raise ValueError(f'{who}: stops[{i}] must be a Stops or None, got {s!r}')
    return list(stops)


def check_rows(values, batch: int, who: str) -> None:
    """ValueError unless every TaskTables in a sampler's bound `values` holds one row of stops
    or `batch` of them (per-row stops must match the global batch)."""
    for v in values if isinstance(values, tuple) else ():
        if isinstance(v, TaskTables):
            rows = v.stop.ids_RI.shape[0]
            if rows not in (1, batch):
                raise ValueError(
                    f'{who}: stops holds {rows} per-row Stops for a batch of {batch} rows'
                )


def finish_from_eos(tokens_BN, lengths_B, eos_id):
    """FinishReason per row without a task: STOP_TOKEN where the last token is eos_id (-1: no
    eos), else LENGTH (jnp or np arrays)."""
    last = jnp.take_along_axis(tokens_BN, jnp.maximum(lengths_B - 1, 0)[:, None], axis=1)[:, 0]
    hit = (lengths_B > 0) & (last == eos_id)
    return jnp.where(hit, np.int32(FinishReason.STOP_TOKEN), np.int32(FinishReason.LENGTH))
