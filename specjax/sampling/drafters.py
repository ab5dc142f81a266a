"""How the samplers drive their draft: a token draft (a Transformer) or a feature draft.

The chain sampler (specjax.sampling.speculative) and the tree sampler (tree_speculative) talk to
their draft through one of two drafters, chosen from the draft's graphdef (`drafter_for`); both
keep the draft's KV cache beside the target's and differ in what the draft reads and what it
must catch up on after a round.

Token draft (`TokenDrafter`, a Transformer over draft ids): reads the context tokens. At a
round's start it has consumed the context except `last` and, after a round that accepted all k
proposals, x_k before it (`prev`, pending 2); the catch-up feeds those 1-2 tokens.

Feature draft (`FeatureDrafter`, specjax.models.feature_draft.FeatureDraft): draft entry t
pairs the context token c_t with the fused target feature f_{t-1} (f_{-1} = 0) and predicts
c_{t+1}. The target's verification call also returns the features of the k + 1 positions it
scored, so after a round that accepted n proposals the draft's cache is rolled back to the
entries that were fed true features (the context up to `last`) and the n + 1 new entries
(x_1..x_n and the replacement/bonus token, paired with the features of `last`, x_1..x_n) are
pending: the next round's catch-up feeds them in one (k + 1)-wide cached call. Proposals past
the catch-up pair x_i with the draft's own output state at the previous entry (EAGLE's
feature-level autoregression); they are dropped in the roll-back. So the draft's cache after a
round holds exactly what a from-scratch pass over the accepted context with the target's
features would hold (tests/test_feature_sampling.py checks this). In a token tree each node is
fed with its parent's output state (`level`), and the accepted path (root and path nodes, with
the target's features of the positions the tree call scored) is the next catch-up's feed.

N-gram draft (`specjax.sampling.ngram.NGramDrafter`, an `NGramDraft`): no model; proposals
looked up in the context, a point-mass q.

Every drafter is a static (hashable) part of a compiled sampler, with the same methods
(`new_cache`, `init`, `propose`, `target_call`, `after_round`, ...). A draft is only a proposal
distribution q: none changes the sampler's output law.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from flax.nnx import graphlib

from specjax.models import apply_cached, init_cache, merge, split
from specjax.models.feature_draft import FeatureDraftConfig
from specjax.sampling import common, proposals
from specjax.sampling.ngram import NGramDrafter, is_ngram


@struct.dataclass
class FeatureFeed:
    """A feature draft's pending entries (W = k + 1): tokens [B, W] (target ids) and fused
    target features [B, W, E]; the row's count is the sampler state's draft_pending [B]."""

    tokens: jax.Array
    features: jax.Array


def feature_config_of(graphdef) -> FeatureDraftConfig | None:
    """The FeatureDraftConfig a feature draft's graphdef holds, else None (a token draft)."""
    for _, attr in graphdef.attributes:
        if isinstance(attr, graphlib.Static) and isinstance(attr.value, FeatureDraftConfig):
            return attr.value
    return None


def split_draft(draft):
    """(graphdef, params) of a draft model; an NGramDraft is its own graphdef, with no params."""
    return (draft, ()) if is_ngram(draft) else split(draft)


def draft_vocab_size(draft_graphdef, target_vocab: int) -> int:
    """The draft's vocabulary (an n-gram draft proposes target ids)."""
    if is_ngram(draft_graphdef):
        return target_vocab
    return common.config_of(draft_graphdef).vocab_size


def drafter_for(target_graphdef, draft_graphdef, who: str):
    """TokenDrafter(), FeatureDrafter(...) or NGramDrafter(...) for this pair; ValueError (before
    compiling) when a feature draft was built for another target (width, blocks or vocabulary)."""
    if is_ngram(draft_graphdef):
        return NGramDrafter(draft_graphdef)
    feature = feature_config_of(draft_graphdef)
    if feature is None:
        return TokenDrafter()
    target = common.config_of(target_graphdef)
    for field in ('d_model', 'n_layers', 'vocab_size'):
        want, got = getattr(feature.target, field), getattr(target, field)
        if want != got:
            raise ValueError(
                f'{who}: the feature draft reads a target with {field}={want}, but the target '
                f'has {field}={got} (FeatureDraftConfig.target)'
            )
    return FeatureDrafter(feature.feature_layers)


def target_call(tgd, tparams, tokens_BT, num_valid_B, tcache, feature_layers=(), positions=None,
                mask=None, write=True):  # fmt: skip
    """The target's cached call -> (logits [B, T, V], cache, features [B, T, n, E] of the blocks
    `feature_layers`, or None when none are read); positions / mask / write as apply_cached
    (trees; write=False: the new entries in place of the cache)."""
    args = (tgd, tparams, tokens_BT, num_valid_B, tcache, positions, mask)
    if not feature_layers:
        return (*apply_cached(*args, write=write), None)
    return apply_cached(*args, feature_layers=feature_layers, write=write)


class _ModelDrafter:
    """What the model drafts share: a KV cache of the draft's config, proposals drawn from its
    logits (specjax.sampling.proposals), k proposals a round unless confidence-stopped."""

    variable_length = False

    def target_call(self, tgd, tparams, tokens_BT, num_valid_B, tcache, positions=None, mask=None,
                    write=True):  # fmt: skip
        """The target's cached call with the features this draft reads (`self.feature_layers`;
        module-level `target_call`)."""
        return target_call(tgd, tparams, tokens_BT, num_valid_B, tcache, self.feature_layers,
                           positions, mask, write)  # fmt: skip

    def new_cache(self, dgd, batch: int, capacity: int):
        return init_cache(common.config_of(dgd), batch, capacity)

    def propose(self, dgd, dparams, state, uniform_BK, active, **kw):
        return proposals.propose(self, dgd, dparams, state, uniform_BK, active, **kw)


@dataclasses.dataclass(frozen=True)
class TokenDrafter(_ModelDrafter):
    """A Transformer draft over draft ids (vocab.to_draft maps the target ids it reads)."""

    feature_layers: tuple[int, ...] = ()

    def init(self, dgd, dparams, cache, prompts, lengths, vocab, features_BPNE, k):
        """Consumes the prompt except its last token -> (cache, feed ())."""
        del features_BPNE, k
        _, cache = apply_cached(dgd, dparams, vocab.to_draft(prompts), lengths - 1, cache)
        return cache, ()

    def fuse(self, dgd, dparams, features_BWNE):
        """No features are read: None."""
        return None

    def catch_up(self, dgd, dparams, state, active, vocab):
        """-> (logits [B, V_d] after the pending tokens, carry for `step`)."""
        return common.draft_catch_up(
            dgd, dparams, state.dcache, state.last, state.prev, state.draft_pending, active,
            vocab.to_draft,
        )  # fmt: skip

    def step(self, dgd, dparams, carry, x_B, act_B, vocab):
        """Feeds proposal x [B] -> (logits [B, V_d], carry)."""
        logits, cache = apply_cached(dgd, dparams, vocab.to_draft(x_B[:, None]), act_B, carry)
        return logits[:, 0], cache

    def split_carry(self, carry):
        """The catch-up's carry -> (cache, output state [B, E] or None)."""
        return carry, None

    def level(self, dgd, dparams, cache, tokens_BW, parent_state_BWE, positions_BW, mask_BWC,
              vocab):  # fmt: skip
        """One token-tree level: W nodes (target ids) written at cache.lengths.. with tree
        positions and mask (lengths unchanged) -> (logits [B, W, V_d], None, cache)."""
        del parent_state_BWE
        zeros = jnp.zeros(tokens_BW.shape[:1], jnp.int32)
        inputs = vocab.to_draft(tokens_BW)
        logits, cache = apply_cached(dgd, dparams, inputs, zeros, cache, positions_BW, mask_BWC)
        return logits, None, cache

    def after_round(self, state, carry, fused_BWE, *, fed, x_BK, num_acc_B, next_B, active_B):
        """-> (cache, prev, pending, feed) of the next round's start. `fed` (scalar) proposals
        were fed to the draft (k - 1 unless a stop ended the round early): the cache keeps
        x_1..x_min(n, fed); x_{fed+1} and `last` are pending when it was accepted too."""
        del fused_BWE, next_B
        keep = lambda new, old: jnp.where(active_B, new, old)
        d_len = carry.lengths - fed + jnp.minimum(num_acc_B, fed)
        pending = 1 + (num_acc_B > fed).astype(jnp.int32)
        return (
            carry.replace(lengths=keep(d_len, state.dcache.lengths)),
            keep(jnp.take(x_BK, fed, axis=1), state.prev),
            keep(pending, state.draft_pending),
            (),
        )


@dataclasses.dataclass(frozen=True)
class FeatureDrafter(_ModelDrafter):
    """A FeatureDraft reading the target blocks `feature_layers` (module docstring)."""

    feature_layers: tuple[int, ...]

    def init(self, dgd, dparams, cache, prompts, lengths, vocab, features_BPNE, k):
        """Consumes entries 0..P-2 of the prompt (tokens c_t, features f_{t-1}); entry P-1
        (`last`, f_{P-2}) is pending -> (cache, FeatureFeed of width k + 1)."""
        del vocab
        batch = prompts.shape[0]
        fused = self.fuse(dgd, dparams, features_BPNE)  # [B, P, E]: f_0..f_{P-1}
        shifted = jnp.concatenate([jnp.zeros_like(fused[:, :1]), fused[:, :-1]], axis=1)
        model = merge(dgd, dparams)
        _, _, cache = model.decode(prompts, shifted, lengths - 1, cache)
        rows = jnp.arange(batch)
        first = jnp.where((lengths >= 2)[:, None], fused[rows, jnp.maximum(lengths - 2, 0)], 0)
        tokens = jnp.zeros((batch, k + 1), jnp.int32).at[:, 0].set(prompts[rows, lengths - 1])
        features = jnp.zeros((batch, k + 1, fused.shape[-1]), fused.dtype).at[:, 0].set(first)
        return cache, FeatureFeed(tokens=tokens, features=features)

    def fuse(self, dgd, dparams, features_BWNE):
        """Target features [B, W, n, E] -> the draft's fused features [B, W, E]."""
        return merge(dgd, dparams).fuse_features(features_BWNE)

    def catch_up(self, dgd, dparams, state, active, vocab):
        """Feeds the pending entries -> (logits [B, V_d] at the last valid one, carry (cache,
        output state [B, E] there))."""
        del vocab
        feed, pending = state.dfeed, state.draft_pending
        num_valid = pending * active.astype(jnp.int32)
        logits, h, cache = merge(dgd, dparams).decode(
            feed.tokens, feed.features, num_valid, state.dcache
        )
        at = jnp.maximum(pending - 1, 0)[:, None, None]
        take = lambda a: jnp.take_along_axis(a, at, axis=1)[:, 0]
        return take(logits), (cache, take(h))

    def split_carry(self, carry):
        """The catch-up's carry -> (cache, output state [B, E] at the last pending entry)."""
        return carry

    def level(self, dgd, dparams, cache, tokens_BW, parent_state_BWE, positions_BW, mask_BWC,
              vocab):  # fmt: skip
        """One token-tree level: node i (target ids) paired with its parent's output state,
        written at cache.lengths.. with tree positions and mask (lengths unchanged) ->
        (logits [B, W, V_d], output states [B, W, E], cache). A tree round's nodes are all
        self-fed, so after_round drops them (fed=0) and feeds the accepted path's true
        features at the next catch-up."""
        del vocab
        zeros = jnp.zeros(tokens_BW.shape[:1], jnp.int32)
        model = merge(dgd, dparams)
        return model.decode(tokens_BW, parent_state_BWE, zeros, cache, positions_BW, mask_BWC)

    def step(self, dgd, dparams, carry, x_B, act_B, vocab):
        """Feeds proposal x [B] with the previous entry's output state as its feature."""
        del vocab
        cache, h_BE = carry
        logits, h, cache = merge(dgd, dparams).decode(x_B[:, None], h_BE[:, None], act_B, cache)
        return logits[:, 0], (cache, h[:, 0])

    def after_round(self, state, carry, fused_BWE, *, fed, x_BK, num_acc_B, next_B, active_B):
        """fused_BWE: the features of `last`, x_1..x_k -> (cache rolled back to the entries fed
        true features, prev, pending n + 1, the new feed)."""
        cache, _ = carry
        keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
        d_len = cache.lengths - fed  # the proposals were fed self-states: dropped
        i = jnp.arange(x_BK.shape[1] + 1)[None, :]
        padded = jnp.concatenate([x_BK, jnp.zeros_like(x_BK[:, :1])], axis=1)
        tokens = jnp.where(i < num_acc_B[:, None], padded, jnp.where(i == num_acc_B[:, None],
                           next_B[:, None], 0))  # fmt: skip
        feed = FeatureFeed(
            tokens=keep(tokens, state.dfeed.tokens),
            features=keep(fused_BWE, state.dfeed.features),
        )
        return (
            cache.replace(lengths=keep(d_len, state.dcache.lengths)),
            state.prev,
            keep(num_acc_B + 1, state.draft_pending),
            feed,
        )


TOKEN_DRAFTER = TokenDrafter()
