"""A task inside the compiled loop: masks, automaton steps and where a row's tokens end.

`Constraint(task, batch, vocab_size, eos_id)` wraps a TaskTables (traced jit arguments) for one
batch; the samplers call it at every place a distribution is formed or tokens are emitted. Pure
functions of their inputs; no host round trip.

The constrained law (docs/design.md): in grammar state s, at the row's token index n, the
allowed set m is the grammar's tokens in s, plus the stop tokens (eos included) where s accepts;
stop tokens leave m while n < min_new_tokens (unless nothing else is allowed). Logits outside m
become -inf before the sampling transform, so with no top-k/top-p the law is norm(p * m). Target
and draft are masked alike, the draft's mask read through its vocabulary map; a draft with no
allowed token left proposes from its unmasked q (its proposal is then rejected for sure, and
the residual is the constrained target law). An empty mask (a state no allowed token reaches)
falls back to every token, so no distribution is ever all zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import emit
from specjax.sampling.task import FinishReason, TaskState, TaskTables, finish_from_eos


def unpack_bits(bits_XW, vocab_size: int):
    """bool [..., V] from uint32 [..., W] bit rows (bit v % 32 of word v // 32)."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    flat = ((bits_XW[..., None] >> shifts) & 1).reshape(*bits_XW.shape[:-1], -1)
    return flat[..., :vocab_size] != 0


def next_state(g, s, tok):
    """The grammar state after token `tok` in state `s` (int32, same shapes): bisection in the
    state's sorted row of the CSR tables; `s` itself where tok has no transition (stop tokens at
    accepting states, and tokens no path reaches)."""
    lo, end = g.offsets_S1[s], g.offsets_S1[s + 1]
    last = g.tokens_T.shape[0] - 1

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        right = g.tokens_T[jnp.minimum(mid, last)] < tok
        open_ = lo < hi
        return jnp.where(open_ & right, mid + 1, lo), jnp.where(open_ & ~right, mid, hi)

    at, _ = jax.lax.fori_loop(0, g.steps + 1, step, (lo, end))
    safe = jnp.minimum(at, last)
    found = (at < end) & (g.tokens_T[safe] == tok)
    return jnp.where(found, g.next_T[safe], s).astype(jnp.int32)


class Constraint:
    """A TaskTables bound to B rows and V token ids (module docstring); eos_id: the sampler's
    traced eos (-1 none), one more stop token."""

    def __init__(self, task: TaskTables, batch: int, vocab_size: int, eos_id):
        self.task, self.grammar, stop = task, task.grammar, task.stop
        self.batch, self.vocab = batch, vocab_size
        rows = lambda x: jnp.broadcast_to(x, (batch, *x.shape[1:]))
        eos = jnp.broadcast_to(jnp.asarray(eos_id, jnp.int32), (batch, 1))
        self.ids_BI = jnp.concatenate([rows(stop.ids_RI), eos], axis=1)
        self.min_new_B = rows(stop.min_new_R)
        self.strings_B = None if stop.strings_R is None else rows(stop.strings_R)
        self.masks_stops = stop.min_new
        if self.grammar is not None or self.masks_stops:
            where = jnp.where(self.ids_BI >= 0, self.ids_BI, vocab_size)  # -1: dropped
            b = jnp.broadcast_to(jnp.arange(batch)[:, None], where.shape)
            self.stop_BV = jnp.zeros((batch, vocab_size), bool).at[b, where].set(True, mode='drop')

    @property
    def masks(self) -> bool:
        """Whether distributions are masked at all (a grammar, or stops with a minimum length)."""
        return self.grammar is not None or self.masks_stops

    def initial(self) -> TaskState:
        zeros = jnp.zeros((self.batch,), jnp.int32)
        return TaskState(grammar=zeros, ac=zeros, finish=zeros + int(FinishReason.LENGTH))

    def mask(self, g_BX, index_BX):
        """bool [B, X, V]: the allowed tokens in grammar states g [B, X] at token indices
        index [B, X] (tokens the row holds before this one)."""
        stops = self.stop_BV[:, None, :]
        if self.grammar is None:
            m = jnp.ones((*g_BX.shape, self.vocab), bool)
        else:
            m = unpack_bits(self.grammar.allowed_SW[g_BX], self.vocab)
            m = m | (self.grammar.final_S[g_BX][..., None] & stops)
        if self.masks_stops:
            early = (index_BX < self.min_new_B[:, None])[..., None] & stops
            kept = m & ~early
            m = jnp.where(jnp.any(kept, -1, keepdims=True), kept, m)
        if self.grammar is not None:
            m = m | ~jnp.any(m, -1, keepdims=True)
        return m

    def logits(self, logits_BXV, g_BX, index_BX):
        """The target's logits with disallowed tokens at -inf (unchanged without masks)."""
        if not self.masks:
            return logits_BXV
        return jnp.where(self.mask(g_BX, index_BX), logits_BXV, -jnp.inf)

    def draft_logits(self, logits_BN, vocab, g_B, index_B):
        """A draft's restricted logits [B, N] or [B, X, N] (N: the draft's proposable tokens,
        `vocab` a DraftVocab) masked alike, at states g and indices index [B] or [B, X];
        unmasked where none of its tokens is allowed."""
        if not self.masks:
            return logits_BN
        if logits_BN.ndim == 2:
            one = self.draft_logits(logits_BN[:, None], vocab, g_B[:, None], index_B[:, None])
            return one[:, 0]
        m = self.mask(g_B, index_B)
        if vocab.ids is not None:
            m = jnp.take(m, jnp.asarray(vocab.ids, jnp.int32), axis=-1)
        m = m | ~jnp.any(m, -1, keepdims=True)
        return jnp.where(m, logits_BN, -jnp.inf)

    def advance(self, g_B, tok_B):
        """Grammar states after one token each (unchanged without a grammar)."""
        return g_B if self.grammar is None else next_state(self.grammar, g_B, tok_B)

    def walk(self, g_B, x_BK):
        """int32 [B, K + 1]: the states before x_1 and after each of x_1..x_K."""
        states = [g_B]
        for i in range(x_BK.shape[1]):
            states.append(self.advance(states[-1], x_BK[:, i]))
        return jnp.stack(states, axis=1)

    def cut(self, state: TaskState, block_BT, count_B, emitted_B, g_after_BT):
        """Where each row's emitted block ends -> (count [B], reason [B], TaskState after it).

        block_BT: the round's tokens (count of them emitted, already capped at max_new);
        emitted_B: tokens the row held before; g_after_BT: the grammar state after each block
        token. The block is cut after the first token that is a stop token or completes a stop
        string at index >= min_new_tokens, or leads the grammar to a terminal state; reason is
        that token's FinishReason, LENGTH where nothing cut it."""
        t = block_BT.shape[1]
        j = jnp.arange(t)[None, :]
        within = j < count_B[:, None]
        counted = emitted_B[:, None] + j >= self.min_new_B[:, None]
        is_token = jnp.any(block_BT[..., None] == self.ids_BI[:, None, :], axis=-1)
        ac_BT1 = jnp.broadcast_to(state.ac[:, None], (self.batch, t + 1))
        is_string = jnp.zeros_like(is_token)
        if self.task.stop.ac_next_AV is not None:
            stop, a, hits, states = self.task.stop, state.ac, [], [state.ac]
            for i in range(t):
                hits.append((stop.ac_hit_AV[a, block_BT[:, i]] & self.strings_B) != 0)
                a = stop.ac_next_AV[a, block_BT[:, i]]
                states.append(a)
            is_string, ac_BT1 = jnp.stack(hits, axis=1), jnp.stack(states, axis=1)
        terminal = jnp.zeros_like(is_token)
        if self.grammar is not None:
            terminal = self.grammar.terminal_S[g_after_BT]
        token, string = is_token & counted, is_string & counted
        end = within & (token | string | terminal)
        cut = jnp.any(end, axis=1)
        first = jnp.argmax(end, axis=1)
        count = jnp.where(cut, first + 1, count_B).astype(jnp.int32)
        at = lambda a, i: jnp.take_along_axis(a, i[:, None], axis=1)[:, 0]
        reason = jnp.where(
            at(token, first), int(FinishReason.STOP_TOKEN),
            jnp.where(at(string, first), int(FinishReason.STOP_STRING), int(FinishReason.GRAMMAR)),
        )  # fmt: skip
        reason = jnp.where(cut, reason, int(FinishReason.LENGTH)).astype(jnp.int32)
        grammar = at(g_after_BT, jnp.maximum(count - 1, 0))
        new = TaskState(grammar=grammar, ac=at(ac_BT1, count), finish=reason)
        return count, reason, new

    def cut_round(self, state, g_BK1, proposed_BK, num_acc_B, next_B, count_B):
        """A speculative round's block (accepted proposals, then the replacement/bonus) cut at
        the task's stops -> (count [B], ended [B], TaskState of active rows). state: the
        sampler's (emitted, done, task); g_BK1: the grammar states along the proposals, so the
        state after accepted token j is g_BK1[j + 1] and after the last one step from g_BK1[n]."""
        j = jnp.arange(proposed_BK.shape[1] + 1)[None, :]
        at_n = jnp.take_along_axis(g_BK1, num_acc_B[:, None], axis=1)
        after = jnp.pad(g_BK1[:, 1:], ((0, 0), (0, 1)))
        after = jnp.where(j < num_acc_B[:, None], after, self.advance(at_n, next_B[:, None]))
        block = emit.round_block(proposed_BK, num_acc_B, next_B)
        count, reason, new = self.cut(state.task, block, count_B, state.emitted, after)
        ended = reason != int(FinishReason.LENGTH)
        return count, ended, self.keep(~state.done, new, state.task)

    def keep(self, active_B, new: TaskState, old: TaskState) -> TaskState:
        """new for active rows, old for finished ones."""
        return jax.tree.map(lambda n, o: jnp.where(active_B, n, o), new, old)


def unpack(values, batch: int, vocab_size: int, eos_id=None):
    """A sampler's bound values -> (sampling, emit.Stop, Constraint or None): the task, when
    bound, is the third value; eos_id: the Stop's when None (the tree's is static)."""
    sampling, stop, *tables = values
    if not tables or tables[0] is None:
        return sampling, stop, None
    eos_id = stop.eos_id if eos_id is None else eos_id
    return sampling, stop, Constraint(tables[0], batch, vocab_size, eos_id)


def outputs(con, state: TaskState, tokens_BN, lengths_B, eos_id) -> tuple:
    """(finish_reason int32 [B], extra stats) of a finished loop: the task's reasons and
    row_grammar_state [B] (the automaton's state after the row), or without a task (`con`
    None) STOP_TOKEN where a row ends in eos_id and no extra stats."""
    if con is None:
        return finish_from_eos(tokens_BN, lengths_B, eos_id), {}
    return state.finish, {'row_grammar_state': state.grammar}
