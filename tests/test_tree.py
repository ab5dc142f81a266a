"""Token-tree speculative sampling: exactness (enumerated target law, two tree shapes, ragged
batch), negative controls on the sibling rule, greedy equivalences (which also pin the per-row KV
compaction), the ancestor-masked cached call against uncached scoring, bad trees."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_models import (
    GREEDY_EOS,
    GREEDY_MAX_NEW,
    GREEDY_PROMPTS,
    greedy_models,
    ragged_prompts,
)
from test_exactness import DRAFT, NUM_SAMPLES, PROMPTS, TARGET, run_test

from specjax.models import split
from specjax.sampling import (
    SamplingConfig,
    autoregressive_sample,
    chain,
    check_tree,
    make_speculative_fn,
    make_tree_speculative_fn,
    tree_speculative_sample,
)

WIDE = ((0,), (1,), (2,), (0, 0))  # three siblings at the root: the sibling rule matters
DEEP = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))  # branching at two depths, depth 3
SETTINGS = {
    'wide_t1': (WIDE, SamplingConfig(1.0)),
    'deep_t07_topk3': (DEEP, SamplingConfig(0.7, top_k=3)),
    'deep_topp08': (DEEP, SamplingConfig(1.0, top_p=0.8)),
    'wide_topk2': (WIDE, SamplingConfig(1.0, top_k=2)),  # the third sibling has nothing left
}


def sample(setting, bug=None, siblings='without_replacement'):
    tree, sampling = SETTINGS[setting]
    depth = max(len(p) for p in tree)
    fn = make_tree_speculative_fn(
        split(TARGET)[0], split(DRAFT)[0], tree=tree, max_new_tokens=depth + 2,
        sampling=sampling, siblings=siblings, _bug=bug,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    return fn(split(TARGET)[1], split(DRAFT)[1], prompts, lengths, 0), depth


def check_tree_invariants(out, tree, max_new):
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    lengths, rounds = np.asarray(out.lengths), s['row_rounds']
    assert ((lengths >= 1) & (lengths <= max_new)).all()
    assert np.isin(lengths - s['row_accepted'] - rounds, [-1, 0]).all()
    assert (np.diff(s['row_accepted_per_position'], axis=1) <= 0).all()  # a path, in order
    assert (s['row_accepted_per_position'] <= s['row_examined_per_position']).all()
    np.testing.assert_array_equal(s['row_drafted'], len(tree) * rounds)
    assert s['accepted'] == s['row_accepted'].sum() and s['batch_rounds'] == rounds.max()


@pytest.mark.parametrize(
    'setting, siblings',
    [
        *((s, 'without_replacement') for s in SETTINGS),
        ('wide_t1', 'iid'),
        ('deep_t07_topk3', 'iid'),
    ],
)
def test_tree_matches_target_distribution(setting, siblings):
    tree, sampling = SETTINGS[setting]
    out, depth = sample(setting, siblings=siblings)
    check_tree_invariants(out, tree, depth + 2)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, depth + 2)
    assert not rejected, (setting, rejected, tv)
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    assert (s['accepted_per_position'] > 0).all()  # every depth was reached and accepted
    assert 0.1 < s['accepted'] / s['examined'] < 0.95


def test_distinct_siblings_accept_more_than_iid_ones():
    """Three siblings at the root: without replacement they never repeat a token, so more rounds
    accept one (binomial spread over 40,000 rows is ~0.003; the gain is several times that)."""
    rates = {}
    for siblings in ('without_replacement', 'iid'):
        out, _ = sample('wide_t1', siblings=siblings)
        s = {name: np.asarray(v) for name, v in out.stats.items()}
        rates[siblings] = s['accepted_per_position'][0] / s['rounds']
    assert rates['without_replacement'] > rates['iid'] + 0.02, rates


@pytest.mark.parametrize('bug', ['stale_residual', 'unmodified_p', 'fixed_q'])
def test_wrong_sibling_rules_are_rejected(bug):
    _, sampling = SETTINGS['wide_t1']
    out, depth = sample('wide_t1', bug=bug)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, depth + 2)
    assert rejected, (bug, tv)


def test_greedy_tree_equals_chain_and_autoregressive():
    """Greedy: the chain-shaped tree reproduces the chain sampler token for token and stat for
    stat; a branching tree reproduces greedy autoregressive decoding with fewer rounds."""
    target, draft = greedy_models()
    greedy = SamplingConfig(0.0)
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, len(GREEDY_PROMPTS))
    kw = dict(max_new_tokens=GREEDY_MAX_NEW, sampling=greedy, eos_id=GREEDY_EOS)
    ref = autoregressive_sample(target, prompts, lengths, rng=0, **kw)
    args = (split(target)[1], split(draft)[1], prompts, lengths, 0)
    chain_fn = make_speculative_fn(split(target)[0], split(draft)[0], num_draft_tokens=3, **kw)
    chain_out = chain_fn(*args)
    as_tree = tree_speculative_sample(
        target, draft, prompts, lengths, tree=chain(3), rng=0, **kw
    )  # fmt: skip
    np.testing.assert_array_equal(as_tree.tokens, chain_out.tokens)
    for name, value in chain_out.stats.items():
        np.testing.assert_array_equal(as_tree.stats[name], value, err_msg=name)
    wide = tree_speculative_sample(target, draft, prompts, lengths, tree=DEEP, rng=0, **kw)
    np.testing.assert_array_equal(wide.tokens, ref.tokens)
    np.testing.assert_array_equal(wide.lengths, ref.lengths)
    assert wide.stats['rounds'] < chain_out.stats['rounds']  # siblings rescue rejections
    check_tree_invariants(wide, DEEP, GREEDY_MAX_NEW)


def test_tree_masked_cached_call_scores_every_path(highest_precision):
    """One cached call over all nodes with the ancestor mask and positions = length + depth gives
    each node the logits of uncached scoring of prompt + its root-to-node path."""
    import jax
    import jax.numpy as jnp
    from sampling_models import full_logits

    from specjax.models import apply_cached, init_cache
    from specjax.sampling import tree as tr
    from specjax.sampling.tree_walk import tree_mask

    target, _ = greedy_models()
    t = tr.tables(check_tree(DEEP))
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS[:3], 3)
    nodes = np.random.default_rng(0).integers(0, 17, (3, t.num_nodes)).astype(np.int32)
    base = lengths - 1  # the root is each prompt's last token
    tokens = np.concatenate([prompts[np.arange(3), base][:, None], nodes], 1)
    cache = init_cache(target.config, 3, 24)
    graphdef, params = split(target)
    call = jax.jit(lambda *a: apply_cached(graphdef, params, *a))
    _, cache = call(jnp.asarray(prompts), jnp.asarray(base), cache)
    positions = jnp.asarray(base)[:, None] + jnp.asarray(t.depth)[None]
    mask = tree_mask(t.ancestor, jnp.asarray(base), cache.capacity)
    logits, _ = call(jnp.asarray(tokens), jnp.zeros(3, jnp.int32), cache, positions, mask)
    seqs, ends = np.zeros((3 * (t.num_nodes + 1), 12), np.int32), []
    for b in range(3):
        for i in range(t.num_nodes + 1):
            path = [j - 1 for j in range(1, t.num_nodes + 1) if t.ancestor[i, j]]
            seq = [*prompts[b, : lengths[b]], *nodes[b, path]]
            seqs[len(ends), : len(seq)] = seq  # right padding: causal, so harmless
            ends.append(len(seq) - 1)
    ref = np.asarray(full_logits(target, seqs))[np.arange(len(ends)), ends]
    np.testing.assert_allclose(logits.reshape(len(ends), -1), ref, atol=1e-5, rtol=1e-5)


def test_greedy_children_rank_like_top_k_ties_included():
    """The greedy tree's argmax passes order children exactly as lax.top_k (ties: lower index)."""
    import jax

    from specjax.sampling.siblings import top_ranked as _top_ranked

    rng = np.random.default_rng(0)
    tied = rng.integers(0, 4, (3, 2, 40)).astype(np.float32)  # many ties
    for top in (1, 2, 3, 5):
        expected = np.asarray(jax.lax.top_k(tied, top)[1])
        np.testing.assert_array_equal(np.asarray(_top_ranked(tied, top)), expected)


def test_tree_canonical_order():
    assert check_tree([(1,), (0, 0), (0,)]) == ((0,), (1,), (0, 0))
    assert chain(2) == ((0,), (0, 0))


@pytest.mark.parametrize(
    'tree, kwargs, match',
    [
        (((0, 1),), {}, r'path \(0, 1\) lacks its prefix \(0,\)'),
        (((0,), (1, 0)), {}, r'lacks its prefix \(1,\)'),
        (((0,), (0,)), {}, r'duplicate path \(0,\)'),
        ((), {}, 'at least one path'),
        (((-1,),), {}, 'ints >= 0'),
        ('abc', {}, 'tuple of paths'),
        (chain(40), {}, 'max_len'),
        (((0,), (1,)), dict(max_new_tokens=45), '2-node tree'),
        (((0,), (17,)), dict(sampling=SamplingConfig(0.0)), 'rank 17 >= vocab_size=17'),
    ],
)  # fmt: skip
def test_bad_trees_raise_before_compiling(tree, kwargs, match):
    target, draft = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, 6)
    args = dict(max_new_tokens=4, sampling=SamplingConfig(1.0), rng=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tree_speculative_sample(target, draft, prompts, lengths, tree=tree, **args)
