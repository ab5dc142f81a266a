"""Dynamic (EAGLE-2) token trees and tree parity with the chain: exactness of every exact tree rule
(enumerated target law, ragged batch, two budgets, reduced draft vocabulary), the negative
control of testing top-ranked candidates with the p/q ratio, the drafted tree against an
independent numpy reimplementation of EAGLE-2's expansion and reranking, greedy equivalence, and
bad budgets and rules refused before compiling."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_models import (
    GREEDY_EOS,
    GREEDY_MAX_NEW,
    GREEDY_PROMPTS,
    full_logits,
    greedy_models,
    ragged_prompts,
)
from test_exactness import DRAFT, NUM_SAMPLES, PROMPTS, TARGET, run_test
from test_tree import DEEP, WIDE, check_tree_invariants

from specjax.models import apply_cached, init_cache, split
from specjax.sampling import (
    DynamicTree,
    SamplingConfig,
    autoregressive_sample,
    make_speculative_fn,
    make_tree_speculative_fn,
    tree_speculative_sample,
)
from specjax.sampling import dynamic_tree as dyn
from specjax.sampling.draft_vocab import DraftVocab

IDS = np.array([3, 0, 4], np.int32)  # a reduced draft vocabulary of V = 5, unsorted
SETTINGS = {  # name: (tree, sampling, acceptance, draft_vocab_ids)
    'dyn_322_t1': (DynamicTree(3, 2, 5), SamplingConfig(1.0), None, None),
    'dyn_236_t07_topk3': (DynamicTree(2, 3, 6), SamplingConfig(0.7, top_k=3), None, None),
    'dyn_334_topp08_ids': (DynamicTree(3, 3, 4), SamplingConfig(1.0, top_p=0.8), None, IDS),
    'dyn_strict_t1': (DynamicTree(3, 2, 6), SamplingConfig(1.0), 'strict', None),
    'wide_argmax_draft_t1': (WIDE, SamplingConfig(1.0), 'argmax_draft', None),
    'deep_strict_t07_topk3': (DEEP, SamplingConfig(0.7, top_k=3), 'strict', None),
    'deep_ids_t1': (DEEP, SamplingConfig(1.0), None, IDS),
}


def _depth(tree):
    return tree.depth if isinstance(tree, DynamicTree) else max(len(p) for p in tree)


def _nodes(tree):
    return tree.nodes if isinstance(tree, DynamicTree) else len(tree)


def sample(setting, bug=None):
    tree, sampling, acceptance, ids = SETTINGS[setting]
    fn = make_tree_speculative_fn(
        split(TARGET)[0], split(DRAFT)[0], tree=tree, max_new_tokens=_depth(tree) + 2,
        sampling=sampling, acceptance=acceptance, draft_vocab_ids=ids, _bug=bug,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    return fn(split(TARGET)[1], split(DRAFT)[1], prompts, lengths, 0)


@pytest.mark.parametrize('setting', list(SETTINGS))
def test_tree_rules_match_target_distribution(setting):
    tree, sampling, _, _ = SETTINGS[setting]
    depth = _depth(tree)
    out = sample(setting)
    check_tree_invariants(out, range(_nodes(tree)), depth + 2)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, depth + 2)
    assert not rejected, (setting, rejected, tv)
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    assert (s['accepted_per_position'] > 0).all()  # every depth was reached and accepted
    assert 0.1 < s['accepted'] / s['examined'] < 0.95


def test_ratio_test_on_top_ranked_candidates_is_rejected():
    """The naive combination: a dynamic tree's deterministic candidates verified as if drawn
    from q (accept with min(1, p/q), residual norm(max(0, p - q)))."""
    _, sampling, _, _ = SETTINGS['dyn_322_t1']
    out = sample('dyn_322_t1', bug='ratio_test')
    rejected, tv = run_test(out.tokens, out.lengths, sampling, 5)
    assert rejected, tv


def reference_tree(logits_after, spec, temperature):
    """EAGLE-2 by hand: the draft's logits after each path (logits_after(path) -> [V], scored from
    scratch), numpy top-k. -> {token path: score} of the N chosen nodes, and each chosen node's
    children in test order."""
    m = spec.expand

    def logprobs(path):
        z = np.asarray(logits_after(path), np.float64) / temperature
        return z - np.logaddexp.reduce(z)

    def expand(path, score):
        lp = logprobs(path)
        top = np.argsort(-lp, kind='stable')[:m]
        return [((*path, int(t)), score + lp[t]) for t in top]

    pool = expand((), 0.0)
    frontier = pool
    for d in range(1, spec.depth):
        block = [c for path, score in frontier for c in expand(path, score)]
        pool += block
        if d + 1 < spec.depth:
            order = sorted(range(len(block)), key=lambda i: (-block[i][1], i))[:m]
            frontier = [block[i] for i in order]
    chosen = sorted(range(len(pool)), key=lambda i: (-pool[i][1], i))[: spec.nodes]
    scores = {pool[i][0]: pool[i][1] for i in chosen}
    kids = {p: sorted((c for c in scores if c[:-1] == p), key=lambda c: -scores[c]) for p in scores}
    kids[()] = sorted((c for c in scores if len(c) == 1), key=lambda c: -scores[c])
    return scores, kids


@pytest.mark.parametrize(
    'spec, temperature', [(DynamicTree(3, 2, 6), 1.0), (DynamicTree(4, 3, 9), 0.7)]
)
def test_drafted_tree_matches_a_numpy_eagle2(spec, temperature):
    """The cached, batched, ragged drafting picks the same nodes, parents and child order as
    scoring every path from scratch."""
    _, draft = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, len(GREEDY_PROMPTS))
    dgd, dparams = split(draft)
    batch = len(lengths)

    @jax.jit
    def drafted(dparams, prompts, lengths):
        cache = init_cache(draft.config, batch, prompts.shape[1] + spec.num_fed + 2)
        _, cache = apply_cached(dgd, dparams, prompts, lengths - 1, cache)
        state = types.SimpleNamespace(
            dcache=cache, last=prompts[jnp.arange(batch), lengths - 1],
            prev=jnp.zeros(batch, jnp.int32), draft_pending=jnp.ones(batch, jnp.int32),
        )  # fmt: skip
        tree, _, _ = dyn.draft_dynamic(
            dgd, dparams, state, jnp.ones(batch, bool), spec=spec,
            sampling=SamplingConfig(temperature), vocab=DraftVocab(17), check_finite=True,
        )  # fmt: skip
        return tree

    tree = jax.device_get(drafted(dparams, jnp.asarray(prompts), jnp.asarray(lengths)))
    for b in range(batch):
        prompt = GREEDY_PROMPTS[b]
        uncached = lambda path, prompt=prompt: full_logits(
            draft, np.array([[*prompt, *path]], np.int32)
        )[0, -1]
        check_drafted_tree(tree, b, spec, *reference_tree(uncached, spec, temperature))


def check_drafted_tree(tree, b, spec, scores, kids):
    """Row b of a DraftedTree holds the reference's nodes, parents and child order."""
    path_of = {0: ()}
    for i in range(1, spec.nodes + 1):  # parents come first: each path extends a known one
        parent = next(u for u in range(i) if i in tree.children_BNR[b, u])
        path_of[i] = (*path_of[parent], int(tree.tokens_BN[b, i - 1]))
        assert tree.depth_BN1[b, i] == len(path_of[i])
        assert tree.ancestor_BNN[b, i].sum() == len(path_of[i]) + 1
    assert set(path_of.values()) - {()} == set(scores), b
    for u, path in path_of.items():
        got = [path_of[int(c)] for c in tree.children_BNR[b, u] if c >= 0]
        assert got == kids[path], (b, path)


def test_greedy_dynamic_tree_equals_autoregressive():
    target, draft = greedy_models()
    greedy = SamplingConfig(0.0)
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, len(GREEDY_PROMPTS))
    kw = dict(max_new_tokens=GREEDY_MAX_NEW, sampling=greedy, eos_id=GREEDY_EOS)
    ref = autoregressive_sample(target, prompts, lengths, rng=0, **kw)
    chain_fn = make_speculative_fn(split(target)[0], split(draft)[0], num_draft_tokens=4, **kw)
    chain_out = chain_fn(split(target)[1], split(draft)[1], prompts, lengths, 0)
    spec = DynamicTree(4, 3, 10)
    out = tree_speculative_sample(target, draft, prompts, lengths, tree=spec, rng=0, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    assert out.stats['rounds'] < chain_out.stats['rounds']
    check_tree_invariants(out, range(spec.nodes), GREEDY_MAX_NEW)


@pytest.mark.parametrize(
    'tree, kwargs, match',
    [
        (DynamicTree(2, 2, 3), dict(acceptance='probabilistic'), 'not samples of q'),
        (WIDE, dict(acceptance='lenient'), 'lossy rules verify chains only'),
        (DynamicTree(2, 18, 3), {}, 'DynamicTree.expand=18 exceeds the 17 tokens'),
        (DynamicTree(2, 3, 2), dict(draft_vocab_ids=[1, 2]), 'expand=3 exceeds the 2 tokens'),
        (((0,), (2,)), dict(draft_vocab_ids=[1, 2]), 'rank 2 >= vocab_size=2'),
        (DynamicTree(3, 2, 4), dict(max_new_tokens=44), '4-node tree'),
    ],
)  # fmt: skip
def test_bad_dynamic_trees_raise_before_compiling(tree, kwargs, match):
    target, draft = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, 6)
    args = dict(max_new_tokens=4, sampling=SamplingConfig(1.0), rng=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tree_speculative_sample(target, draft, prompts, lengths, tree=tree, **args)


@pytest.mark.parametrize(
    'fields, match',
    [
        ((0, 2, 3), 'DynamicTree.depth must be an int >= 1, got 0'),
        ((2, 2.5, 3), 'DynamicTree.expand must be an int >= 1, got 2.5'),
        ((2, 2, 7), 'DynamicTree.nodes=7 exceeds the 6 candidates'),
    ],
)
def test_bad_budgets_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        DynamicTree(*fields)
