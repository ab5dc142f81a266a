"""Speculative sampler: greedy equivalence, draft = target, eos, stats, cache protocol, checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_models import (
    GREEDY_EOS,
    GREEDY_MAX_NEW,
    GREEDY_PROMPTS,
    check_invariants,
    full_logits,
    greedy_models,
    make_model,
    ragged_prompts,
    tiny_config,
)
from scipy import stats as sps
from test_exactness import SETTINGS, TARGET, sample

from specjax.models import apply_cached, init_cache, split
from specjax.sampling import (
    SamplingConfig,
    autoregressive_sample,
    check_same_tokenizer,
    inverse_cdf,
    make_speculative_fn,
    residual,
    speculative_sample,
    verify,
    verify_greedy,
)

GREEDY = SamplingConfig(0.0)
BATCH = 12  # every greedy prompt twice


def first_difference_is_tie(target, prompt, a, b):
    """Whether rows a and b first differ where the target's top-2 logit margin is < 1e-4."""
    diff = np.flatnonzero(a != b)
    if not len(diff):
        return True
    seq = np.array([[*prompt, *a[: diff[0]]]], np.int32)
    top2 = np.sort(np.asarray(full_logits(target, seq))[0, -1])[-2:]
    return top2[1] - top2[0] < 1e-4


@pytest.fixture(scope='module')
def greedy_reference():
    target, _ = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, BATCH)
    out = autoregressive_sample(
        target, prompts, lengths, max_new_tokens=GREEDY_MAX_NEW, sampling=GREEDY, rng=0,
        eos_id=GREEDY_EOS,
    )  # fmt: skip
    return prompts, lengths, out


@pytest.mark.parametrize('k', [1, 2, 4])
def test_greedy_speculative_equals_greedy_autoregressive(greedy_reference, k):
    target, draft = greedy_models()
    prompts, prompt_lengths, reference = greedy_reference
    ref_lengths = np.asarray(reference.lengths)
    assert 0 < (ref_lengths < GREEDY_MAX_NEW).sum() < BATCH  # rows end by eos and by length
    fn = make_speculative_fn(
        split(target)[0], split(draft)[0], num_draft_tokens=k, max_new_tokens=GREEDY_MAX_NEW,
        sampling=GREEDY, eos_id=GREEDY_EOS,
    )  # fmt: skip
    out = fn(split(target)[1], split(draft)[1], prompts, prompt_lengths, 0)
    check_invariants(out, k, GREEDY_MAX_NEW)
    tokens, ref = np.asarray(out.tokens), np.asarray(reference.tokens)
    for row in range(BATCH):
        prompt = prompts[row, : prompt_lengths[row]]
        assert first_difference_is_tie(target, prompt, tokens[row], ref[row]), row
    np.testing.assert_array_equal(out.lengths, ref_lengths)
    rate = out.stats['accepted'] / out.stats['examined']
    assert 0.1 < rate < 0.9  # both accept and reject paths ran

    # draft = target: all proposals accepted; the exact counts follow from the lengths alone,
    # so nothing after an eos (even mid-block) is counted.
    same = fn(split(target)[1], split(target)[1], prompts, prompt_lengths, 0)
    np.testing.assert_array_equal(same.tokens, ref)
    rounds = -(-ref_lengths // (k + 1))
    last = ref_lengths - (rounds - 1) * (k + 1)
    accepted = (rounds - 1) * k + np.minimum(last, k)
    np.testing.assert_array_equal(same.stats['row_rounds'], rounds)
    np.testing.assert_array_equal(same.stats['row_accepted'], accepted)
    np.testing.assert_array_equal(same.stats['row_examined'], accepted)


def test_draft_equal_to_target_accepts_everything():
    """T = 1, draft = target: acceptance rate 1 and tau = k + 1 (max_new_tokens = 2(k + 1))."""
    _, k, max_new = SETTINGS['t1']
    assert max_new % (k + 1) == 0
    out = sample('t1', draft=TARGET)
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    assert s['accepted'] == s['examined'] == s['drafted']
    np.testing.assert_array_equal(out.lengths, max_new)
    np.testing.assert_array_equal(s['row_rounds'], max_new // (k + 1))
    assert s['emitted'] / s['rounds'] == k + 1
    np.testing.assert_array_equal(s['accepted_per_position'], s['rounds'])
    check_invariants(out, k, max_new)


def test_cached_verification_equals_uncached_scoring(highest_precision):
    """The sampler's cache protocol (prefill L-1, (k+1)-token verify, rollback, 2-token
    catch-up, single-token steps) reproduces uncached logits at every scored position."""
    target, _ = greedy_models()
    graphdef, params = split(target)
    k, batch = 3, 4
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS[:batch], batch)
    rng = np.random.default_rng(0)
    seqs = np.concatenate([prompts, np.zeros((batch, 12), np.int32)], 1)
    ends = lengths.copy()  # each row's sequence is seqs[b, :ends[b]]

    def extend(tokens_BT, counts):
        for b in range(batch):
            seqs[b, ends[b] : ends[b] + tokens_BT.shape[1]] = tokens_BT[b]
        ref = np.asarray(full_logits(target, seqs))
        pos = ends[:, None] + np.arange(tokens_BT.shape[1])[None, :]
        ends[:] += counts
        return ref[np.arange(batch)[:, None], pos]

    call = jax.jit(lambda p, t, n, c: apply_cached(graphdef, p, t, n, c))
    cache = init_cache(target.config, batch, 24)
    _, cache = call(params, jnp.asarray(prompts), jnp.asarray(lengths - 1), cache)
    for accepted in ([0, 3, 1, 2], [2, 0, 3, 1]):  # two rounds, ragged rollbacks
        block = np.concatenate(
            [seqs[np.arange(batch), ends - 1][:, None], rng.integers(0, 17, (batch, k))], 1
        )
        ends -= 1
        ref = extend(block, 0)
        logits, cache = call(params, jnp.asarray(block), jnp.zeros(batch, jnp.int32), cache)
        np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=1e-5)
        keep = 1 + np.array(accepted)
        cache = cache.replace(lengths=cache.lengths + keep)
        ends += keep  # the row's context now ends after the kept tokens; the next is fresh
        seqs[np.arange(batch), ends] = rng.integers(0, 17, batch)
        ends += 1
    # Draft-style catch-up: 2 tokens with 1 or 2 valid, then a single-token step.
    pending = np.array([1, 2, 2, 1])
    two = np.stack([seqs[np.arange(batch), ends - pending], seqs[np.arange(batch), ends - 1]], 1)
    two[pending == 1] = np.stack([two[pending == 1, 1], np.zeros((pending == 1).sum())], 1)
    cache = cache.replace(lengths=jnp.asarray(ends - pending, jnp.int32))
    logits, cache = call(params, jnp.asarray(two), jnp.asarray(pending), cache)
    ref = np.asarray(full_logits(target, seqs))[np.arange(batch), ends - 1]
    np.testing.assert_allclose(logits[np.arange(batch), pending - 1], ref, atol=1e-5, rtol=1e-5)
    step = rng.integers(0, 17, (batch, 1))
    logits, _ = call(params, jnp.asarray(step), jnp.ones(batch, jnp.int32), cache)
    np.testing.assert_allclose(logits[:, 0], extend(step, 1)[:, 0], atol=1e-5, rtol=1e-5)


def test_same_settings_never_recompile():
    target, draft = greedy_models()
    kwargs = dict(num_draft_tokens=2, max_new_tokens=GREEDY_MAX_NEW, sampling=GREEDY)
    fn = make_speculative_fn(split(target)[0], split(draft)[0], eos_id=GREEDY_EOS, **kwargs)
    again = make_speculative_fn(split(target)[0], split(draft)[0], eos_id=GREEDY_EOS, **kwargs)
    assert fn is again
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, BATCH)
    fn(split(target)[1], split(draft)[1], prompts, lengths, 0)
    fn(split(draft)[1], split(target)[1], prompts, lengths[::-1].copy(), 5)
    assert fn._jitted._cache_size() == 1


def _bad(**overrides):
    target, draft = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, BATCH)
    args = dict(
        target=target, draft=draft, prompts=prompts, prompt_lengths=lengths,
        num_draft_tokens=2, max_new_tokens=4, sampling=GREEDY, rng=0, eos_id=None,
    )  # fmt: skip
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    'overrides, match',
    [
        (dict(num_draft_tokens=0), 'num_draft_tokens'),
        (dict(max_new_tokens=0), 'max_new_tokens'),
        (dict(sampling={'temperature': 1.0}), 'sampling'),
        (dict(prompt_lengths=np.full(BATCH, 7, np.int32)), r'prompt_lengths\[0\]=7'),
        (dict(prompt_lengths=np.zeros(BATCH, np.int32)), r'prompt_lengths\[0\]=0'),
        (dict(prompt_lengths=np.ones(BATCH + 1, np.int32)), 'prompt_lengths must have shape'),
        (dict(prompts=np.zeros((BATCH,), np.int32)), 'prompts must be'),
        (dict(prompts=np.zeros((BATCH, 6), np.float32)), 'dtype'),
        (dict(max_new_tokens=40), 'max_len'),
        (dict(num_draft_tokens=40), 'max_len'),
        (dict(eos_id=17), 'eos_id=17'),
        (dict(draft=make_model(tiny_config(vocab_size=9), 0)), 'vocab_size'),
        (dict(draft=make_model(tiny_config(vocab_size=17, max_len=12), 0)), 'draft'),
    ],
)
def test_bad_arguments_raise_before_compiling(overrides, match):
    args = _bad(**overrides)
    with pytest.raises(ValueError, match=match):
        speculative_sample(**args)


def test_bad_sampling_configs_raise():
    for kwargs, match in [
        (dict(temperature=-0.5), 'temperature'),
        (dict(top_k=-1), 'top_k'),
        (dict(top_p=0.0), 'top_p'),
        (dict(top_p=1.5), r'top_p .*1\.5'),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**kwargs)


def test_check_same_tokenizer():
    a = {'tokenizer': {'kind': 'sentencepiece', 'hash': 'abc'}, 'step': 3}
    check_same_tokenizer(a, {'tokenizer': {'kind': 'sentencepiece', 'hash': 'abc'}})
    with pytest.raises(ValueError, match='tokenizer'):
        check_same_tokenizer(a, {'tokenizer': {'kind': 'sentencepiece', 'hash': 'xyz'}})


def test_greedy_models_are_sharp():
    """Greedy tests assume clear argmaxes: most top-2 margins are far above the tie threshold."""
    target, _ = greedy_models()
    logits = np.sort(np.asarray(full_logits(target, np.arange(17)[None])), -1)[0]
    assert np.median(logits[:, -1] - logits[:, -2]) > 0.1


def test_verify_emits_p_at_every_position_for_any_q():
    """The acceptance math alone (fixed p_1..p_{k+1}, q_1..q_k, no model): the token emitted at
    position i, given the round got that far, is distributed as p_i."""
    vocab, k, n = 6, 3, 60_000
    rng = np.random.default_rng(7)
    p = jax.nn.softmax(2.0 * rng.standard_normal((k + 1, vocab), np.float32), -1)
    q = jax.nn.softmax(2.0 * rng.standard_normal((k, vocab), np.float32), -1)
    p = p.at[1].set(jnp.array([0.0, 0.5, 0.0, 0.3, 0.2, 0.0]))  # zero-mass tokens (top-k/p)
    u = rng.random((n, 2 * k + 1), np.float32)
    p_all, q_all = jnp.broadcast_to(p, (n, k + 1, vocab)), jnp.broadcast_to(q, (n, k, vocab))
    x = jax.jit(inverse_cdf)(q_all, u[:, :k])
    num, nxt = jax.jit(verify)(u[:, k : 2 * k], u[:, 2 * k], p_all, q_all, x)
    num, nxt, x = np.asarray(num), np.asarray(nxt), np.asarray(x)
    for i in range(k + 1):
        reached = num >= i
        token = np.where(num > i, x[:, min(i, k - 1)], nxt)[reached]
        expected = np.asarray(p[i], np.float64)
        expected *= reached.sum() / expected.sum()
        counts = np.bincount(token, minlength=vocab)
        assert (counts[expected == 0] == 0).all()
        pvalue = sps.chisquare(counts[expected > 0], expected[expected > 0]).pvalue
        assert pvalue > 1e-4, (i, counts, expected)


def test_residual_and_greedy_verify_by_hand():
    p = jnp.array([0.5, 0.3, 0.2, 0.0])
    q = jnp.array([0.2, 0.5, 0.1, 0.2])
    np.testing.assert_allclose(residual(p, q), [0.75, 0.0, 0.25, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(residual(p, p), p)  # no residual mass: sample p itself
    eye = jnp.eye(5)
    p_BKV = eye[jnp.array([[1, 2, 3, 4], [1, 0, 3, 4], [0, 2, 3, 4]])]
    x = jnp.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    num, nxt = verify_greedy(p_BKV, x)
    np.testing.assert_array_equal(num, [3, 1, 0])
    np.testing.assert_array_equal(nxt, [4, 0, 0])


def test_ahead_of_time_lowering_matches_the_call():
    target, draft = greedy_models()
    fn = make_speculative_fn(
        split(target)[0], split(draft)[0], num_draft_tokens=2, max_new_tokens=GREEDY_MAX_NEW,
        sampling=GREEDY, eos_id=GREEDY_EOS,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, BATCH)
    args = (split(target)[1], split(draft)[1], prompts, lengths, 0)
    compiled = fn.lower(*args).compile()
    np.testing.assert_array_equal(compiled(*fn.place(args)).tokens, fn(*args).tokens)
