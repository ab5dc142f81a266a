"""A task's tables in a reduced vocabulary's index space: a reduced-vocabulary model served alone.

A draft trained on the N most frequent target ids (specjax.sampling.draft_vocab: index i means
target id ids[i]) reads and writes indices, not target ids, when it is served alone. Its stops
and grammar must then speak indices too: `restrict_task(tables, ids)` maps a TaskTables built
for the target's vocabulary (specjax.sampling.task.build) to one over the N indices. The
restricted law is the grammar restricted to the N tokens: in state s the allowed indices are
those whose target id the grammar allows in s; transitions keep their next states; stop ids
off the set are dropped (a row whose stop tokens are all off the set ends only at a terminal
state or its length); stop-string tables keep the columns of the N ids. A state is terminal
where it accepts and no index leads on (in the full vocabulary more tokens may follow; with
none of them available the document is complete as it stands). A state none of whose tokens
is in the set keeps an empty mask, which the constrained loop widens to every index
(specjax.sampling.constrain): the model then writes what the grammar does not allow, and the
row fails validation - a format failure of the reduced vocabulary, counted as such.

Pure numpy, on the host, before any compile.
"""

from __future__ import annotations

import numpy as np

from specjax.sampling.grammar import GrammarTables, _bucket
from specjax.sampling.task import TaskTables


def index_of(ids, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: target id -> index in `ids`, -1 off the set; ValueError naming the
    first id outside [0, vocab_size) or a repeated id."""
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or not len(ids):
        raise ValueError(f'restrict_task: ids must be a non-empty int [N] array, got {ids.shape}')
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f'restrict_task: ids[{i}]={int(ids[i])} outside the task vocabulary [0, {vocab_size})'
        )
    if len(np.unique(ids)) != len(ids):
        raise ValueError('restrict_task: ids has repeated token ids')
    table = np.full(vocab_size, -1, np.int64)
    table[ids] = np.arange(len(ids))
    return table


def restrict_grammar(g: GrammarTables, ids, vocab_size: int) -> GrammarTables:
    """The grammar's tables over the indices of `ids` (module docstring); vocab_size: the
    target vocabulary the tables were built for."""
    index = index_of(ids, vocab_size)
    n = len(index[index >= 0])
    states = len(g.final_S)
    sizes = np.diff(g.offsets_S1.astype(np.int64))
    src = np.repeat(np.arange(states), sizes)
    total = int(g.offsets_S1[-1])
    tok, dst = g.tokens_T[:total].astype(np.int64), g.next_T[:total]
    src = src[:total]
    new = index[np.minimum(tok, vocab_size - 1)]
    keep = (tok < vocab_size) & (new >= 0)
    src, new, dst = src[keep], new[keep], dst[keep]
    order = np.lexsort((new, src))
    src, new, dst = src[order], new[order], dst[order]
    counts = np.bincount(src, minlength=states)
    t_pad = _bucket(max(len(new), 1))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tokens = np.full(t_pad, n, np.int32)  # padding: in no state's row
    nxt = np.zeros(t_pad, np.int32)
    tokens[: len(new)], nxt[: len(new)] = new, dst
    words = -(-n // 32)
    bits = np.zeros((states, words), np.uint32)
    np.bitwise_or.at(bits, (src, new // 32), np.uint32(1) << (new % 32).astype(np.uint32))
    terminal = g.final_S & (counts == 0)
    return GrammarTables(
        allowed_SW=bits, offsets_S1=offsets, tokens_T=tokens, next_T=nxt, final_S=g.final_S,
        terminal_S=terminal, steps=int(n).bit_length(),
    )  # fmt: skip


def restrict_task(tables: TaskTables | None, ids, vocab_size: int) -> TaskTables | None:
    """`tables` (built for a model of vocab_size target ids) over the indices of `ids` [N]: the
    stops and grammar a reduced-vocabulary model served alone is bound to (its sampler's
    `with_task`). None stays None."""
    if tables is None:
        return None
    index = index_of(ids, vocab_size)
    stop = tables.stop
    mapped = np.where(stop.ids_RI >= 0, index[np.clip(stop.ids_RI, 0, vocab_size - 1)], -1)
    stop = stop.replace(ids_RI=mapped.astype(np.int32))
    if stop.ac_next_AV is not None:
        cols = np.asarray(ids, np.int64)
        stop = stop.replace(ac_next_AV=stop.ac_next_AV[:, cols], ac_hit_AV=stop.ac_hit_AV[:, cols])
    grammar = tables.grammar
    if grammar is not None:
        grammar = restrict_grammar(grammar, ids, vocab_size)
    return TaskTables(stop=stop, grammar=grammar)
