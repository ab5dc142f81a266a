"""Confidence-stopped chains (`stop_below`): a row stops proposing after a proposal its draft gives
probability below h. The number of proposals is a stopping time of the draft's draws, so the
output law stays the target's: the exactness hypothesis test of tests/test_exactness.py with
token and feature drafts, a negative control (the low-confidence proposal dropped instead of
proposed) that must be rejected, h = 0 equal to the fixed chain token for token, greedy output
the target's, and bad h refused before compiling."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampling_models import ragged_prompts
from test_exactness import DRAFT, NUM_SAMPLES, PROMPTS, SETTINGS, TARGET, run_test
from test_feature_sampling import DRAFT as FEATURE_DRAFT
from test_feature_sampling import TARGET as FEATURE_TARGET

from specjax.models import split
from specjax.sampling import (
    SamplingConfig,
    autoregressive_sample,
    make_speculative_fn,
    speculative_sample,
)

STOP = 0.6  # the tiny token draft's proposals fall below this often, not always
FEATURE_STOP = 0.25  # the same for the random feature draft (flatter)


def _sample(setting, target=TARGET, draft=DRAFT, stop_below=STOP, bug=None, seed=0):
    sampling, k, max_new = SETTINGS[setting]
    fn = make_speculative_fn(
        split(target)[0], split(draft)[0], num_draft_tokens=k, max_new_tokens=max_new,
        sampling=sampling, stop_below=stop_below, _bug=bug,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    return fn(split(target)[1], split(draft)[1], prompts, lengths, seed)


def _check_counts(out, k):
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    rounds, drafted = s['row_rounds'], s['row_drafted']
    assert ((drafted >= rounds) & (drafted <= k * rounds)).all()
    assert (s['row_examined'] <= drafted).all() and (s['row_accepted'] <= s['row_examined']).all()
    np.testing.assert_array_equal(s['row_draft_calls'], drafted + 1)
    return drafted.sum() / rounds.sum()  # proposals per round


@pytest.mark.parametrize(
    'setting, feature', [('t1', False), ('t07_topk3', False), ('topp08', True)]
)
def test_stopped_chains_keep_the_target_distribution(setting, feature):
    sampling, k, _ = SETTINGS[setting]
    target, draft = (FEATURE_TARGET, FEATURE_DRAFT) if feature else (TARGET, DRAFT)
    out = _sample(setting, target, draft, stop_below=FEATURE_STOP if feature else STOP)
    per_round = _check_counts(out, k)
    assert 1.05 < per_round < k - 0.05, per_round  # rows stop, at different points
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2, target=target)
    assert not rejected, (setting, rejected, tv, per_round)


def test_dropping_the_low_confidence_proposal_is_rejected():
    sampling, k, _ = SETTINGS['t1']
    out = _sample('t1', bug='stop_drops_proposal')
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2)
    assert rejected, tv


def test_h_zero_is_the_fixed_chain_token_for_token():
    never, fixed = _sample('t07_topk3', stop_below=0.0), _sample('t07_topk3', stop_below=None)
    np.testing.assert_array_equal(np.asarray(never.tokens), np.asarray(fixed.tokens))
    for name in ('row_drafted', 'row_accepted_per_position', 'row_rounds'):
        np.testing.assert_array_equal(np.asarray(never.stats[name]), np.asarray(fixed.stats[name]))


def test_greedy_stopped_chain_is_the_targets_greedy_output():
    prompts, lengths = ragged_prompts(([3], [1, 2, 4, 0], [2, 2]), 3)
    greedy, key = SamplingConfig(0.0), jax.random.key(0)
    ref = autoregressive_sample(
        TARGET, prompts, lengths, max_new_tokens=10, sampling=greedy, rng=key
    )
    out = speculative_sample(
        TARGET, DRAFT, prompts, lengths, num_draft_tokens=4, max_new_tokens=10, sampling=greedy,
        rng=key, stop_below=0.9,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(out.stats['drafted']) < 4 * int(out.stats['rounds'])


@pytest.mark.parametrize('h', [-0.1, 1.5, 'high', True])
def test_a_bad_threshold_is_refused_before_compiling(h):
    with pytest.raises(ValueError, match='stop_below'):
        make_speculative_fn(
            split(TARGET)[0], split(DRAFT)[0], num_draft_tokens=2, max_new_tokens=4,
            sampling=SamplingConfig(1.0), stop_below=h,
        )  # fmt: skip
