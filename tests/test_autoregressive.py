"""Autoregressive sampler: greedy = teacher-forced argmax, ragged prompts, eos, stats, checks.

(Its sampling distribution is tested against the enumerated truth in test_exactness.py.)
"""

from __future__ import annotations

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

from specjax.sampling import PAD_ID, SamplingConfig, autoregressive_sample

GREEDY = SamplingConfig(0.0)
BATCH = 12  # the same shapes as test_speculative's reference run: one compile for both


def run(**overrides):
    target, _ = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, BATCH)
    kwargs = dict(max_new_tokens=GREEDY_MAX_NEW, sampling=GREEDY, rng=0, eos_id=GREEDY_EOS)
    kwargs.update(overrides)
    return prompts, lengths, autoregressive_sample(target, prompts, lengths, **kwargs)


def test_greedy_is_teacher_forced_argmax_with_per_row_eos():
    target, _ = greedy_models()
    prompts, prompt_lengths, out = run()
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    width = prompts.shape[1]
    # Each row's prompt followed by its output, scored uncached in one causal call.
    seqs = np.zeros((BATCH, width + GREEDY_MAX_NEW), np.int32)
    for b in range(BATCH):
        n = prompt_lengths[b]
        seqs[b, :n], seqs[b, n : n + GREEDY_MAX_NEW] = prompts[b, :n], tokens[b]
    logits = np.asarray(full_logits(target, seqs))
    for b in range(BATCH):
        n = prompt_lengths[b]
        for t in range(lengths[b]):
            scores = logits[b, n - 1 + t]
            top2 = np.sort(scores)[-2:]
            assert tokens[b, t] == np.argmax(scores) or top2[1] - top2[0] < 1e-4, (b, t)
        ended_by_eos = tokens[b, lengths[b] - 1] == GREEDY_EOS
        assert ended_by_eos or lengths[b] == GREEDY_MAX_NEW
        assert GREEDY_EOS not in tokens[b, : lengths[b] - 1]
        assert (tokens[b, lengths[b] :] == PAD_ID).all()
    assert 0 < (lengths < GREEDY_MAX_NEW).sum() < BATCH  # both ways of ending occur
    s = {name: np.asarray(v) for name, v in out.stats.items()}
    np.testing.assert_array_equal(s['row_rounds'], lengths)
    np.testing.assert_array_equal(s['row_target_calls'], lengths + 1)
    assert s['target_calls'] == (lengths + 1).sum() and s['batch_rounds'] == lengths.max()


@pytest.mark.parametrize(
    'overrides, match',
    [
        (dict(max_new_tokens=0), 'max_new_tokens'),
        (dict(max_new_tokens=43), 'max_len'),
        (dict(eos_id=-1), 'eos_id=-1'),
        (dict(sampling=0.0), 'sampling'),
    ],
)
def test_bad_arguments_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        run(**overrides)


def test_bad_prompt_lengths_raise():
    target, _ = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, BATCH)
    lengths[3] = 0
    with pytest.raises(ValueError, match=r'prompt_lengths\[3\]=0'):
        autoregressive_sample(target, prompts, lengths, max_new_tokens=4, sampling=GREEDY, rng=0)
