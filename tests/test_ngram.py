"""The n-gram (prompt-lookup) draft: its lookup against a plain-Python statement, greedy outputs
equal to the target's greedy decoding (chains and trees), the exact law at T > 0 by the
hypothesis test of test_exactness (with a negative control that must fail), and its refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from sampling_models import make_model, ragged_prompts, tiny_config
from test_exactness import holm_rejects, max_tv, pvalues, truth

from specjax.models import split
from specjax.sampling import (
    DynamicTree,
    NGramDraft,
    SamplingConfig,
    autoregressive_sample,
    make_speculative_fn,
    make_tree_speculative_fn,
    ngram_tree_paths,
    speculative_sample,
    tree_speculative_sample,
)
from specjax.sampling.ngram import lookup, lookup_reference

V = 5
NUM_SAMPLES = 40_000
# Repetitive prompts of two lengths: the lookup finds matches from the first round on.
PROMPTS = ([1, 3, 1, 3, 1], [4, 0, 2, 4, 0, 2, 4])
TARGET = make_model(tiny_config(V), seed=0, scale=8.0)
DRAFT = NGramDraft(max_n=2, min_n=1)


def test_lookup_matches_the_plain_statement():
    rng = np.random.default_rng(0)
    for _ in range(300):
        length = int(rng.integers(1, 24))
        ctx = rng.integers(0, 3, size=length).tolist()
        exclude = [int(e) for e in rng.integers(-1, 3, size=2)]
        buf = np.zeros((1, 30), np.int32)
        buf[0, :length] = ctx
        x, found, n = lookup(
            jnp.asarray(buf), jnp.array([length]), k=5, max_n=3, min_n=1,
            exclude_BR=jnp.asarray([exclude], jnp.int32),
        )  # fmt: skip
        want, want_n = lookup_reference(ctx, k=5, max_n=3, min_n=1, exclude=exclude)
        assert bool(found[0]) == (want is not None), ctx
        if want is not None:
            assert (np.asarray(x[0]).tolist(), int(n[0])) == (want, want_n), (ctx, exclude)


def test_lookup_continues_a_loop_past_the_context():
    """The latest match of [7, 8] ends 2 tokens before the end: the period-2 loop is proposed."""
    want, n = lookup_reference([5, 7, 8, 9, 7, 8], k=5, max_n=2, min_n=1)
    assert (want, n) == ([9, 7, 8, 9, 7], 2)
    assert lookup_reference([1, 2, 3], k=3, max_n=2, min_n=1) == (None, 0)


@pytest.mark.parametrize('k,by_n', [(1, ()), (4, ()), (4, (0, 2, 4))])
def test_greedy_chain_equals_greedy_target(k, by_n):
    cfg = tiny_config(7, max_len=64)
    target = make_model(cfg, seed=3, scale=6.0)
    prompts, lengths = ragged_prompts(([1, 2, 3, 1, 2], [6, 5], [4, 4, 4, 0, 1, 4, 4]), 6)
    g = SamplingConfig(0.0)
    want = autoregressive_sample(target, prompts, lengths, max_new_tokens=24, sampling=g, rng=0,
                                 eos_id=5)  # fmt: skip
    got = speculative_sample(target, NGramDraft(3, 1, by_n), prompts, lengths,
                             num_draft_tokens=k, max_new_tokens=24, sampling=g, rng=0,
                             eos_id=5)  # fmt: skip
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    assert int(got.stats['accepted']) > 0  # the lookup proposed something that held
    assert int(got.stats['target_calls']) < int(want.stats['target_calls'])


def test_greedy_tree_equals_greedy_target():
    cfg = tiny_config(7, max_len=64)
    target = make_model(cfg, seed=3, scale=6.0)
    prompts, lengths = ragged_prompts(([1, 2, 3, 1, 2, 4, 1, 2], [6, 5]), 4)
    g = SamplingConfig(0.0)
    want = autoregressive_sample(target, prompts, lengths, max_new_tokens=20, sampling=g, rng=0)
    got = tree_speculative_sample(target, NGramDraft(2, 1), prompts, lengths,
                                  tree=ngram_tree_paths(2, 3), max_new_tokens=20, sampling=g,
                                  rng=0)  # fmt: skip
    np.testing.assert_array_equal(got.tokens, want.tokens)


def _run(sampler, sampling, m):
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    out = sampler(split(TARGET)[1], (), prompts, lengths, 0)
    tokens = np.asarray(out.tokens)[:, :m]
    assert (np.asarray(out.lengths) >= m).all()
    pvals, tv = {}, 0.0
    for j, prompt in enumerate(PROMPTS):
        joint = truth(TARGET, prompt, sampling, m)
        rows = tokens[j :: len(PROMPTS)]
        pvals.update({f'prompt{j}.{name}': p for name, p in pvalues(rows, joint).items()})
        tv = max(tv, max_tv(rows, joint))
    return out, holm_rejects(pvals), tv


CHAIN_SETTINGS = {'t1': (SamplingConfig(1.0), 3), 't07_topk3': (SamplingConfig(0.7, top_k=3), 2)}


@pytest.mark.parametrize('setting', list(CHAIN_SETTINGS))
def test_chain_matches_target_distribution(setting):
    sampling, k = CHAIN_SETTINGS[setting]
    fn = make_speculative_fn(split(TARGET)[0], DRAFT, num_draft_tokens=k,
                             max_new_tokens=k + 2, sampling=sampling)  # fmt: skip
    out, rejected, tv = _run(fn, sampling, k + 2)
    assert not rejected, (setting, rejected, tv)
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    assert (s['row_drafted'] % k == 0).all()  # k proposals a round, or none
    assert (s['row_drafted'] <= k * s['row_rounds']).all()
    assert (s['row_draft_calls'] == 0).all()  # no model: no draft calls
    accepted, examined = int(out.stats['accepted']), int(out.stats['examined'])
    assert 0.1 < accepted / examined < 0.9  # both branches exercised


def test_proposals_follow_the_match_length():
    by_n = NGramDraft(3, 1, (0, 2, 5))
    found = jnp.array([True, True, True, True, False])
    n = jnp.array([1, 2, 3, 3, 0])
    np.testing.assert_array_equal(by_n.proposals(found, n, 4), [0, 2, 4, 4, 0])  # capped at k
    np.testing.assert_array_equal(NGramDraft(3, 1).proposals(found, n, 4), [4, 4, 4, 4, 0])


def test_chain_with_proposals_by_match_length_matches_target_distribution():
    """1 proposal after a 1-gram match, 3 after a 2-gram one: the count is a function of the
    context, so the law is the target's; both counts occur."""
    sampling, k = CHAIN_SETTINGS['t1']
    fn = make_speculative_fn(split(TARGET)[0], NGramDraft(2, 1, (1, 3)), num_draft_tokens=k,
                             max_new_tokens=k + 2, sampling=sampling)  # fmt: skip
    out, rejected, tv = _run(fn, sampling, k + 2)
    assert not rejected, (rejected, tv)
    drafted = np.asarray(out.stats['row_drafted'])
    assert (drafted % k != 0).any() and (drafted >= k).any(), np.unique(drafted)


def test_soft_q_negative_control_is_rejected():
    sampling, k = CHAIN_SETTINGS['t1']
    fn = make_speculative_fn(
        split(TARGET)[0], DRAFT, num_draft_tokens=k, max_new_tokens=k + 2, sampling=sampling,
        _bug='ngram_soft_q',
    )  # fmt: skip
    _, rejected, tv = _run(fn, sampling, k + 2)
    assert rejected, tv


@pytest.mark.parametrize('rule', ['argmax_draft', 'strict'])
def test_tree_matches_target_distribution(rule):
    sampling = SamplingConfig(1.0)
    tree = ngram_tree_paths(2, 2)
    fn = make_tree_speculative_fn(split(TARGET)[0], DRAFT, tree=tree, max_new_tokens=4,
                                  sampling=sampling, acceptance=rule)  # fmt: skip
    out, rejected, tv = _run(fn, sampling, 4)
    assert not rejected, (rule, rejected, tv)
    accepted, examined = int(out.stats['accepted']), int(out.stats['examined'])
    assert 0.1 < accepted / examined < 0.95


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match='min_n=3 must not exceed max_n=2'):
        NGramDraft(max_n=2, min_n=3)
    with pytest.raises(ValueError, match='NGramDraft.max_n'):
        NGramDraft(max_n=0)
    for bad in ((4, 8), (0, -1, 4), (0, 2.5, 4), '048'):
        with pytest.raises(ValueError, match=r'NGramDraft.proposals_by_n must be'):
            NGramDraft(3, 1, bad)
    tgd = split(TARGET)[0]
    g = SamplingConfig(1.0)
    with pytest.raises(ValueError, match=r'chains under the root.*\(0, 1\)'):
        make_tree_speculative_fn(tgd, DRAFT, tree=((0,), (0, 1)), max_new_tokens=4, sampling=g)
    with pytest.raises(ValueError, match='static trees only'):
        make_tree_speculative_fn(tgd, DRAFT, tree=DynamicTree(2, 2, 4), max_new_tokens=4,
                                 sampling=g)  # fmt: skip
    with pytest.raises(ValueError, match=r'proposals_by_n applies to chains.*\(1, 2\)'):
        make_tree_speculative_fn(tgd, NGramDraft(2, 1, (1, 2)), tree=ngram_tree_paths(2, 2),
                                 max_new_tokens=4, sampling=g)  # fmt: skip
    with pytest.raises(ValueError, match='chosen by the draft'):
        make_tree_speculative_fn(tgd, DRAFT, tree=ngram_tree_paths(2, 2), max_new_tokens=4,
                                 sampling=g, acceptance='probabilistic')  # fmt: skip
