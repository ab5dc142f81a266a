"""Structured outputs: a regex or JSON schema compiled to a token automaton held as device arrays.

`Grammar.from_regex(tokenizer, pattern)` and `Grammar.from_json_schema(tokenizer, schema)` build
outlines-core's token-level DFA (its Index over the tokenizer's vocabulary: which token ids may
follow in each state, and where each leads) and keep it as arrays the samplers read inside their
compiled loop (`GrammarTables`, S states, V token ids, W = ceil(V / 32)):

- `allowed_SW` uint32 [S, W]: bit v % 32 of word v // 32 is set iff token v may come next (the
  grammar's own tokens; stop tokens are added at accepting states by the sampler);
- transitions in compressed sparse rows: `offsets_S1` int32 [S + 1], and per state its allowed
  tokens sorted, `tokens_T` int32 [T], with their next states `next_T` int32 [T] (T = all
  transitions; a dense [S, V] table would be S * V * 4 bytes, 45 MB for 230 states of SmolLM2);
  the device looks a transition up by bisection in the state's row;
- `final_S` bool [S]: accepting states (the output may end here: eos and stop tokens allowed);
  `terminal_S` bool [S]: accepting states with no way on, where a row ends at once.

State 0 is the start. States and transitions are padded (`_bucket`: at most 25% more) so grammars
of similar sizes share a compiled program; a lookup bisects ceil(log2(V + 1)) times whatever
the grammar. The arrays' bytes (`nbytes`) must fit `max_bytes` (default DEFAULT_MAX_BYTES),
checked when the grammar is built. Special tokens (b'' bytes) never match.
"""

from __future__ import annotations

import collections
import numbers

import numpy as np
from flax import struct

from specjax.data.tokenizers import token_bytes, vocabulary_digest
from specjax.sampling import grammar_schema

DEFAULT_MAX_BYTES = 256 << 20  # device bytes one grammar's tables may take


@struct.dataclass
class GrammarTables:
    """The automaton as jit arguments (see the module docstring); `steps` (static): bisection
    steps that find any token in a row of up to V tokens (ceil(log2(V + 1)))."""

    allowed_SW: np.ndarray
    offsets_S1: np.ndarray
    tokens_T: np.ndarray
    next_T: np.ndarray
    final_S: np.ndarray
    terminal_S: np.ndarray
    steps: int = struct.field(pytree_node=False, default=1)

    @property
    def nbytes(self) -> int:
        arrays = (self.allowed_SW, self.offsets_S1, self.tokens_T, self.next_T)
        return sum(a.nbytes for a in arrays) + self.final_S.nbytes + self.terminal_S.nbytes


class Grammar:
    """A token automaton for one tokenizer (build with `from_regex` / `from_json_schema`).

    `kind` ('regex' or 'json_schema'), `source` (the pattern, or the schema as JSON), `regex`
    (what outlines-core compiled), `vocab_size`, `eos_id` (the tokenizer's: it always ends a
    row under a grammar), `digest` (specjax.data.tokenizers.vocabulary_digest of the tokenizer),
    `num_states`, `tables` (GrammarTables, numpy), `nbytes`.
    """

    def __init__(self, tokenizer, regex: str, *, kind: str, source: str, max_bytes: int):
        import outlines_core  # noqa: PLC0415 (only grammar users need it)

        self.kind, self.source, self.regex = kind, source, regex
        field = 'pattern' if kind == 'regex' else 'schema'
        pieces = token_bytes(tokenizer)
        self.vocab_size, self.eos_id = len(pieces), int(tokenizer.eos_id)
        self.digest = vocabulary_digest(tokenizer)
        ids = collections.defaultdict(list)
        for i, piece in enumerate(pieces):
            if piece and i != self.eos_id:
                ids[piece].append(i)
        try:
            vocabulary = outlines_core.Vocabulary(self.eos_id, dict(ids))
            self._index = outlines_core.Index(regex, vocabulary)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f'Grammar.from_{kind}: {field}={_short(source)} cannot be compiled for this '
                f'tokenizer: outlines-core says: {e}'
            ) from e
        self._compile(max_bytes)

    @classmethod
    def from_regex(cls, tokenizer, pattern: str, *, max_bytes: int = DEFAULT_MAX_BYTES):
        """The outputs that match `pattern` (Rust regex syntax, anchored at both ends)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f'Grammar.from_regex: pattern must be a non-empty str, got {pattern!r}'
            )
        return cls(tokenizer, pattern, kind='regex', source=pattern, max_bytes=max_bytes)

    @classmethod
    def from_json_schema(cls, tokenizer, schema, *, max_bytes: int = DEFAULT_MAX_BYTES):
        """The JSON documents valid under `schema` (a JSON string or a dict). Constructs that
        outlines-core would ignore (so outputs could fail validation) are refused by name
        (specjax.sampling.grammar_schema)."""
        text, regex = grammar_schema.schema_regex(schema)
        return cls(tokenizer, regex, kind='json_schema', source=text, max_bytes=max_bytes)

    def _compile(self, max_bytes):
        """outlines-core's transitions -> the padded numpy GrammarTables (module docstring)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral):
            raise ValueError(f'Grammar max_bytes must be an int, got {max_bytes!r}')
        raw = self._index.get_transitions()
        start = self._index.get_initial_state()
        order = [start] + sorted(s for s in raw if s != start)
        self._dense = {s: i for i, s in enumerate(order)}
        dense_of = np.zeros(max(order) + 1, np.int64)
        dense_of[order] = np.arange(len(order))
        n, words = len(order), -(-self.vocab_size // 32)
        edges = [
            (np.full(len(raw.get(s, {})), i), np.fromiter(raw.get(s, {}).keys(), np.int64),
             dense_of[np.fromiter(raw.get(s, {}).values(), np.int64)])
            for i, s in enumerate(order)
        ]  # fmt: skip
        src, tok, dst = (np.concatenate(a) for a in zip(*edges, strict=True))
        keep = tok != self.eos_id  # eos: allowed where a state accepts, with the stop tokens
        src, tok, dst = src[keep], tok[keep], dst[keep]
        by_row = np.lexsort((tok, src))
        src, tok, dst = src[by_row], tok[by_row], dst[by_row]
        sizes, total = np.bincount(src, minlength=n), len(tok)
        n_pad, t_pad = _bucket(n), _bucket(max(total, 1))
        estimate = n_pad * words * 4 + (n_pad + 1) * 4 + t_pad * 8 + 2 * n_pad
        if estimate > max_bytes:
            raise ValueError(
                f'Grammar.from_{self.kind}: {_short(self.source)} needs {estimate / 2**20:.1f} MiB '
                f'of device tables ({n} states, {total} transitions, vocabulary {self.vocab_size})'
                f', over max_bytes={max_bytes} ({max_bytes / 2**20:.1f} MiB): simplify it '
                '(bound string lengths, fewer optional parts) or raise max_bytes'
            )
        offsets = np.full(n_pad + 1, total, np.int32)
        offsets[: n + 1] = np.concatenate([[0], np.cumsum(sizes)])
        tokens = np.full(t_pad, self.vocab_size, np.int32)  # padding: in no state's row
        nxt = np.zeros(t_pad, np.int32)
        tokens[:total], nxt[:total] = tok, dst
        bits = np.zeros((n_pad, words), np.uint32)
        np.bitwise_or.at(bits, (src, tok // 32), np.uint32(1) << (tok % 32).astype(np.uint32))
        final = np.zeros(n_pad, bool)
        finals = set(self._index.get_final_states())
        final[:n] = [s in finals for s in order]
        terminal = final.copy()
        terminal[:n] &= sizes == 0
        self.num_states, self.num_transitions = n, total
        self.tables = GrammarTables(
            allowed_SW=bits, offsets_S1=offsets, tokens_T=tokens, next_T=nxt, final_S=final,
            terminal_S=terminal, steps=int(self.vocab_size).bit_length(),
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes of the device tables (at the tokenizer's vocabulary size)."""
        return self.tables.nbytes

    def check_tokenizer(self, tokenizer, who: str = 'grammar') -> None:
        """ValueError unless `tokenizer` decodes every id as the one this grammar was built for."""
        digest = vocabulary_digest(tokenizer)
        if digest != self.digest:
            raise ValueError(
                f'{who}: built for a tokenizer with vocabulary digest {self.digest}, but this '
                f'tokenizer has {digest} (vocab_size {tokenizer.vocab_size}): build the grammar '
                "with the target model's tokenizer"
            )

    def walk(self, tokens) -> list[int] | None:
        """Host reference: the dense states after each token of `tokens` (from the start), via
        outlines-core's own index; None where a token is not allowed. The eos id at an
        accepting state keeps the state."""
        state, out = self._index.get_initial_state(), []
        for t in tokens:
            t = int(t)
            if t == self.eos_id and self._index.is_final_state(state):
                out.append(self._dense[state])
                continue
            state = self._index.get_next_state(state, t)
            if state is None:
                return None
            out.append(self._dense[state])
        return out

    def allowed(self, state: int) -> np.ndarray:
        """int [n]: the grammar's token ids allowed in dense `state` (eos excluded)."""
        t = self.tables
        return t.tokens_T[t.offsets_S1[state] : t.offsets_S1[state + 1]]

    def is_final(self, state: int) -> bool:
        return bool(self.tables.final_S[state])

    def device_tables(self, vocab_size: int) -> GrammarTables:
        """The tables for a model of `vocab_size` >= the tokenizer's (ids past it never
        allowed); ValueError when the model's vocabulary is smaller."""
        if vocab_size < self.vocab_size:
            raise ValueError(
                f'grammar: built for a tokenizer of {self.vocab_size} tokens, but the model has '
                f'vocab_size={vocab_size}'
            )
        words = -(-vocab_size // 32)
        bits = self.tables.allowed_SW
        if words > bits.shape[1]:
            bits = np.pad(bits, ((0, 0), (0, words - bits.shape[1])))
        return self.tables.replace(allowed_SW=bits)

    def __repr__(self) -> str:
        return (
            f'Grammar({self.kind}={_short(self.source)}, states={self.num_states}, '
            f'transitions={self.num_transitions}, {self.nbytes / 2**20:.2f} MiB)'
        )


def _bucket(n: int) -> int:
    """n rounded up to a multiple of 2^(bit_length(n) - 3) (at least 8): at most 25% more, and
    grammars of similar sizes get the same shapes, so they share a compiled program."""
    step = max(1, 1 << (int(n).bit_length() - 3))
    return max(8, -(-int(n) // step) * step)


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + '...')
