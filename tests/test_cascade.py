"""Speculative cascades (specjax.sampling.cascade): lossy by design, exact at a = -1, the draft at
a = 1, and in between the law its enumeration (rule_distribution) says.

The rules' equations are pinned on a hand-worked example; the enumerated law of a cascade is pi's
chain rule whatever k; the sampler at a = -1 passes test_exactness's chi-square test against the
target, at interior a follows its own enumerated law (and the target test rejects it: a negative
control), and at a = 1 follows the draft's law and, greedy, gives the draft's own tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from sampling_models import (
    GREEDY_EOS,
    GREEDY_MAX_NEW,
    GREEDY_PROMPTS,
    greedy_models,
    make_model,
    ragged_prompts,
    tiny_config,
)
from test_acceptance import draft_tables, tables
from test_exactness import (
    DRAFT,
    NUM_SAMPLES,
    PROMPTS,
    SETTINGS,
    TARGET,
    holm_rejects,
    pvalues,
    run_test,
    truth,
)

from specjax.evaluation.serving import alone_inputs, alone_tokens
from specjax.models import split
from specjax.sampling import (
    Acceptance,
    NGramDraft,
    SamplingConfig,
    autoregressive_sample,
    make_speculative_fn,
    speculative_sample,
    tree_speculative_sample,
)
from specjax.sampling.cascade import CASCADE_RULES, target_law, with_lenience
from specjax.sampling.rule_distribution import (
    acceptance_probability,
    rule_joint,
    step_kernel,
    target_joint_of,
    tv_from_target,
)

TOL = 1e-6
# interior settings whose law is far from the target's (checked below)
LOSSY = {
    'cascade_chow': 0.6,
    'cascade_diff': 0.3,
    'cascade_opt': 0.5,
    'cascade_token_v1': 0.2,
    'cascade_token_v2': 0.3,
    'cascade_token_v3': 0.7,
}


def test_rules_follow_their_equations_on_a_worked_example():
    """p = (.5, .3, .2), q = (.2, .7, .1): max p .5, max q .7, TV .4 (cascade's docstring)."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.7, 0.1])
    law = lambda rule, a: target_law(rule, a, p, q, xp=np)
    cases = [
        ('cascade_chow', 0.4, q), ('cascade_chow', 0.2, p),  # .7 >= 1 - a
        ('cascade_diff', 0.0, q), ('cascade_diff', -0.3, p),  # .7 >= .5 - a
        ('cascade_opt', -0.4, q), ('cascade_opt', -0.6, p),  # .7 >= .5 - .4 a
        ('cascade_token_v1', 0.0, [0.15, 0.79, 0.06]),  # A = {q >= .5} = {1}: .3 p outside
        ('cascade_token_v2', 0.25, [0.25, 0.73, 0.02]),  # A = {p >= .25} = {0, 1}
        ('cascade_token_v3', 0.5, [0.25, 0.73, 0.02]),  # A = {p >= .25}
        ('cascade_token_v3', 0.3, [0.2 + 0.8 * 0.5, 0.8 * 0.3, 0.8 * 0.2]),  # A = {0}
    ]  # fmt: skip
    for rule, a, want in cases:
        np.testing.assert_allclose(law(rule, a), want, atol=1e-12, err_msg=f'{rule} a={a}')
    for rule in CASCADE_RULES:  # the ends, whatever floating-point ties the rule meets
        np.testing.assert_array_equal(law(rule, -1.0), p)
        np.testing.assert_array_equal(law(rule, 1.0), q)


def test_kernel_of_a_cascade_emits_pi_and_keeps_min_pi_q():
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.full(5, 0.7), (4, 6)), rng.dirichlet(np.full(5, 0.7), (4, 6))
    for rule, a in LOSSY.items():
        acc = Acceptance(rule, cascade_lenience=a)
        pi = target_law(rule, a, p, q, xp=np)
        np.testing.assert_allclose(pi.sum(-1), 1.0, atol=1e-12)
        kept, replaced = step_kernel(p, q, acc)
        np.testing.assert_allclose(kept + replaced, pi, atol=1e-9)
        np.testing.assert_allclose(acceptance_probability(p, q, acc), np.minimum(pi, q).sum(-1))


@pytest.mark.parametrize('rule', list(LOSSY))
def test_enumerated_law_is_pis_chain_rule_from_the_target_to_the_draft(rule):
    sampling = SETTINGS['t1'][0]
    p, q = tables(TARGET, PROMPTS[0], sampling, 4), draft_tables(PROMPTS[0], sampling, 4)
    at = lambda a: Acceptance(rule, cascade_lenience=a)
    assert tv_from_target(p, q, 2, at(-1.0)) < TOL  # exact speculation
    np.testing.assert_allclose(rule_joint(p, q, 2, at(1.0)), target_joint_of(q), atol=1e-12)
    joint = rule_joint(p, q, 1, at(LOSSY[rule]))
    np.testing.assert_allclose(joint, rule_joint(p, q, 3, at(LOSSY[rule])), atol=1e-12)
    np.testing.assert_allclose(joint, target_joint_of(target_law(rule, LOSSY[rule], p, q, xp=np)))
    assert tv_from_target(p, q, 2, at(LOSSY[rule])) > 0.05  # lossy by design


def _sample(acc, setting='t1', draft=DRAFT, seed=1):
    sampling, k, max_new = SETTINGS[setting]
    fn = make_speculative_fn(
        split(TARGET)[0], split(draft)[0], num_draft_tokens=k, max_new_tokens=max_new,
        sampling=sampling, acceptance=acc,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    return fn(split(TARGET)[1], split(draft)[1], prompts, lengths, seed)


@pytest.mark.parametrize(
    'rule, setting', [('cascade_token_v3', 't1'), ('cascade_opt', 't07_topk3')]
)
def test_cascade_at_its_exact_setting_follows_the_target(rule, setting):
    sampling, k, _ = SETTINGS[setting]
    out = _sample(Acceptance(rule, cascade_lenience=-1.0), setting)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2)
    assert not rejected, (rule, setting, rejected, tv)
    assert 0.1 < int(out.stats['accepted']) / int(out.stats['examined']) < 0.9
    rounds = np.asarray(out.stats['row_rounds'])  # k + 1 proposals a round, k + 1 draft calls
    np.testing.assert_array_equal(out.stats['row_drafted'], (k + 1) * rounds)


@pytest.mark.parametrize('rule', ['cascade_chow', 'cascade_opt', 'cascade_token_v3'])
def test_lossy_cascade_samples_follow_their_enumeration(rule):
    """The sampler implements the enumerated rule; the target's test rejects it."""
    sampling, k, _ = SETTINGS['t1']
    acc = Acceptance(rule, cascade_lenience=LOSSY[rule])
    out = _sample(acc)
    tokens = np.asarray(out.tokens)[:, : k + 2]
    pvals = {}
    for j, prompt in enumerate(PROMPTS):
        p, q = tables(TARGET, prompt, sampling, k + 2), draft_tables(prompt, sampling, k + 2)
        own = pvalues(tokens[j :: len(PROMPTS)], rule_joint(p, q, k, acc))
        pvals.update({f'prompt{j}.{n}': v for n, v in own.items()})
    assert not holm_rejects(pvals), (rule, holm_rejects(pvals))
    assert run_test(out.tokens, out.lengths, sampling, k + 2)[0]  # off the target's law


def test_cascade_at_the_draft_end_follows_the_draft():
    sampling, k, _ = SETTINGS['t1']
    out = _sample(Acceptance('cascade_diff', cascade_lenience=1.0))
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2, target=DRAFT)
    assert not rejected, (rejected, tv)
    assert int(out.stats['accepted']) == int(out.stats['examined'])  # every proposal kept


def _greedy(draft, acc, ids=None):
    target, _ = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, len(GREEDY_PROMPTS))
    kw = dict(max_new_tokens=GREEDY_MAX_NEW, sampling=SamplingConfig(0.0), rng=0, eos_id=GREEDY_EOS)
    return speculative_sample(
        target, draft, prompts, lengths, num_draft_tokens=2, acceptance=acc, draft_vocab_ids=ids,
        **kw,
    )  # fmt: skip


def test_greedy_cascade_ends_are_the_target_and_the_student_token_for_token():
    target, draft = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, len(GREEDY_PROMPTS))
    kw = dict(max_new_tokens=GREEDY_MAX_NEW, sampling=SamplingConfig(0.0), rng=0, eos_id=GREEDY_EOS)
    exact = _greedy(draft, 'probabilistic')
    student = autoregressive_sample(draft, prompts, lengths, **kw)
    assert (np.asarray(student.tokens) != np.asarray(exact.tokens)).any()  # informative
    for rule in ('cascade_chow', 'cascade_token_v3'):
        at_exact = _greedy(draft, Acceptance(rule, cascade_lenience=-1.0))
        np.testing.assert_array_equal(at_exact.tokens, exact.tokens)
        np.testing.assert_array_equal(at_exact.lengths, exact.lengths)
        at_draft = _greedy(draft, Acceptance(rule, cascade_lenience=1.0))
        np.testing.assert_array_equal(at_draft.tokens, student.tokens)
        np.testing.assert_array_equal(at_draft.lengths, student.lengths)
        middle = np.asarray(_greedy(draft, Acceptance(rule, cascade_lenience=0.5)).tokens)
        assert middle.shape == student.tokens.shape


def test_greedy_cascade_with_a_reduced_vocabulary_student_is_the_student_at_a_1():
    """A student over 3 of the 17 ids (its own vocab_size 3: inputs remapped), as the quickstart's
    distilled draft: at a = 1 the cascade emits the student's own greedy tokens."""
    ids = [1, 3, 4]
    small = make_model(tiny_config(3, max_len=48), seed=5, scale=8.0)
    target, _ = greedy_models()
    prompts, lengths = ragged_prompts(GREEDY_PROMPTS, len(GREEDY_PROMPTS))
    alone = autoregressive_sample(
        small, alone_inputs(ids, target.config.vocab_size, prompts), lengths,
        max_new_tokens=GREEDY_MAX_NEW, sampling=SamplingConfig(0.0), rng=0,
    )  # fmt: skip
    out = _greedy(small, Acceptance('cascade_token_v1', cascade_lenience=1.0), ids=ids)
    want = alone_tokens(ids, np.asarray(alone.tokens))
    got = np.asarray(out.tokens)
    for row, n in enumerate(np.asarray(out.lengths)):  # eos (5) is not in the student's set
        np.testing.assert_array_equal(got[row, :n], want[row, :n])


def test_with_lenience_reuses_the_compiled_program():
    sampling, k, max_new = SETTINGS['t1']
    make = lambda a: make_speculative_fn(
        split(TARGET)[0], split(DRAFT)[0], num_draft_tokens=k, max_new_tokens=max_new,
        sampling=sampling, acceptance=Acceptance('cascade_token_v2', cascade_lenience=a),
    )  # fmt: skip
    fn = make(-1.0)
    moved = with_lenience(fn, 0.3)
    prompts, lengths = ragged_prompts(PROMPTS, 64)
    args = (split(TARGET)[1], split(DRAFT)[1], prompts, lengths, 3)
    np.testing.assert_array_equal(moved(*args).tokens, make(0.3)(*args).tokens)
    assert moved._program is fn._program and make(0.3)._program is fn._program  # one jit
    exact = make_speculative_fn(
        split(TARGET)[0], split(DRAFT)[0], num_draft_tokens=k, max_new_tokens=max_new,
        sampling=sampling,
    )  # fmt: skip
    with pytest.raises(ValueError, match='needs a sampler of a cascade'):
        with_lenience(exact, 0.5)


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(acceptance={'rule': 'cascade_chow', 'cascade_lenience': 1.5}), 'cascade_lenience'),
        (dict(acceptance='cascade_opt', stop_below=0.5), 'needs a token draft and stop_below'),
        (dict(acceptance='cascade_opt', draft=NGramDraft(2, 1)), 'needs a token draft'),
    ],
)  # fmt: skip
def test_bad_cascade_arguments_raise_before_compiling(kwargs, match):
    prompts, lengths = ragged_prompts(PROMPTS, 2)
    draft = kwargs.pop('draft', DRAFT)
    with pytest.raises(ValueError, match=match):
        speculative_sample(
            TARGET, draft, prompts, lengths, num_draft_tokens=2, max_new_tokens=3,
            sampling=SamplingConfig(1.0), rng=0, **kwargs,
        )  # fmt: skip
    with pytest.raises(ValueError, match='lossy rules verify chains only'):
        tree_speculative_sample(
            TARGET, DRAFT, prompts, lengths, tree=((0,), (0, 0)), max_new_tokens=3,
            sampling=SamplingConfig(1.0), rng=0, acceptance='cascade_token_v3',
        )  # fmt: skip


def test_truth_of_the_draft_differs_from_the_target():
    """The draft-end test means something: the two laws differ."""
    sampling = SETTINGS['t1'][0]
    p, q = truth(TARGET, PROMPTS[0], sampling, 2), truth(DRAFT, PROMPTS[0], sampling, 2)
    assert 0.5 * np.abs(p - q).sum() > 0.3
