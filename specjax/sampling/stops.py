"""Stop conditions: stop token ids, stop strings and a minimum length, as device tables.

`Stops(tokenizer, strings=(), token_ids=(), min_new_tokens=0)` says when a row ends: at the first
token that is one of `token_ids` or that completes one of `strings` in the decoded output, but not
before the row holds `min_new_tokens` tokens (stop tokens are masked out of both models'
distributions until then, and a string completed earlier does not count). The token that ends a
row is kept. A string may span any number of tokens and be completed by any tokenisation of it:
it is matched on the bytes of decoded text (specjax.data.tokenizers.token_bytes), from the first
generated token on (the prompt never counts).

Matching runs on the device from per-token tables (`StopTables`): an Aho-Corasick automaton over
the bytes of every row's strings (A states: one per distinct prefix) and, for each state a and
token v, the state after feeding v's bytes (`ac_next_AV` int32 [A, V]) and the bitmask of strings
completed on the way (`ac_hit_AV` uint32 [A, V]); a row's own strings are a bitmask
(`strings_R`), so rows may stop on different strings. One table lookup per generated token.
The automaton's states are padded to a power of two (at least 8) and each row's stop ids to a
multiple of 4, so stops of similar sizes share one compiled program.
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Sequence

import numpy as np
from flax import struct

from specjax.data.tokenizers import token_bytes, vocabulary_digest

MAX_STRINGS = 32  # distinct stop strings over all rows (bits of a uint32)
DEFAULT_MAX_BYTES = 64 << 20  # device bytes of the stop-string tables


class Stops:
    """When rows end (module docstring). `strings` str or a sequence of non-empty str,
    `token_ids` ints in [0, vocab_size), `min_new_tokens` int >= 0; ValueError naming the field
    and value otherwise. The eos id is not added: pass it in token_ids (or the samplers' eos_id).
    """

    def __init__(self, tokenizer, strings=(), token_ids=(), min_new_tokens: int = 0):
        self._pieces = token_bytes(tokenizer)
        self.vocab_size, self.digest = len(self._pieces), vocabulary_digest(tokenizer)
        strings = (strings,) if isinstance(strings, str) else tuple(strings)
        for i, s in enumerate(strings):
            if not isinstance(s, str) or not s:
                raise ValueError(f'Stops.strings[{i}]={s!r}: stop strings must be non-empty str')
        ids = (token_ids,) if isinstance(token_ids, numbers.Integral) else tuple(token_ids)
        for i, t in enumerate(ids):
            ok = isinstance(t, numbers.Integral) and not isinstance(t, bool)
            if not ok or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f'Stops.token_ids[{i}]={t!r} is not a token id of this tokenizer '
                    f'[0, vocab_size={self.vocab_size})'
                )
        m = min_new_tokens
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
            raise ValueError(f'Stops.min_new_tokens must be an int >= 0, got {m!r}')
        self.strings = tuple(dict.fromkeys(strings))
        self.token_ids = tuple(dict.fromkeys(int(t) for t in ids))
        self.min_new_tokens = int(m)

    @property
    def pieces(self) -> tuple[bytes, ...]:
        """Each token id's bytes (what the strings are matched against)."""
        return self._pieces

    def __repr__(self) -> str:
        return (
            f'Stops(strings={self.strings!r}, token_ids={self.token_ids!r}, '
            f'min_new_tokens={self.min_new_tokens})'
        )


@struct.dataclass
class StopTables:
    """Stops of R rows (R = 1: every row alike) as jit arguments. ids_RI int32 [R, I]: each
    row's stop token ids (-1 padded); min_new_R int32 [R]; strings_R uint32 [R]: the row's
    strings as bits of the automaton's outputs; ac_next_AV int32 [A, V] / ac_hit_AV uint32
    [A, V] (module docstring), or None when no row has a stop string. `min_new` (static): some
    row has min_new_tokens > 0, so stop tokens are masked until then."""

    ids_RI: np.ndarray
    min_new_R: np.ndarray
    strings_R: np.ndarray | None = None
    ac_next_AV: np.ndarray | None = None
    ac_hit_AV: np.ndarray | None = None
    min_new: bool = struct.field(pytree_node=False, default=False)


def stop_tables(
    rows: Sequence[Stops | None], vocab_size: int, extra_ids=(), max_bytes=DEFAULT_MAX_BYTES
) -> StopTables:
    """The tables of one Stops per row (None: no stops but `extra_ids`) for a model of
    `vocab_size` tokens; `extra_ids` (e.g. a grammar's eos) stop every row."""
    for r, stops in enumerate(rows):
        if stops is not None and stops.vocab_size > vocab_size:
            raise ValueError(
                f'stops[{r}]: built for a tokenizer of {stops.vocab_size} tokens, but the model '
                f'has vocab_size={vocab_size}'
            )
    present = [s for s in rows if s is not None]
    ids = [
        list(dict.fromkeys((*(s.token_ids if s else ()), *extra_ids))) or [-1] for s in rows
    ]  # fmt: skip
    width = -(-max(len(i) for i in ids) // 4) * 4  # padded: similar stops share a program
    ids_RI = np.array([i + [-1] * (width - len(i)) for i in ids], np.int32)
    min_new_R = np.array([s.min_new_tokens if s else 0 for s in rows], np.int32)
    strings = list(dict.fromkeys(x for s in present for x in s.strings))
    tables = StopTables(ids_RI=ids_RI, min_new_R=min_new_R, min_new=bool(min_new_R.any()))
    if not strings:
        return tables
    if len(strings) > MAX_STRINGS:
        raise ValueError(
            f'stops: {len(strings)} distinct stop strings over all rows, at most {MAX_STRINGS}'
        )
    index = {s: i for i, s in enumerate(strings)}
    masks = [sum(1 << index[x] for x in s.strings) if s else 0 for s in rows]
    delta, out = automaton([s.encode('utf-8') for s in strings])
    states = max(8, 1 << (len(delta) - 1).bit_length())  # padded to a power of two, as above
    need = states * vocab_size * 8
    if need > max_bytes:
        raise ValueError(
            f'stops: the stop-string tables need {need / 2**20:.1f} MiB ({states} automaton '
            f'states x {vocab_size} tokens), over {max_bytes / 2**20:.1f} MiB: use fewer or '
            'shorter stop strings'
        )
    pieces = present[0].pieces + (b'',) * (vocab_size - present[0].vocab_size)
    next_AV, hit_AV = token_transitions(delta, out, pieces)
    pad = ((0, states - len(delta)), (0, 0))  # states no token reaches
    next_AV, hit_AV = np.pad(next_AV, pad), np.pad(hit_AV, pad)
    return tables.replace(
        strings_R=np.array(masks, np.uint32), ac_next_AV=next_AV, ac_hit_AV=hit_AV
    )


def automaton(patterns: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick over bytes -> (delta int32 [A, 256]: the complete transition function,
    out uint32 [A]: bit i set where pattern i ends at this state, via suffix links too)."""
    goto, out = [{}], [0]
    for i, pattern in enumerate(patterns):
        node = 0
        for b in pattern:
            if b not in goto[node]:
                goto.append({})
                out.append(0)
                goto[node][b] = len(goto) - 1
            node = goto[node][b]
        out[node] |= 1 << i
    delta = np.zeros((len(goto), 256), np.int32)
    fail = [0] * len(goto)
    queue = collections.deque()
    for b, v in goto[0].items():
        delta[0, b] = v
        queue.append(v)
    while queue:
        u = queue.popleft()
        for b in range(256):
            v = goto[u].get(b)
            if v is None:
                delta[u, b] = delta[fail[u], b]
                continue
            fail[v] = int(delta[fail[u], b])
            out[v] |= out[fail[v]]
            delta[u, b] = v
            queue.append(v)
    return delta, np.array(out, np.uint32)


def token_transitions(delta, out, pieces) -> tuple[np.ndarray, np.ndarray]:
    """For every state a and token v: (state after v's bytes int32 [A, V], bits of the patterns
    completed while feeding them uint32 [A, V]); tokens processed longest first, so step l only
    touches tokens longer than l."""
    lengths = np.array([len(p) for p in pieces])
    order = np.argsort(-lengths, kind='stable')
    width = int(lengths.max(initial=0))
    padded = np.zeros((len(pieces), max(width, 1)), np.uint8)
    for i, p in enumerate(pieces):
        padded[i, : len(p)] = np.frombuffer(p, np.uint8)
    padded, sorted_len = padded[order], lengths[order]
    states = len(delta)
    cur = np.broadcast_to(np.arange(states, dtype=np.int32)[:, None], (states, len(pieces))).copy()
    hit = np.zeros((states, len(pieces)), np.uint32)
    for step in range(width):
        n = int((sorted_len > step).sum())  # the first n tokens are longer than `step`
        if n == 0:
            break
        cur[:, :n] = delta[cur[:, :n], padded[None, :n, step]]
        hit[:, :n] |= out[cur[:, :n]]
    next_AV = np.empty_like(cur)
    hit_AV = np.empty_like(hit)
    next_AV[:, order], hit_AV[:, order] = cur, hit
    return next_AV, hit_AV
