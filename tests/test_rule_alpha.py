"""Each acceptance rule's own alpha is what predicts its tau (issue 20, item 7).

`acceptance_probability` (rule_distribution) must be step_kernel's kept mass and each rule's
closed form, in NumPy and in jax.numpy (stats.alpha_per_position). Then, through spec_eval's own
path (spec_eval_sampling.evaluate_sampling on a fixed calibration), the real sampler runs a
context-free target/draft pair: both tiny transformers see one embedding row for every token,
so p and q are the same at every position and every proposal is an independent
Bernoulli(alpha_rule) trial. There Leviathan's E[tau] = (1 - a^(k+1)) / (1 - a) is exact at
a = alpha_rule, so

- accepted ~ Binomial(examined, alpha_rule) (a 4-sigma bound: the Monte-Carlo check of alpha);
- measured tau agrees with E[tau](alpha_rule) within 4 bootstrap sigmas over rows, plus on the
  upper side the tokens a round cut at max_new_tokens drops (at most k per row: measured tau =
  emitted / rounds is low by that much, never high);
- the old prediction E[tau](sum min(p, q)) falls outside that interval widened by half its width
  on each side, for every rule but `probabilistic` (the negative control: the bug guarded
  against).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from sampling_models import full_logits, make_model, perturbed, tiny_config

from specjax.evaluation import spec_eval_sampling
from specjax.evaluation.prompts import Prompts
from specjax.models import split
from specjax.sampling import Acceptance, SamplingConfig, transform_logits
from specjax.sampling import stats as st
from specjax.sampling.calibrate import Calibration
from specjax.sampling.rule_distribution import acceptance_probability, step_kernel

V, K, ROWS, BATCH, MAX_NEW = 8, 3, 32, 16, 96
T1 = SamplingConfig(1.0)
RULES = {
    'probabilistic': Acceptance('probabilistic'),
    'argmax_draft': Acceptance('argmax_draft'),
    'strict': Acceptance('strict'),
    'lenient': Acceptance('lenient', lenience=0.5),
    'typical': Acceptance('typical'),  # threshold 0.09, alpha 0.3
}


def _entropy(p):
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)


CLOSED_FORM = {  # the brief's per-rule acceptance probabilities, written out independently
    'probabilistic': lambda p, q: np.minimum(p, q).sum(-1),
    'argmax_draft': lambda p, q: np.take_along_axis(p, q.argmax(-1)[..., None], -1)[..., 0],
    'strict': lambda p, q: (p * q).sum(-1),
    'lenient': lambda p, q: np.minimum(p / 0.5, q).sum(-1),
    'typical': lambda p, q: (q * (p > np.minimum(0.09, 0.3 * np.exp(-_entropy(p)))[..., None])).sum(
        -1
    ),
}


def _random_pair(seed, shape=(4, 6)):
    """p, q [*shape, V] float64 with some exact zeros (as top-k / top-p leave them)."""
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.full(V, 0.7), shape), rng.dirichlet(np.full(V, 0.7), shape)
    p = np.where(rng.random(p.shape) < 0.2, 0.0, p)
    q = np.where(rng.random(q.shape) < 0.2, 0.0, q)
    p[..., 0] += 1e-3  # no all-zero rows
    q[..., 1] += 1e-3
    return p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)


@pytest.mark.parametrize('rule', list(RULES))
def test_acceptance_probability_is_the_kept_mass_and_the_closed_form(rule):
    p, q = _random_pair(0)
    alpha = acceptance_probability(p, q, RULES[rule])
    kept, replaced = step_kernel(p, q, RULES[rule])
    np.testing.assert_allclose(kept.sum(-1) + replaced.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(alpha, kept.sum(-1), rtol=0, atol=1e-12)
    np.testing.assert_allclose(alpha, CLOSED_FORM[rule](p, q), rtol=0, atol=1e-12)
    assert 0.02 < alpha.mean() < 0.98  # an informative case
    # The jax.numpy twin (jitted), on the same distributions in float32.
    twin = jax.jit(lambda a, b: acceptance_probability(a, b, RULES[rule], xp=jnp))
    np.testing.assert_allclose(twin(p.astype(np.float32), q.astype(np.float32)), alpha, atol=2e-6)


@pytest.mark.parametrize('rule', list(RULES))
@pytest.mark.parametrize('sampling', [SamplingConfig(0.8, 5, 1.0), SamplingConfig(1.2, 0, 0.9)])
def test_alpha_per_position_is_the_rules_alpha_of_the_transformed_distributions(rule, sampling):
    keys = jax.random.split(jax.random.key(1))
    t, d = (3.0 * jax.random.normal(key, (3, 5, V)) for key in keys)
    got = st.alpha_per_position(t, d, sampling, RULES[rule])
    p = np.asarray(transform_logits(t, sampling), np.float64)
    q = np.asarray(transform_logits(d, sampling), np.float64)
    np.testing.assert_allclose(got, CLOSED_FORM[rule](p, q).clip(0, 1), atol=2e-6)
    traced = jax.jit(st.alpha_per_position, static_argnums=3)(t, d, sampling.traced(True), rule)
    np.testing.assert_allclose(traced, got, atol=1e-7)
    greedy = st.alpha_per_position(t, d, SamplingConfig(0.0), RULES[rule])  # greedy verification
    np.testing.assert_array_equal(greedy, (np.argmax(t, -1) == np.argmax(d, -1)).astype(float))


# ------------------------------------------------ the real sampler, through spec_eval's path


def _context_free(model):
    """Every token embeds to row 0: the residual stream, hence the logits, ignore the context."""
    model.embed[...] = jnp.tile(model.embed[...][:1], (V, 1))
    return model


@functools.cache
def _pair():
    """(target, draft, p [V], q [V]): p and q the float64 distributions at T = 1 everywhere."""
    config = tiny_config(vocab_size=V, max_len=128)
    base = make_model(config, seed=3, scale=15.0)
    draft = _context_free(perturbed(base, seed=4, noise=0.5))
    target = _context_free(base)
    tokens = np.random.default_rng(0).integers(0, V, (3, 12))
    pq = []
    for model in (target, draft):
        logits = np.asarray(full_logits(model, tokens), np.float64)
        assert np.abs(logits - logits[:1, :1]).max() < 1e-5  # context-free, as intended
        pq.append(np.asarray(jax.nn.softmax(logits[0, 0])))
    return target, draft, *pq


@functools.cache
def _evaluate(rule):
    """spec_eval's (autoregressive run, speculative run at k = K, optimal-k record) for `rule`."""
    target, draft, _, _ = _pair()
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 9, ROWS).astype(np.int32)
    tokens = rng.integers(0, V, (ROWS, 8)) * (np.arange(8)[None] < lengths[:, None])
    domains = np.array(['a', 'b'])[np.arange(ROWS) % 2]
    prompts = Prompts(tokens.astype(np.int32), lengths, domains, np.arange(ROWS))
    ev = ml_collections.ConfigDict(
        dict(batch_size=BATCH, max_new_tokens=MAX_NEW, timing_repeats=1, acceptance=rule)
    )
    ev.acceptance_params = ml_collections.ConfigDict(
        {f: getattr(RULES[rule], f) for f in ('lenience', 'typical_threshold', 'typical_alpha')}
    )
    ev.prompt_len_edges, ev.gen_len_edges = (4,), (MAX_NEW,)
    cal = Calibration(BATCH, 8, 128, 1.0, 0.1, {K: 1.2})
    t_gd, t_params = split(target)
    d_gd, d_params = split(draft)
    models = (target, draft, t_gd, d_gd, t_params, d_params, None)
    runs, _, optimal = spec_eval_sampling.evaluate_sampling(
        models, prompts, T1, (K,), cal, ev, seed=5, eos_id=None, mesh=None, rules=None,
        draft_rules=None,
    )  # fmt: skip
    return runs[0], runs[1], optimal, cal


@pytest.mark.parametrize('rule', list(RULES))
def test_spec_eval_alpha_is_the_rules_and_the_sampler_accepts_at_it(rule):
    _, _, p, q = _pair()
    ar, spec, optimal, cal = _evaluate(rule)
    alpha = float(acceptance_probability(p, q, RULES[rule]))
    assert spec['acceptance'] == RULES[rule].label == optimal['acceptance']
    # spec_eval's alpha (re-scored on the target's samples, float32) is the rule's.
    assert ar['alpha'] == spec['alpha'] == optimal['alpha']
    assert spec['alpha'] == pytest.approx(alpha, abs=1e-5)
    # Monte Carlo from the real sampler: accepted ~ Binomial(examined, alpha).
    examined, accepted = spec['examined'], spec['accepted']
    sd = np.sqrt(examined * alpha * (1 - alpha))
    assert abs(accepted - examined * alpha) <= 4 * sd + 1, (rule, accepted, examined * alpha, sd)
    # The optimal-k record predicts from the same alpha.
    tau = st.expected_block_efficiency(spec['alpha'], K)
    assert spec['expected_block_efficiency'] == pytest.approx(tau)
    assert optimal['predicted_speedups'][K] == pytest.approx(tau / st.round_cost(K, cal.c, cal.v))


def _tau_interval(spec, seed=0, draws=2000):
    """[lo, hi] for E[tau] from the measured rows: 4 bootstrap sigmas of emitted / rounds, and
    on top the at most K tokens per row that the round cut at max_new_tokens drops."""
    emitted = np.asarray(spec['per_row']['emitted'], np.float64)
    rounds = np.asarray(spec['per_row']['rounds'], np.float64)
    assert (emitted == MAX_NEW).all()  # no eos: every row is cut at max_new_tokens
    idx = np.random.default_rng(seed).integers(0, len(rounds), (draws, len(rounds)))
    sigma = float(np.std(emitted[idx].sum(1) / rounds[idx].sum(1)))
    tau = emitted.sum() / rounds.sum()
    assert tau == pytest.approx(spec['block_efficiency'])
    return tau - 4 * sigma, tau + 4 * sigma + K * len(rounds) / rounds.sum()


@pytest.mark.parametrize('rule', list(RULES))
def test_predicted_tau_from_the_rules_alpha_matches_measured_tau(rule):
    _, _, p, q = _pair()
    _, spec, _, _ = _evaluate(rule)
    lo, hi = _tau_interval(spec)
    predicted = spec['expected_block_efficiency']
    assert lo <= predicted <= hi, (rule, lo, predicted, hi)
    # Negative control: the old prediction, E[tau] of sum min(p, q) whatever the rule.
    old = st.expected_block_efficiency(float(np.minimum(p, q).sum()), K)
    if rule == 'probabilistic':
        assert old == pytest.approx(predicted, abs=1e-4)
    else:  # outside even the interval widened by half its width each side (here 0.5 to 1
        # tokens per round off measured tau, 0.1 to 0.4 tokens wide intervals)
        half = (hi - lo) / 2
        assert not lo - half <= old <= hi + half, (rule, lo, old, hi)
