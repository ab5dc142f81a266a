"""Feature drafts (EAGLE-3 style) in the chain and tree samplers: the draft's state after every
round equals a from-scratch pass over the accepted context with the target's features; the
output law is the target's (the exactness hypothesis test of tests/test_exactness.py, with and
without a reduced draft vocabulary, in chains, static and dynamic trees, and a negative control
that must be rejected); greedy output is the target's; a chain-shaped tree drives the draft as
the chain does; a dynamic tree's drafting equals from-scratch self-fed scoring; a draft built for
another target is refused before compiling."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sampling_models import check_invariants, make_model, ragged_prompts, tiny_config
from test_exactness import NUM_SAMPLES, PROMPTS, SETTINGS, V, run_test
from test_tree import DEEP

from specjax.models import FeatureDraftConfig, init_cache, split
from specjax.models.feature_draft import from_target
from specjax.sampling import (
    DynamicTree,
    SamplingConfig,
    autoregressive_sample,
    chain,
    common,
    drafters,
    make_speculative_fn,
    make_tree_speculative_fn,
    speculative_sample,
    tree_speculative_sample,
)

TARGET = make_model(tiny_config(V, n_layers=3), seed=0, scale=8.0)
REDUCED_IDS = np.array([4, 0, 2], np.int32)  # draft index i proposes target id REDUCED_IDS[i]


def feature_draft(target, seed=1, draft_vocab_size=None, sharpen=6.0):
    """A random feature draft for `target` with a sharpened head (peaked q, unlike p)."""
    config = FeatureDraftConfig.for_target(target.config, draft_vocab_size=draft_vocab_size)
    draft = from_target(target, config, rngs=nnx.Rngs(seed))
    draft.lm_head[...] = draft.lm_head[...] * sharpen
    return draft


DRAFT = feature_draft(TARGET)
TARGET_GRAPHDEF, DRAFT_GRAPHDEF = split(TARGET)[0], split(DRAFT)[0]
REDUCED_DRAFT = feature_draft(TARGET, seed=2, draft_vocab_size=len(REDUCED_IDS))


@jax.jit
def _padded_scratch(target_params, draft_params, tokens_BT):
    target = nnx.merge(TARGET_GRAPHDEF, target_params)
    draft = nnx.merge(DRAFT_GRAPHDEF, draft_params)
    _, features = target(tokens_BT, feature_layers=draft.config.feature_layers)
    fused = draft.fuse_features(features)
    shifted = jnp.concatenate([jnp.zeros_like(fused[:, :1]), fused[:, :-1]], axis=1)
    return draft(tokens_BT, shifted)[0]


def _from_scratch(contexts, width=24):
    """The draft's logits [B, V_d] after each context (list of ids): one uncached pass with entry
    t pairing c_t with the target's fused feature f_{t-1} (f_{-1} = 0); causal, so the right
    padding does not reach the last real entry."""
    tokens, lengths = ragged_prompts(contexts, len(contexts))
    tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    logits = _padded_scratch(split(TARGET)[1], split(DRAFT)[1], jnp.asarray(tokens))
    return np.asarray(logits)[np.arange(len(contexts)), lengths - 1]


def test_draft_state_after_partial_acceptance_equals_recomputation():
    """Three rounds of a ragged batch (prompt lengths 1, 3, 5) with chosen proposals and
    acceptance counts 0..k: the next round's q_1 equals the from-scratch draft's."""
    k, vocab_size = 3, TARGET.config.vocab_size
    (tgd, tp), (dgd, dp) = split(TARGET), split(DRAFT)
    drafter = drafters.drafter_for(tgd, dgd, 'test')
    contexts = [[2], [1, 4, 3], [0, 2, 2, 1, 4]]
    prompts, lengths = ragged_prompts(contexts, 3)
    prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
    batch, capacity = 3, 32
    tcache = init_cache(TARGET.config, batch, capacity)
    _, tcache, features = drafter.target_call(tgd, tp, prompts, lengths - 1, tcache)
    dcache = init_cache(common.config_of(dgd), batch, capacity)
    dcache, feed = drafter.init(dgd, dp, dcache, prompts, lengths, None, features, k)
    state = types.SimpleNamespace(
        dcache=dcache, dfeed=feed, draft_pending=jnp.ones(batch, jnp.int32),
        prev=jnp.zeros(batch, jnp.int32), last=prompts[jnp.arange(batch), lengths - 1],
    )  # fmt: skip
    active, act = jnp.ones(batch, bool), jnp.ones(batch, jnp.int32)
    rng = np.random.default_rng(0)
    accepted_counts = [[0, 3, 1], [2, 0, 3], [1, 2, 0]]
    for round_counts in accepted_counts:
        logits, carry = drafter.catch_up(dgd, dp, state, active, None)
        np.testing.assert_allclose(np.asarray(logits), _from_scratch(contexts), atol=2e-4)
        x = jnp.asarray(rng.integers(0, vocab_size, (batch, k)), jnp.int32)
        for i in range(k - 1):
            _, carry = drafter.step(dgd, dp, carry, x[:, i], act, None)
        tokens = jnp.concatenate([state.last[:, None], x], axis=1)
        _, tcache, features = drafter.target_call(tgd, tp, tokens, 0 * act, tcache)
        num_acc = jnp.asarray(round_counts, jnp.int32)
        next_token = jnp.asarray(rng.integers(0, vocab_size, batch), jnp.int32)
        tcache = tcache.replace(lengths=tcache.lengths + 1 + num_acc)
        dcache, prev, pending, feed = drafter.after_round(
            state, carry, drafter.fuse(dgd, dp, features), fed=k - 1, x_BK=x, num_acc_B=num_acc,
            next_B=next_token, active_B=active,
        )  # fmt: skip
        state = types.SimpleNamespace(
            dcache=dcache, dfeed=feed, draft_pending=pending, prev=prev, last=next_token
        )
        for row, n in enumerate(round_counts):
            contexts[row] = contexts[row] + [int(t) for t in x[row, :n]] + [int(next_token[row])]
        np.testing.assert_array_equal(  # the target has consumed all but `last`; the draft's
            np.asarray(dcache.lengths + pending),
            np.asarray(tcache.lengths) + 1,  # cache + feed
        )  # is the whole context


def _sample(setting, draft, draft_vocab_ids=None, bug=None, seed=0):
    sampling, k, max_new = SETTINGS[setting]
    fn = make_speculative_fn(
        split(TARGET)[0], split(draft)[0], num_draft_tokens=k, max_new_tokens=max_new,
        sampling=sampling, draft_vocab_ids=draft_vocab_ids, _bug=bug,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    return fn(split(TARGET)[1], split(draft)[1], prompts, lengths, seed)


@pytest.mark.parametrize(
    'setting, reduced', [('t1', False), ('t1', True), ('t07_topk3', True), ('topp08', False)]
)
def test_feature_draft_keeps_the_target_distribution(setting, reduced):
    sampling, k, max_new = SETTINGS[setting]
    draft, ids = (REDUCED_DRAFT, REDUCED_IDS) if reduced else (DRAFT, None)
    out = _sample(setting, draft, ids)
    check_invariants(out, k, max_new)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2, target=TARGET)
    assert not rejected, (setting, reduced, rejected, tv)
    examined, accepted = int(out.stats['examined']), int(out.stats['accepted'])
    assert 0.1 < accepted / examined < 0.9, accepted / examined  # accepts and rejects


def test_negative_control_with_a_feature_draft_is_rejected():
    sampling, k, _ = SETTINGS['t1']
    out = _sample('t1', DRAFT, bug='bonus_from_q')
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2, target=TARGET)
    assert rejected, tv


def test_greedy_output_is_the_targets():
    prompts, lengths = ragged_prompts(([3], [1, 2, 4, 0], [2, 2]), 3)
    greedy, key = SamplingConfig(0.0), jax.random.key(0)
    ref = autoregressive_sample(
        TARGET, prompts, lengths, max_new_tokens=10, sampling=greedy, rng=key
    )
    for draft, ids in ((DRAFT, None), (REDUCED_DRAFT, REDUCED_IDS)):
        out = speculative_sample(
            TARGET, draft, prompts, lengths, num_draft_tokens=3, max_new_tokens=10,
            sampling=greedy, rng=key, draft_vocab_ids=ids,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_a_feature_draft_for_another_target_is_refused_before_compiling():
    other = make_model(tiny_config(V, n_layers=4), seed=5)
    prompts, lengths = ragged_prompts(([1, 2],), 1)
    kw = dict(max_new_tokens=4, sampling=SamplingConfig(1.0), rng=jax.random.key(0))
    with pytest.raises(ValueError, match='n_layers=3, but the target has n_layers=4'):
        speculative_sample(other, DRAFT, prompts, lengths, num_draft_tokens=2, **kw)
    with pytest.raises(ValueError, match='n_layers=3, but the target has n_layers=4'):
        tree_speculative_sample(other, DRAFT, prompts, lengths, tree=((0,), (1,), (0, 0)), **kw)


TREE_SETTINGS = {  # name: (tree, sampling, reduced vocabulary)
    'deep_t1': (DEEP, SamplingConfig(1.0), False),
    'dynamic_t07_topk3_reduced': (DynamicTree(3, 2, 5), SamplingConfig(0.7, top_k=3), True),
}


@pytest.mark.parametrize('name', list(TREE_SETTINGS))
def test_feature_draft_in_trees_keeps_the_target_distribution(name):
    tree, sampling, reduced = TREE_SETTINGS[name]
    draft, ids = (REDUCED_DRAFT, REDUCED_IDS) if reduced else (DRAFT, None)
    depth = tree.depth if isinstance(tree, DynamicTree) else max(len(p) for p in tree)
    fn = make_tree_speculative_fn(
        split(TARGET)[0], split(draft)[0], tree=tree, max_new_tokens=depth + 2,
        sampling=sampling, draft_vocab_ids=ids,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    out = fn(split(TARGET)[1], split(draft)[1], prompts, lengths, 0)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, depth + 2, target=TARGET)
    assert not rejected, (name, rejected, tv)
    s = {k: np.asarray(v) for k, v in out.stats.items()}
    # Depth 3 is rarely reached in the dynamic tree (its nodes hang off the draft's favourite,
    # which these disagreeing models often reject).
    assert (s['accepted_per_position'][:2] > 0).all() and s['accepted'] < s['examined']


def test_feature_draft_chain_shaped_tree_equals_the_chain():
    """Greedy: the chain-shaped tree drives the feature draft as the chain sampler does (nodes
    fed their parent's output state, the accepted path's true features at the next catch-up),
    so tokens and every stat agree; a dynamic tree reproduces the target's greedy output."""
    prompts, lengths = ragged_prompts(([3], [1, 2, 4, 0], [2, 2], [4, 1, 1]), 4)
    kw = dict(max_new_tokens=10, sampling=SamplingConfig(0.0), rng=jax.random.key(0))
    ref = autoregressive_sample(TARGET, prompts, lengths, **kw)
    for draft, ids in ((DRAFT, None), (REDUCED_DRAFT, REDUCED_IDS)):
        chain_out = speculative_sample(
            TARGET, draft, prompts, lengths, num_draft_tokens=3, draft_vocab_ids=ids, **kw
        )
        as_tree = tree_speculative_sample(
            TARGET, draft, prompts, lengths, tree=chain(3), draft_vocab_ids=ids, **kw
        )
        np.testing.assert_array_equal(np.asarray(as_tree.tokens), np.asarray(chain_out.tokens))
        for stat in ('rounds', 'accepted', 'examined', 'accepted_per_position', 'row_rounds'):
            np.testing.assert_array_equal(as_tree.stats[stat], chain_out.stats[stat], stat)
        dynamic = tree_speculative_sample(
            TARGET, draft, prompts, lengths, tree=DynamicTree(3, 2, 5), draft_vocab_ids=ids, **kw
        )
        np.testing.assert_array_equal(np.asarray(dynamic.tokens), np.asarray(ref.tokens))


@jax.jit
def _target_features(target_params, draft_params, tokens_BT):
    """The fused target features paired with each entry (f_{t-1}; f_{-1} = 0) [B, T, E]."""
    target = nnx.merge(TARGET_GRAPHDEF, target_params)
    draft = nnx.merge(DRAFT_GRAPHDEF, draft_params)
    _, features = target(tokens_BT, feature_layers=draft.config.feature_layers)
    fused = draft.fuse_features(features)
    return jnp.concatenate([jnp.zeros_like(fused[:, :1]), fused[:, :-1]], axis=1)


@jax.jit
def _draft_pass(draft_params, tokens_BT, features_BTE):
    return nnx.merge(DRAFT_GRAPHDEF, draft_params)(tokens_BT, features_BTE)


def _self_fed_logits(prompt, path, width=16):
    """The draft's logits after prompt + path from scratch: the prompt's entries with the
    target's features, each path token paired with the draft's output state at the entry before
    it (EAGLE's feature-level autoregression)."""
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(prompt)] = prompt
    tp, dp = split(TARGET)[1], split(DRAFT)[1]
    feats = np.array(_target_features(tp, dp, jnp.asarray(tokens)))
    n = len(prompt)
    for j, x in enumerate(path):
        _, h = _draft_pass(dp, jnp.asarray(tokens), jnp.asarray(feats))
        tokens[0, n + j], feats[0, n + j] = x, np.asarray(h)[0, n + j - 1]
    logits, _ = _draft_pass(dp, jnp.asarray(tokens), jnp.asarray(feats))
    return np.asarray(logits)[0, n + len(path) - 1]


def test_dynamic_tree_of_a_feature_draft_matches_scoring_from_scratch():
    """The cached, batched dynamic drafting with self-fed states picks the nodes, parents and
    child order of an EAGLE-2 over from-scratch self-fed scoring of every path."""
    from test_dynamic_tree import check_drafted_tree, reference_tree

    from specjax.sampling import dynamic_tree as dyn
    from specjax.sampling.draft_vocab import DraftVocab

    spec, contexts = DynamicTree(3, 2, 6), [[2], [1, 4, 3], [0, 2, 2, 1, 4]]
    (tgd, tp), (dgd, dp) = split(TARGET), split(DRAFT)
    drafter = drafters.drafter_for(tgd, dgd, 'test')
    prompts, lengths = (jnp.asarray(a) for a in ragged_prompts(contexts, 3))

    @jax.jit
    def drafted(tp, dp):
        tcache = init_cache(TARGET.config, 3, 24)
        _, _, features = drafter.target_call(tgd, tp, prompts, lengths - 1, tcache)
        dcache = init_cache(common.config_of(dgd), 3, 24)
        dcache, feed = drafter.init(dgd, dp, dcache, prompts, lengths, None, features, 3)
        state = types.SimpleNamespace(
            dcache=dcache, dfeed=feed, draft_pending=jnp.ones(3, jnp.int32),
            prev=jnp.zeros(3, jnp.int32), last=prompts[jnp.arange(3), lengths - 1],
        )  # fmt: skip
        return dyn.draft_dynamic(
            dgd, dp, state, jnp.ones(3, bool), spec=spec, sampling=SamplingConfig(1.0),
            vocab=DraftVocab(V), check_finite=True, drafter=drafter,
        )[0]  # fmt: skip

    tree = jax.device_get(drafted(tp, dp))
    for b, prompt in enumerate(contexts):
        logits_after = lambda path, prompt=prompt: _self_fed_logits(prompt, path)
        check_drafted_tree(tree, b, spec, *reference_tree(logits_after, spec, 1.0))
