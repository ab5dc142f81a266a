"""Acceptance rules: exact ones follow the target, lossy ones follow their own enumerated law.

`rule_joint` enumerates a rule's exact joint of the first m tokens from per-context p and q; for
exact rules it must equal the target's joint (checked to rounding, no sampling), for lossy ones
it is what the sampler must reproduce (chi-square, as in test_exactness) and what their TV
distance from the target is computed from. The lenient rule doubles as a negative control: the
exactness test against the target must reject it.
"""

from __future__ import annotations

import numpy as np
import pytest
from sampling_models import check_invariants, make_model, ragged_prompts, tiny_config
from test_exactness import (
    DRAFT,
    NUM_SAMPLES,
    PROMPTS,
    SETTINGS,
    TARGET,
    V,
    _scores,
    holm_rejects,
    pvalues,
    run_test,
    truth,
)

from specjax.models import split
from specjax.sampling import Acceptance, SamplingConfig, make_speculative_fn, speculative_sample
from specjax.sampling.rule_distribution import rule_joint, target_joint_of, tv_from_target

TOL = 1e-6  # exact rules' TV from the target: float64 rounding, the 1e-7 residual fallback
LOSSY = {'lenient': Acceptance('lenient', lenience=0.3), 'typical': Acceptance('typical')}


def tables(model, prompt, sampling, m):
    """[V]*(m-1) + [m, V] per-context distributions after `prompt` (as `truth` builds them)."""
    import itertools

    conts = np.array(list(itertools.product(range(V), repeat=m - 1)), np.int32)
    seqs = np.concatenate([np.tile(np.array(prompt, np.int32), (len(conts), 1)), conts], 1)
    probs = np.asarray(_scores(*split(model), seqs, m, sampling), np.float64)
    probs = probs / probs.sum(-1, keepdims=True)  # float32 rounding off the exact laws
    return probs.reshape((V,) * (m - 1) + (m, V))


def draft_tables(prompt, sampling, m, ids=None):
    q = tables(DRAFT, prompt, sampling, m)
    if ids is None:
        return q
    # The sampler restricts the draft's logits to ids before the transform: redo that here.
    p = tables(DRAFT, prompt, SamplingConfig(1.0), m)
    logits = np.log(np.where(p > 0, p, 1e-300))[..., ids]
    from specjax.sampling import transform_logits

    sub = np.asarray(transform_logits(logits, sampling), np.float64)
    full = np.zeros_like(q)
    full[..., ids] = sub
    return full


@pytest.mark.parametrize('rule', ['probabilistic', 'argmax_draft', 'strict'])
@pytest.mark.parametrize('setting', list(SETTINGS))
def test_exact_rules_enumerate_to_the_target(rule, setting):
    sampling, k, _ = SETTINGS[setting]
    for prompt in PROMPTS:
        p, q = tables(TARGET, prompt, sampling, k + 2), draft_tables(prompt, sampling, k + 2)
        ref = truth(TARGET, prompt, sampling, k + 2)
        np.testing.assert_allclose(target_joint_of(p), ref, rtol=1e-5, atol=1e-9)
        assert tv_from_target(p, q, k, rule) < TOL


@pytest.mark.parametrize('rule', list(LOSSY))
def test_lossy_rules_are_measurably_off_target(rule):
    sampling, k, _ = SETTINGS['t1']
    p, q = tables(TARGET, PROMPTS[0], sampling, k + 2), draft_tables(PROMPTS[0], sampling, k + 2)
    joint = rule_joint(p, q, k, LOSSY[rule])
    assert np.isclose(joint.sum(), 1.0)
    assert tv_from_target(p, q, k, LOSSY[rule]) > 0.05
    assert tv_from_target(p, q, k, Acceptance('lenient', lenience=1.0)) < TOL  # eps 1 = exact


def _sample(acceptance, setting='t1', ids=None, draft=DRAFT):
    sampling, k, max_new = SETTINGS[setting]
    fn = make_speculative_fn(
        split(TARGET)[0], split(draft)[0], num_draft_tokens=k, max_new_tokens=max_new,
        sampling=sampling, acceptance=acceptance, draft_vocab_ids=ids,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    out = fn(split(TARGET)[1], split(draft)[1], prompts, lengths, 1)
    check_invariants(out, k, max_new)
    return out


@pytest.mark.parametrize('rule, setting', [('argmax_draft', 't07_topk3'), ('strict', 't1')])
def test_exact_rule_samples_follow_the_target(rule, setting):
    sampling, k, _ = SETTINGS[setting]
    out = _sample(rule, setting)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2)
    assert not rejected, (rule, rejected, tv)
    assert 0.05 < int(out.stats['accepted']) / int(out.stats['examined']) < 0.95


@pytest.mark.parametrize('rule', list(LOSSY))
def test_lossy_rule_samples_follow_their_enumeration(rule):
    """The sampler implements the enumerated rule; for `lenient` the target test rejects it."""
    sampling, k, _ = SETTINGS['t1']
    out = _sample(LOSSY[rule])
    tokens = np.asarray(out.tokens)[:, : k + 2]
    pvals = {}
    for j, prompt in enumerate(PROMPTS):
        p = tables(TARGET, prompt, sampling, k + 2)
        q = draft_tables(prompt, sampling, k + 2)
        own = pvalues(tokens[j :: len(PROMPTS)], rule_joint(p, q, k, LOSSY[rule]))
        pvals.update({f'prompt{j}.{n}': v for n, v in own.items()})
    assert not holm_rejects(pvals), (rule, holm_rejects(pvals))
    if rule == 'lenient':  # negative control for the exactness test
        rejected, _ = run_test(out.tokens, out.lengths, sampling, k + 2)
        assert rejected


def test_reduced_draft_vocabulary_stays_exact():
    """A draft over 3 of the 5 tokens (logits restricted): the output still follows p, and the
    draft never proposes a token outside its set (q = 0 there, checked via the enumeration)."""
    sampling, k, _ = SETTINGS['t07_topk3']
    ids = np.array([4, 0, 2], np.int32)
    out = _sample('probabilistic', 't07_topk3', ids=ids)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2)
    assert not rejected, (rejected, tv)
    q = draft_tables(PROMPTS[0], sampling, k + 2, ids)
    assert (q[..., [1, 3]] == 0).all() and np.allclose(q.sum(-1), 1)
    p = tables(TARGET, PROMPTS[0], sampling, k + 2)
    assert tv_from_target(p, q, k, 'probabilistic') < TOL


def test_reduced_vocabulary_draft_model_remaps_inputs():
    """A draft model with vocab_size N: its inputs are remapped; greedy output = the target's."""
    sampling = SamplingConfig(0.0)
    small = make_model(tiny_config(3), seed=5, scale=8.0)
    prompts, lengths = ragged_prompts(PROMPTS, 4)
    kw = dict(num_draft_tokens=2, max_new_tokens=5, sampling=sampling, rng=0)
    out = speculative_sample(TARGET, small, prompts, lengths, draft_vocab_ids=[1, 3, 4], **kw)
    for j, prompt in enumerate(PROMPTS):
        greedy = np.unravel_index(np.argmax(truth(TARGET, prompt, sampling, 5)), (V,) * 5)
        np.testing.assert_array_equal(np.asarray(out.tokens)[j :: len(PROMPTS)][0], greedy)


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(acceptance='nope'), 'acceptance rule must be one of'),
        (dict(acceptance=Acceptance), 'acceptance must be'),
        (dict(acceptance={'rule': 'lenient', 'lenience': 0.0}), r'lenience must be in \(0.0, 1'),
        (dict(acceptance={'rule': 'typical', 'typical_alpha': -1}), 'typical_alpha'),
        (dict(acceptance={'rule': 'lenient', 'eps': 0.5}), r"Unknown Acceptance field.*'eps'"),
        (dict(draft_vocab_ids=[0, 0, 1]), 'duplicate'),
        (dict(draft_vocab_ids=[0, 7]), r'\[0, target vocab_size=5\)'),
        (dict(draft_vocab_ids=[[0, 1]]), 'non-empty int'),
        (dict(draft_vocab_ids=[0, 1]), 'len\\(draft_vocab_ids\\)=2'),
    ],
)  # fmt: skip
def test_bad_acceptance_arguments_raise_before_compiling(kwargs, match):
    prompts, lengths = ragged_prompts(PROMPTS, 2)
    small = make_model(tiny_config(3), seed=5)
    draft = small if 'draft_vocab_ids' in kwargs and kwargs['draft_vocab_ids'] == [0, 1] else DRAFT
    with pytest.raises(ValueError, match=match):
        speculative_sample(
            TARGET, draft, prompts, lengths, num_draft_tokens=2, max_new_tokens=3,
            sampling=SamplingConfig(1.0), rng=0, **kwargs,
        )  # fmt: skip
