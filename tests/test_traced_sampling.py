"""Traced sampling values: settings share compiled programs and give the static path's tokens.

The reference is each sampler's own core jitted with the SamplingConfig static (Python branches,
the temperature a constant): the traced forms must reproduce its tokens, lengths and statistics
bit for bit under the same key, while compiling once for several settings. The negative control
(different temperatures, same key, different tokens) shows the values reach the shared program.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampling_models import GREEDY_PROMPTS, greedy_models, ragged_prompts

from specjax.models import split
from specjax.sampling import (
    PAD_ID,
    SamplingConfig,
    common,
    make_autoregressive_fn,
    make_speculative_fn,
    rescore,
    transform_logits,
)
from specjax.sampling import stats as st

T0, T07, T1 = SamplingConfig(0.0), SamplingConfig(0.7), SamplingConfig(1.0)
TOP_P = SamplingConfig(1.0, top_p=0.8)
TOP_K = SamplingConfig(0.7, top_k=3)
MAX_NEW, BATCH, K = 8, 6, 2


def _static(fn, sampling):
    """fn's core with `sampling` (and its Stop) static: what the samplers compiled before values
    were traced."""
    jitted = jax.jit(lambda *args: fn.core(*args, (sampling, fn.values[1])))
    return lambda *args: jitted(*fn.place(args)[:-1])  # placed args without the traced values


def _equal(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert set(a.stats) == set(b.stats)
    for name in a.stats:
        np.testing.assert_array_equal(a.stats[name], b.stats[name], err_msg=name)


@pytest.fixture(scope='module')
def pair():
    target, draft = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, BATCH)
    return split(target), split(draft), prompts, lengths


def test_transform_equals_static_bit_for_bit():
    logits = 3.0 * jax.random.normal(jax.random.key(1), (4, 3, 33))
    static = jax.jit(transform_logits, static_argnums=1)
    traced = jax.jit(lambda x, s: transform_logits(x, s))  # its own cache (jit shares per fn)
    for sampling in (T0, T07, T1, TOP_P, TOP_K):
        want = static(logits, sampling)
        for dynamic in (False, True):
            got = traced(logits, sampling.traced(dynamic))
            np.testing.assert_array_equal(got, want, err_msg=f'{sampling} dynamic={dynamic}')
    assert traced._cache_size() == 4 + 2  # T0, T > 0, TOP_P, TOP_K; dynamic: top_k 0 and 3


def test_speculative_settings_share_one_program_and_match_static(pair):
    (tgd, tp), (dgd, dp), prompts, lengths = pair
    make = lambda s, dynamic=False: make_speculative_fn(
        tgd, dgd, num_draft_tokens=K, max_new_tokens=MAX_NEW, sampling=s, dynamic_sampling=dynamic
    )
    args = (tp, dp, prompts, lengths, 3)
    # Same structure (T > 0, no top-p): one jit, one compile, the static path's outputs.
    out07, out1 = make(T07)(*args), make(T1)(*args)
    assert make(T07)._jitted is make(T1)._jitted and make(T1)._jitted._cache_size() == 1
    _equal(out07, _static(make(T07), T07)(*args))
    assert not np.array_equal(out07.tokens, out1.tokens)  # the values reach the program
    # dynamic_sampling: greedy and top-p join one more program of the same jit.
    outs = {s: make(s, True)(*args) for s in (T0, T07, TOP_P)}
    assert make(T0, True)._jitted._cache_size() == 2
    _equal(outs[T0], _static(make(T0), T0)(*args))  # greedy under lax.cond
    _equal(outs[T07], out07)
    assert not np.array_equal(outs[TOP_P].tokens, out1.tokens)


def test_autoregressive_dynamic_sampling_shares_one_program_and_matches_static(pair):
    (tgd, tp), _, prompts, lengths = pair
    make = lambda s, dynamic: make_autoregressive_fn(
        tgd, max_new_tokens=MAX_NEW, sampling=s, dynamic_sampling=dynamic
    )
    args = (tp, prompts, lengths, 3)
    outs = {s: make(s, True)(*args) for s in (T0, T07, TOP_P)}
    assert make(T0, True)._jitted._cache_size() == 1
    for s in (T0, TOP_P):
        _equal(outs[s], _static(make(s, False), s)(*args))
    assert not np.array_equal(outs[T07].tokens, outs[TOP_P].tokens)


def _truncated(out, n):
    """out's rows cut to their first n tokens (PAD_ID after), as a sampler built for n gives."""
    lengths = np.minimum(np.asarray(out.lengths), n)
    tokens = np.where(np.arange(out.tokens.shape[1]) < lengths[:, None], out.tokens, PAD_ID)
    return tokens, lengths


def _at_eos(out, eos):
    """out's rows cut just after their first eos (kept), PAD_ID after."""
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths).copy()
    for b in range(len(lengths)):
        hits = np.flatnonzero(tokens[b, : lengths[b]] == eos)
        lengths[b] = hits[0] + 1 if len(hits) else lengths[b]
    return _truncated(common.SampleOutput(tokens, lengths, {}), MAX_NEW)


@pytest.mark.parametrize('method', ['autoregressive', 'speculative'])
def test_token_limit_and_eos_are_run_time_values_of_one_program(pair, method):
    """with_max_new(n) and eos_id are jit arguments: the same compiled program gives what a
    sampler built for n tokens gives, and each row cut just after its first eos; the buffer
    (max_new_tokens) bounds n. Negative control: the cut changes the outputs."""
    (tgd, tp), (dgd, dp), prompts, lengths = pair
    if method == 'autoregressive':
        make = lambda n, eos=None: make_autoregressive_fn(
            tgd, max_new_tokens=n, sampling=T1, eos_id=eos
        )
        args = (tp, prompts, lengths, 5)
    else:
        make = lambda n, eos=None: make_speculative_fn(
            tgd, dgd, num_draft_tokens=K, max_new_tokens=n, sampling=T1, eos_id=eos
        )
        args = (tp, dp, prompts, lengths, 5)
    full = make(MAX_NEW)(*args)
    programs = make(MAX_NEW)._jitted._cache_size()  # this module's earlier tests share the jit
    short = make(MAX_NEW).with_max_new(3)(*args)
    want = make(3)(*args)  # its own buffer: another program
    np.testing.assert_array_equal(short.tokens[:, :3], want.tokens)
    np.testing.assert_array_equal(short.lengths, want.lengths)
    for name in ('row_emitted', 'row_rounds', 'row_accepted', 'row_drafted'):
        if name in want.stats:
            np.testing.assert_array_equal(short.stats[name], want.stats[name], err_msg=name)
    np.testing.assert_array_equal(short.tokens, _truncated(full, 3)[0])
    eos = int(np.asarray(full.tokens)[0, 2])  # a token row 0 emits third
    cut = make(MAX_NEW, eos)(*args)
    tokens, lens = _at_eos(full, eos)
    np.testing.assert_array_equal(cut.lengths, lens)
    np.testing.assert_array_equal(cut.tokens, tokens)
    assert int(cut.lengths[0]) <= 3 < int(full.lengths[0])  # the eos reached the program
    assert make(MAX_NEW)._jitted is make(MAX_NEW, eos)._jitted
    assert make(MAX_NEW)._jitted._cache_size() == programs  # limits 8 and 3, eos none and set
    with pytest.raises(ValueError, match='max_new <= its max_new_tokens=8'):
        make(MAX_NEW).with_max_new(MAX_NEW + 1)


@pytest.mark.parametrize('sampling', [T0, T07, TOP_P], ids=str)
def test_dynamic_alpha_equals_static(sampling):
    keys = jax.random.split(jax.random.key(2))
    p, q = (3.0 * jax.random.normal(key, (4, 3, 33)) for key in keys)
    static = jax.jit(st.alpha_per_position, static_argnums=2)(p, q, sampling)
    np.testing.assert_array_equal(
        jax.jit(st.alpha_per_position)(p, q, sampling.traced(True)), static
    )


def test_alpha_of_sequences_compiles_once_for_every_setting(pair):
    target, draft = greedy_models()
    _, _, prompts, lengths = pair
    tokens = np.arange(BATCH * MAX_NEW).reshape(BATCH, MAX_NEW) % 17
    gen = np.full(BATCH, MAX_NEW, np.int32)
    before = rescore._alpha_of_sequences._cache_size()
    alpha = {
        s: rescore.alpha_of_sequences(target, draft, prompts, lengths, tokens, gen, s)[0]
        for s in (T0, T07, TOP_P)
    }
    assert rescore._alpha_of_sequences._cache_size() == before + 1
    assert set(np.unique(alpha[T0])) <= {0.0, 1.0}  # argmax agreement at T = 0 ...
    assert not np.array_equal(alpha[T07], alpha[TOP_P])  # ... and each setting's own alpha
