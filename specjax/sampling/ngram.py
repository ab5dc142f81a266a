"""A training-free draft: prompt lookup (n-gram matching against the context), on device.

`NGramDraft(max_n, min_n)` passes wherever a draft passes (`speculative_sample`,
`tree_speculative_sample`). Each round, per row, it finds the latest earlier occurrence of the
context's last n tokens (the prompt plus everything emitted so far; n from max_n down to min_n,
the longest that occurs) and proposes the tokens that followed that occurrence. The context is
treated as extended by its own proposals, so the continuation of a match d tokens before the end
repeats with period d: proposal i is context[s + (i mod d)], s the first token after the match
(a loop in the text is proposed as the loop, not cut at the context's end). A row without a
match proposes nothing that round (the target takes one plain step).

The proposals are a deterministic function of the context, a point-mass draft: q is the one-hot
of the proposed token, so every exact rule verifies it exactly (`probabilistic` accepts x with
p(x) and on rejection samples p without x, renormalised; greedy accepts x iff it is the
target's argmax). Trees take R chains under the root (`ngram_tree_paths`): sibling r follows the
r-th latest match whose next token differs from the earlier siblings' (several matches as
siblings), verified with `argmax_draft`, the rule for candidates chosen by the draft alone.

Nothing is trained or stored: the drafter's state is the prompt (`NGramContext`), read together
with the sampler's emitted tokens.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models import apply_cached
from specjax.sampling.transforms import is_greedy
from specjax.sampling.tree_walk import DraftedTree


@dataclasses.dataclass(frozen=True)
class NGramDraft:
    """Prompt-lookup drafting: match the last n tokens, max_n >= n >= min_n >= 1 (longest first).

    `proposals_by_n` (chains only) sets how many tokens a round proposes after a match of n
    tokens: entry n - 1 for n = 1..max_n, each capped at the sampler's k (0: no proposal, a plain
    target step); empty (the default) proposes k after any match. A longer match predicts a longer
    accepted run, so proposing more after it and fewer after a short one spends the verification
    width where it pays. The count is a function of the context, so the law stays exact.

    Hashable and static: it is the draft's "graphdef" in a compiled sampler (no parameters).
    """

    max_n: int = 3
    min_n: int = 1
    proposals_by_n: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ('max_n', 'min_n'):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f'NGramDraft.{name} must be an int >= 1, got {v!r}')
            object.__setattr__(self, name, int(v))
        if self.min_n > self.max_n:
            raise ValueError(f'NGramDraft.min_n={self.min_n} must not exceed max_n={self.max_n}')
        by_n = self.proposals_by_n
        if isinstance(by_n, (str, bytes)) or not hasattr(by_n, '__len__'):
            raise ValueError(f'NGramDraft.proposals_by_n must be a tuple of ints, got {by_n!r}')
        if by_n and (
            len(by_n) != self.max_n
            or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0
                   for v in by_n)
        ):  # fmt: skip
            raise ValueError(
                f'NGramDraft.proposals_by_n must be empty or {self.max_n} (max_n) ints >= 0, one '
                f'per match length n = 1..{self.max_n}, got {by_n!r}'
            )
        object.__setattr__(self, 'proposals_by_n', tuple(int(v) for v in by_n))

    def proposals(self, found_B, n_B, k: int):
        """Tokens proposed this round -> int32 [B]: 0 where found_B is False, else
        min(k, proposals_by_n[n - 1]) (k for every n when proposals_by_n is empty); n_B in
        1..max_n where found."""
        by_n = self.proposals_by_n or (k,) * self.max_n
        table_N1 = jnp.asarray([0] + [min(v, k) for v in by_n], jnp.int32)
        return jnp.where(found_B, table_N1[n_B], 0).astype(jnp.int32)


def is_ngram(draft) -> bool:
    return isinstance(draft, NGramDraft)


@struct.dataclass
class NGramContext:
    """The n-gram drafter's state in the sampler's draft-cache slot: prompts int32 [B, P] (zero
    past each row's length) and lengths int32 [B]; constant over a run (the emitted tokens are
    the sampler's own `out`)."""

    prompts: jax.Array
    lengths: jax.Array


def context(prompts_BP, prompt_lengths_B, out_BN, emitted_B):
    """The context as one buffer: (ctx int32 [B, P + N], its length [B]), row b's prompt tokens
    then its emitted ones (entries past the length are arbitrary)."""
    width = prompts_BP.shape[1]
    i = jnp.arange(width + out_BN.shape[1])[None, :]
    from_out = jnp.take_along_axis(out_BN, jnp.clip(i - prompt_lengths_B[:, None], 0,
                                                    out_BN.shape[1] - 1), axis=1)  # fmt: skip
    padded = jnp.pad(prompts_BP, ((0, 0), (0, out_BN.shape[1])))
    ctx = jnp.where(i < prompt_lengths_B[:, None], padded, from_out)
    return ctx, prompt_lengths_B + emitted_B


def lookup(ctx_BH, length_B, *, k: int, max_n: int, min_n: int, exclude_BR=None):
    """The latest match of the context's last n tokens, n = max_n..min_n (longest first), whose
    next token is not in exclude_BR -> (proposals int32 [B, k], found bool [B], n int32 [B]).

    A match at j (ctx[j:j+n] == ctx[L-n:L], j + n <= L - 1, L the row's length) continues at
    s = j + n, d = L - s tokens before the end: proposal i is ctx[s + (i mod d)]. Rows without
    a match get found False and proposals 0. exclude_BR int32 [B, R] (-1: none): next tokens
    already taken by earlier siblings.
    """
    batch, width = ctx_BH.shape
    j = jnp.arange(width)[None, :]
    padded = jnp.pad(ctx_BH, ((0, 0), (0, max_n + 1)), constant_values=-1)
    shifted = [padded[:, t : t + width] for t in range(max_n + 1)]  # shifted[t][b, j] = ctx[j+t]
    best_j = jnp.full((batch,), -1, jnp.int32)
    best_n = jnp.zeros((batch,), jnp.int32)
    for n in range(max_n, min_n - 1, -1):
        suffix = jnp.take_along_axis(ctx_BH, jnp.clip(length_B[:, None] - n + jnp.arange(n), 0,
                                                      width - 1), axis=1)  # fmt: skip
        eq = j <= length_B[:, None] - n - 1
        for t in range(n):
            eq = eq & (shifted[t] == suffix[:, t : t + 1])
        if exclude_BR is not None:
            nxt = shifted[n]  # the token after the match
            eq = eq & ~jnp.any(nxt[:, :, None] == exclude_BR[:, None, :], axis=-1)
        latest = jnp.max(jnp.where(eq, j, -1), axis=1).astype(jnp.int32)
        take = (best_j < 0) & (latest >= 0)
        best_j = jnp.where(take, latest, best_j)
        best_n = jnp.where(take, n, best_n)
    found = best_j >= 0
    start = best_j + best_n
    period = jnp.maximum(length_B - start, 1)
    idx = start[:, None] + jnp.arange(k)[None, :] % period[:, None]
    tokens = jnp.take_along_axis(ctx_BH, jnp.clip(idx, 0, width - 1), axis=1)
    return jnp.where(found[:, None], tokens, 0).astype(jnp.int32), found, best_n


def lookup_reference(context_tokens, *, k: int, max_n: int, min_n: int, exclude=()):
    """Plain-Python `lookup` for one row (a list of ints) -> (proposals or None, n): the
    statement the device version is tested against."""
    length = len(context_tokens)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = context_tokens[length - n :]
        for j in range(length - n - 1, -1, -1):
            if context_tokens[j : j + n] == suffix and context_tokens[j + n] not in exclude:
                start = j + n
                period = length - start
                return [context_tokens[start + i % period] for i in range(k)], n
    return None, 0


def ngram_tree_paths(branches: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """R = `branches` chains of `depth` under the root: the token tree an n-gram draft fills
    (sibling r follows the r-th distinct latest match)."""
    for name, v in (('branches', branches), ('depth', depth)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f'ngram_tree_paths: {name} must be an int >= 1, got {v!r}')
    return tuple((r,) + (0,) * d for d in range(depth) for r in range(branches))


def check_tree(tree, who: str) -> int:
    """The number R of chains of a tree an n-gram draft can fill (paths (r, 0, ..., 0)); a
    ValueError naming the first other path otherwise."""
    for path in tree:
        if any(path[1:]):
            raise ValueError(
                f'{who}: an n-gram draft fills trees of chains under the root (paths (r, 0, ..., '
                f'0), e.g. ngram_tree_paths(branches, depth)), got path {path}'
            )
    return 1 + max(path[0] for path in tree)


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    """The samplers' drafter for an NGramDraft (see specjax.sampling.drafters for the protocol):
    no model, no cache; proposals from `lookup` over the prompt and the emitted tokens."""

    spec: NGramDraft
    feature_layers: tuple[int, ...] = ()
    variable_length: bool = True  # rows propose m <= k tokens (verification width follows)

    def target_call(self, tgd, tparams, tokens_BT, num_valid_B, tcache, positions=None, mask=None,
                    write=True):  # fmt: skip
        """The target's cached call -> (logits, cache, None): no features are read."""
        out = apply_cached(
            tgd, tparams, tokens_BT, num_valid_B, tcache, positions, mask, write=write
        )
        return (*out, None)

    def new_cache(self, dgd, batch: int, capacity: int):
        del dgd, capacity
        zeros = jnp.zeros((batch,), jnp.int32)
        return NGramContext(prompts=jnp.zeros((batch, 1), jnp.int32), lengths=zeros)

    def init(self, dgd, dparams, cache, prompts, lengths, vocab, features_BPNE, k):
        """The context is the prompt (nothing to consume) -> (NGramContext, feed ())."""
        del dgd, dparams, cache, vocab, features_BPNE, k
        return NGramContext(prompts=prompts, lengths=lengths), ()

    def fuse(self, dgd, dparams, features_BWNE):
        return None

    def lookup(self, state, k: int, exclude_BR=None):
        """This round's (proposals [B, k], found [B], matched n [B]) from the state's context."""
        ctx, length = context(state.dcache.prompts, state.dcache.lengths, state.out, state.emitted)
        return lookup(
            ctx, length, k=k, max_n=self.spec.max_n, min_n=self.spec.min_n, exclude_BR=exclude_BR
        )

    def propose(self, dgd, dparams, state, uniform_BK, active, *, k, sampling, acc, vocab, bug,
                check_finite=True, stop_below=None, con=None):  # fmt: skip
        """-> (x [B, k], q [B, k, V] one-hot (a [B, k, 1] placeholder when greedy), m [B]:
        `NGramDraft.proposals` (k, or the match length's count, where a match was found; else 0),
        fed 0, carry None, no non-finite logits). `bug`
        'ngram_soft_q' (a negative control) verifies against 0.5 q + 0.5 uniform instead. Under
        a grammar the proposals are not masked: one the grammar forbids has p~(x) = 0 under the
        constrained target law and is rejected, which keeps the law exact."""
        del dgd, dparams, uniform_BK, acc, check_finite, stop_below, con  # (a grammar: below)
        x, found, n = self.lookup(state, k)
        q = (jnp.zeros(x.shape + (1,), jnp.float32) if is_greedy(sampling) is True
             else jax.nn.one_hot(x, vocab.target_vocab, dtype=jnp.float32))  # fmt: skip
        if bug == 'ngram_soft_q':  # wrong: verified as a smoothed q it was not drawn from
            q = 0.5 * q + 0.5 / q.shape[-1]
        m = self.spec.proposals(found & active, n, k)
        return x, q, m, jnp.int32(0), None, jnp.bool_(False)

    def after_round(self, state, carry, fused_BWE, *, fed, x_BK, num_acc_B, next_B, active_B):
        """Nothing to roll back: the context grows with the sampler's emitted tokens."""
        return state.dcache, state.prev, state.draft_pending, ()

    def draft_tree(self, state, active, *, t, branches: int, con=None):
        """A static tree of `branches` chains (tables t) -> DraftedTree whose sibling r holds the
        r-th distinct match's continuation (0-filled where there is none: tested and rejected
        like any candidate, the rule stays exact); under a task (`con`) each node carries the
        automaton state of its path."""
        depth = t.max_depth
        batch = active.shape[0]
        exclude = jnp.full((batch, branches), -1, jnp.int32)
        chains = []
        for r in range(branches):
            x, found, _ = self.lookup(state, depth, exclude_BR=exclude)
            chains.append(x)
            exclude = exclude.at[:, r].set(jnp.where(found, x[:, 0], -1))
        # Node i + 1 (depth d, branch r) holds chains[r][:, d - 1].
        branch_of = np.zeros(t.num_nodes + 1, np.int32)
        for i in range(1, t.num_nodes + 1):
            branch_of[i] = t.rank[i] if t.depth[i] == 1 else branch_of[t.parent[i]]
        stacked = jnp.stack(chains, axis=1)  # [B, R, D]
        tokens = stacked[:, branch_of[1:], t.depth[1:] - 1]
        wide = lambda a: jnp.broadcast_to(jnp.asarray(a), (batch, *np.shape(a)))
        states = None
        if con is not None:  # parents come before their children in node order
            states = [state.task.grammar]
            for i in range(1, t.num_nodes + 1):
                states.append(con.advance(states[t.parent[i]], tokens[:, i - 1]))
            states = jnp.stack(states, axis=1)
        return DraftedTree(
            tokens_BN=tokens.astype(jnp.int32), depth_BN1=wide(t.depth),
            ancestor_BNN=wide(t.ancestor), children_BNR=wide(t.children),
            fed_slot_BN1=wide(np.full(t.num_nodes + 1, -1, np.int32)), q_BFV=None,
            state_BN1=states,
        )  # fmt: skip
