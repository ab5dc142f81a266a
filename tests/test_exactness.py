"""Speculative sampling follows the target's distribution exactly: a hypothesis test.

For a fixed prompt the target's exact distribution of the first m = k + 2 generated tokens is
enumerated (all V^(m-1) continuations in one uncached forward, the sampling transform applied,
chain rule). The sampler's outputs (the batch = independent samples, two prompts of different
lengths interleaved) are compared with it at every position's marginal and every adjacent pair's
joint by chi-square tests (cells with small expectation pooled), Holm-corrected over all tests of
a run. Target and draft disagree strongly, so a wrong acceptance rule would show. Negative
controls, each a subtle deviation from the algorithm, must be rejected by the same test.
"""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
import pytest
from sampling_models import check_invariants, full_logits, make_model, ragged_prompts, tiny_config
from scipy import stats as sps

from specjax.models import apply, split
from specjax.sampling import (
    SamplingConfig,
    make_autoregressive_fn,
    make_speculative_fn,
    transform_logits,
)

V = 5
NUM_SAMPLES = 40_000
PROMPTS = ([1, 3], [4, 0, 2, 2])  # two lengths: the batch is ragged
FAMILY_ALPHA = 1e-3  # Holm-corrected family-wise level per run
MIN_EXPECTED = 5.0  # cells expecting fewer samples are pooled

CONFIG = tiny_config(V)
TARGET = make_model(CONFIG, seed=0, scale=8.0)
DRAFT = make_model(CONFIG, seed=1, scale=8.0, offset=40.0)  # bf16 spacing is 0.25 at 40


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _scores(graphdef, params, seqs, num_scored, sampling):
    logits = apply(graphdef, params, seqs)[:, -num_scored:]
    return transform_logits(logits, sampling)


def truth(model, prompt, sampling, m):
    """Exact joint [V]*m of the first m tokens after `prompt` under `sampling`."""
    conts = np.array(list(itertools.product(range(V), repeat=m - 1)), np.int32)
    seqs = np.concatenate([np.tile(np.array(prompt, np.int32), (len(conts), 1)), conts], 1)
    probs = np.asarray(_scores(*split(model), seqs, m, sampling), np.float64)  # [V^(m-1), m, V]
    probs = probs.reshape((V,) * (m - 1) + (m, V))
    joint = probs[(0,) * (m - 1) + (0,)]
    for i in range(1, m):
        cond = probs[(slice(None),) * i + (0,) * (m - 1 - i) + (i,)]  # [V]*i + [V]
        joint = joint[..., None] * cond
    return joint / joint.sum()


def chi_square_pvalue(observed, expected):
    """Chi-square goodness of fit, cells with expectation < MIN_EXPECTED pooled into one."""
    observed, expected = observed.ravel().astype(np.float64), expected.ravel()
    small = expected < MIN_EXPECTED
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # a token with zero target probability was emitted
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return 1.0
    return float(sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def pvalues(tokens, joint):
    """One p-value per position marginal and per adjacent pair joint of tokens [N, m]."""
    n, m = tokens.shape
    out = {}
    for i in range(m):
        marginal = joint.sum(axis=tuple(a for a in range(m) if a != i))
        counts = np.bincount(tokens[:, i], minlength=V)
        out[f'pos{i}'] = chi_square_pvalue(counts, n * marginal)
    for i in range(m - 1):
        pair = joint.sum(axis=tuple(a for a in range(m) if a not in (i, i + 1)))
        counts = np.bincount(tokens[:, i] * V + tokens[:, i + 1], minlength=V * V)
        out[f'pair{i}'] = chi_square_pvalue(counts, n * pair.ravel())
    return out


def holm_rejects(pvals: dict, alpha=FAMILY_ALPHA) -> list:
    """Names of the hypotheses Holm's step-down procedure rejects at family-wise level alpha."""
    names = sorted(pvals, key=pvals.get)
    rejected = []
    for rank, name in enumerate(names):
        if pvals[name] > alpha / (len(names) - rank):
            break
        rejected.append(name)
    return rejected


def max_tv(tokens, joint):
    """Largest total-variation distance between sampled and true position marginals."""
    m = tokens.shape[1]
    tvs = []
    for i in range(m):
        marginal = joint.sum(axis=tuple(a for a in range(m) if a != i))
        freq = np.bincount(tokens[:, i], minlength=V) / len(tokens)
        tvs.append(0.5 * np.abs(freq - marginal).sum())
    return max(tvs)


def run_test(tokens, lengths, sampling, m, target=TARGET):
    """Tests each prompt's rows against its truth; returns (rejected names, max TV)."""
    assert (np.asarray(lengths) >= m).all()
    tokens = np.asarray(tokens)[:, :m]
    pvals, tv = {}, 0.0
    for j, prompt in enumerate(PROMPTS):
        joint = truth(target, prompt, sampling, m)
        rows = tokens[j :: len(PROMPTS)]
        pvals.update({f'prompt{j}.{name}': p for name, p in pvalues(rows, joint).items()})
        tv = max(tv, max_tv(rows, joint))
    return holm_rejects(pvals), tv


# name: (sampling, k, max_new_tokens); t1's max_new is 2(k+1) so test_speculative reuses it.
SETTINGS = {
    't1': (SamplingConfig(1.0), 2, 6),
    't07_topk3': (SamplingConfig(0.7, top_k=3), 3, 5),
    'topp08': (SamplingConfig(1.0, top_p=0.8), 4, 6),
}


def sample(setting, bug=None, draft=DRAFT, seed=0):
    sampling, k, max_new = SETTINGS[setting]
    fn = make_speculative_fn(
        split(TARGET)[0], split(draft)[0], num_draft_tokens=k, max_new_tokens=max_new,
        sampling=sampling, _bug=bug,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    return fn(split(TARGET)[1], split(draft)[1], prompts, lengths, seed)


def test_models_disagree_and_depend_on_context():
    """The test only means something if p and q differ a lot and depend on the context."""
    for sampling, _, _ in SETTINGS.values():
        p = truth(TARGET, PROMPTS[0], sampling, 2)
        q = truth(DRAFT, PROMPTS[0], sampling, 2)
        assert 0.5 * np.abs(p.sum(1) - q.sum(1)).sum() > 0.3
        first = np.argsort(p.sum(1))[-2:]  # two likely first tokens
        cond = p[first] / p[first].sum(1, keepdims=True)  # p(t2 | t1)
        assert 0.5 * np.abs(cond[0] - cond[1]).sum() > 0.1


@pytest.mark.parametrize('setting', list(SETTINGS))
def test_speculative_matches_target_distribution(setting):
    sampling, k, max_new = SETTINGS[setting]
    out = sample(setting)
    check_invariants(out, k, max_new)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2)
    assert not rejected, (setting, rejected, tv)
    examined, accepted = int(out.stats['examined']), int(out.stats['accepted'])
    assert 0.1 < accepted / examined < 0.9  # both branches (accept, reject) exercised


@pytest.mark.parametrize(
    'setting, bug',
    [('t1', 'bonus_from_q'), ('t07_topk3', 'residual_untransformed'), ('t1', 'bf16_draft')],
)
def test_negative_controls_are_rejected(setting, bug):
    sampling, k, _ = SETTINGS[setting]
    out = sample(setting, bug=bug)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, k + 2)
    assert rejected, (setting, bug, tv)


def test_autoregressive_matches_target_distribution():
    sampling = SamplingConfig(1.0)
    fn = make_autoregressive_fn(split(TARGET)[0], max_new_tokens=2, sampling=sampling)
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    out = fn(split(TARGET)[1], prompts, lengths, 0)
    rejected, tv = run_test(out.tokens, out.lengths, sampling, 2)
    assert not rejected, (rejected, tv)


def test_truth_is_a_distribution_matching_sequential_scoring():
    """The enumerated joint agrees with scoring one sampled sequence position by position."""
    sampling = SETTINGS['topp08'][0]
    joint = truth(TARGET, PROMPTS[1], sampling, 3)
    assert np.isclose(joint.sum(), 1.0)
    seq = np.array([[*PROMPTS[1], 2, 0]], np.int32)
    probs = np.asarray(transform_logits(full_logits(TARGET, seq), sampling))[0]
    n = len(PROMPTS[1])
    expected = probs[n - 1, 2] * probs[n, 0]
    assert np.isclose(joint[2, 0].sum(), expected, rtol=1e-5)
