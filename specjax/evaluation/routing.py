"""Request-level routing between a student served alone and the target with speculation.

The router answers a request with the student first, then decides from the student's own
uncertainty u (nats; larger = less sure) whether to keep that answer or to hand the request to
the target tier (the target with its best exact draft): the student keeps a request iff
u <= threshold. Threshold -inf sends every request to the target tier (the same prompts and key
as that path alone: the same tokens) and +inf keeps every request on the student. A routing
mistake changes the answering model, where speculation keeps the target's law: the quality of a
routed answer is measured against the target (specjax.evaluation.route_curves).

Uncertainty signals (`SIGNALS`), from the student's T = 1 log-probabilities of its own answer's
tokens (`token_scores`):
  mean_nll, max_nll     minus the mean / the minimum over the whole answer (answer first, then
                        decide: a deferred request also paid for the student's answer)
  mean_nll_first_m, max_nll_first_m
                        the same over the answer's first m tokens (the student answers m
                        tokens, the router decides, then the student goes on or the target
                        answers)
  probe                 minus the log-odds of a logistic probe on the prompt's features under
                        the student (`FEATURES`), fitted on validation prompts; it costs the
                        student's prefill and no answer
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.evaluation.serving import alone_inputs, alone_tokens
from specjax.models import apply

SIGNALS = ('mean_nll', 'max_nll', 'mean_nll_first_m', 'max_nll_first_m', 'probe')
# what the router runs before it decides: the whole answer, its first m tokens, the prompt
SIGNAL_COST = {
    'mean_nll': 'answer',
    'max_nll': 'answer',
    'mean_nll_first_m': 'first_m',
    'max_nll_first_m': 'first_m',
    'probe': 'prompt',
}
FEATURES = ('prompt_mean_logp', 'last_entropy', 'log_prompt_len')


def check_threshold(threshold) -> float:
    """A threshold as a float (+-inf allowed); ValueError naming it for NaN or a non-number."""
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        t = math.nan
    if isinstance(threshold, bool) or math.isnan(t):
        raise ValueError(f'router threshold must be a number (+-inf allowed), got {threshold!r}')
    return t


@dataclasses.dataclass
class Routed:
    """A routed batch: tokens int32 [B, N] (target ids), lengths [B], kept bool [B] (the
    student's answer was kept), uncertainty float [B] (the student's u)."""

    tokens: np.ndarray
    lengths: np.ndarray
    kept: np.ndarray
    uncertainty: np.ndarray


class Router:
    """Answer with `student`, keep rows whose uncertainty <= `threshold`, the rest from `target`.

    student, target: fn(prompts int32 [B, P], lengths [B], rng) -> an output with tokens
    [B, N] and lengths [B] in target ids (`student_path` wraps a reduced-vocabulary student);
    uncertainty(prompts, lengths, student_output) -> float [B]. A deferred row's answer is the
    target path's for the same prompts and key; the target runs only when a row is deferred.
    """

    def __init__(self, student, target, uncertainty, threshold):
        self.student, self.target, self.uncertainty = student, target, uncertainty
        self.threshold = check_threshold(threshold)

    def __call__(self, prompts, lengths, rng) -> Routed:
        out = self.student(prompts, lengths, rng)
        u = np.asarray(self.uncertainty(prompts, lengths, out), np.float64)
        kept = u <= self.threshold
        tokens, lens = np.asarray(out.tokens), np.asarray(out.lengths)
        if not kept.all():
            deferred = self.target(prompts, lengths, rng)
            tokens = np.where(kept[:, None], tokens, np.asarray(deferred.tokens))
            lens = np.where(kept, lens, np.asarray(deferred.lengths))
        return Routed(tokens, lens, kept, u)


@dataclasses.dataclass
class Answer:
    """tokens int32 [B, N] in target ids and lengths [B]."""

    tokens: np.ndarray
    lengths: np.ndarray


def student_path(sampler, params, ids, target_vocab: int):
    """fn(prompts, lengths, rng) -> Answer: a student's sampler (AOT-compiled or not) on the
    student's inputs, its output in target ids. ids: a reduced-vocabulary student's target ids
    (draft_vocab.json) or None."""

    def run(prompts, lengths, rng):
        out = sampler(*params, alone_inputs(ids, target_vocab, prompts), lengths, rng)
        return Answer(alone_tokens(ids, jax.device_get(out.tokens)), np.asarray(out.lengths))

    return run


def token_scores(graphdef, params, prompts, prompt_lengths, tokens, lengths, ids=None) -> dict:
    """Teacher-forced scores of answers under one model, at T = 1 (softmax of its logits).

    prompts int32 [B, P] right-padded, prompt_lengths [B]; tokens int32 [B, N] the answers in
    target ids, lengths [B]; ids: a reduced-vocabulary model's target ids (its answers' tokens
    are in the set; others would score as its index 0). Returns numpy arrays: logp [B, N] (each
    answer token's log-probability given the prompt and the answer before it; 0 past a row's
    length), agree [B, N] (the token is the model's argmax there), mask [B, N], and the prompt's
    features: prompt_mean_logp [B] (mean log-probability of its tokens after the first),
    last_entropy [B] (entropy of the next-token law after the prompt, nats).
    """
    prompts, tokens = np.asarray(prompts, np.int32), np.asarray(tokens, np.int32)
    p_len, g_len = np.asarray(prompt_lengths, np.int32), np.asarray(lengths, np.int32)
    batch, n = tokens.shape
    seq = np.zeros((batch, prompts.shape[1] + n), np.int32)
    for b in range(batch):
        seq[b, : p_len[b]] = prompts[b, : p_len[b]]
        seq[b, p_len[b] : p_len[b] + g_len[b]] = tokens[b, : g_len[b]]
    to_model = functools.partial(_model_ids, ids)
    out = jax.device_get(_scores(graphdef, n, params, to_model(seq), p_len, to_model(tokens)))
    mask = np.arange(n)[None, :] < g_len[:, None]
    return dict(
        logp=np.where(mask, out['logp'], 0.0),
        agree=out['agree'] & mask,
        mask=mask,
        prompt_mean_logp=np.asarray(out['prompt_mean_logp']),
        last_entropy=np.asarray(out['last_entropy']),
    )


def _model_ids(ids, tokens) -> np.ndarray:
    """Target ids -> a reduced-vocabulary model's indices (0 off its set); ids None: as is."""
    if ids is None:
        return tokens
    table = np.zeros((max(max(ids), int(tokens.max())) + 1,), np.int32)
    table[np.asarray(ids)] = np.arange(len(ids), dtype=np.int32)
    return table[tokens]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _scores(graphdef, n, params, seq_BL, p_len_B, targets_BN):
    logits = apply(graphdef, params, seq_BL).astype(jnp.float32)  # [B, L, V]
    lse_BL = jax.nn.logsumexp(logits, axis=-1)
    idx_BN = p_len_B[:, None] - 1 + jnp.arange(n)[None, :]  # the positions predicting answers
    at_BNV = jnp.take_along_axis(logits, idx_BN[..., None], axis=1)
    picked = jnp.take_along_axis(at_BNV, targets_BN[..., None], axis=-1)[..., 0]
    logp = picked - jnp.take_along_axis(lse_BL, idx_BN, axis=1)
    agree = jnp.argmax(at_BNV, axis=-1) == targets_BN
    nxt = jnp.take_along_axis(logits[:, :-1], seq_BL[:, 1:, None], axis=-1)[..., 0]
    in_prompt = jnp.arange(seq_BL.shape[1] - 1)[None, :] < (p_len_B - 1)[:, None]
    prompt_logp = jnp.where(in_prompt, nxt - lse_BL[:, :-1], 0.0).sum(-1)
    last = jax.nn.log_softmax(logits[jnp.arange(len(p_len_B)), p_len_B - 1], axis=-1)
    return dict(
        logp=logp,
        agree=agree,
        prompt_mean_logp=prompt_logp / jnp.maximum(in_prompt.sum(-1), 1),
        last_entropy=-(jnp.exp(last) * last).sum(-1),
    )


def answer_uncertainty(logp_BN, mask_BN, signal: str, m: int = 0) -> np.ndarray:
    """u [B] of an answer signal (SIGNALS but `probe`): minus the mean or the minimum of its
    tokens' log-probabilities, over its first m tokens for the _first_m signals; 0 for a row
    without tokens."""
    if signal not in SIGNALS or signal == 'probe':
        raise ValueError(
            f'answer_uncertainty: signal must be one of {SIGNALS[:-1]}, got {signal!r}'
        )
    logp, mask = np.asarray(logp_BN, np.float64), np.asarray(mask_BN, bool)
    if signal.endswith('_first_m'):
        if int(m) < 1:
            raise ValueError(f'answer_uncertainty: {signal} needs m >= 1, got m={m!r}')
        mask = mask & (np.arange(mask.shape[1])[None, :] < int(m))
    count = mask.sum(-1)
    if signal.startswith('mean_nll'):
        return -np.where(mask, logp, 0.0).sum(-1) / np.maximum(count, 1)
    return np.where(count > 0, -np.where(mask, logp, np.inf).min(-1), 0.0)


def prompt_features(scores: dict, prompt_lengths) -> np.ndarray:
    """float [B, len(FEATURES)]: the probe's inputs from token_scores of the student."""
    return np.stack(
        [
            scores['prompt_mean_logp'],
            scores['last_entropy'],
            np.log(np.asarray(prompt_lengths, np.float64)),
        ],
        axis=-1,
    ).astype(np.float64)


def fit_probe(features, labels, l2: float = 1.0, steps: int = 50) -> dict:
    """A logistic probe P(the student's answer is good | prompt features), L2-penalised, by
    Newton steps on standardised features [n, F] and bool labels [n]. With one class only it
    predicts that class's smoothed rate everywhere (weights 0)."""
    x, y = np.asarray(features, np.float64), np.asarray(labels, np.float64)
    mean, scale = x.mean(0), x.std(0)
    scale = np.where(scale > 0, scale, 1.0)
    z = np.concatenate([(x - mean) / scale, np.ones((len(x), 1))], axis=1)
    w = np.zeros(z.shape[1])
    w[-1] = math.log((y.sum() + 0.5) / (len(y) - y.sum() + 0.5))
    if 0 < y.sum() < len(y):
        penalty = l2 * np.diag([1.0] * (z.shape[1] - 1) + [0.0])
        for _ in range(steps):
            prob = 1.0 / (1.0 + np.exp(-(z @ w)))
            grad = z.T @ (prob - y) + penalty @ w
            hess = z.T @ (z * (prob * (1 - prob))[:, None]) + penalty + 1e-9 * np.eye(len(w))
            w = w - np.linalg.solve(hess, grad)
    return {'mean': mean.tolist(), 'scale': scale.tolist(), 'weights': w.tolist()}


def probe_uncertainty(probe: dict, features) -> np.ndarray:
    """u [B] = minus the probe's log-odds that the student's answer is good."""
    x = np.asarray(features, np.float64)
    z = (x - np.asarray(probe['mean'])) / np.asarray(probe['scale'])
    w = np.asarray(probe['weights'])
    return -(z @ w[:-1] + w[-1])
