"""Speculative verification on probabilities: acceptance, residual and bonus (pure functions).

Leviathan et al. 2023, Alg. 1: proposal x_i ~ q_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the round emits a sample of
norm(max(0, p_i - q_i)); if all k are accepted it emits a bonus sample of p_{k+1}. The output then
follows p exactly, whatever q is.
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.sampling.transforms import inverse_cdf

RESIDUAL_EPS = 1e-7  # below this residual mass, p_i ~= q_i and the residual is noise: sample p_i


def leading_true(mask_BK):
    """int32 [B]: how many leading entries of each row are True."""
    return jnp.sum(jnp.cumprod(mask_BK.astype(jnp.int32), axis=-1), axis=-1)


def accept_mask(p_x, q_x, uniform):
    """True with probability min(1, p_x / q_x) for uniform ~ U[0, 1); q_x > 0 (x drawn from q)."""
    return uniform * q_x < p_x


def residual(p_V, q_V, eps=RESIDUAL_EPS):
    """norm(max(0, p - q)) over the last axis; p itself where that mass is below eps."""
    r = jnp.maximum(p_V - q_V, 0.0)
    mass = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(mass >= eps, r / jnp.where(mass >= eps, mass, 1.0), p_V)


def take_position(a_BKV, i_B):
    """a_BKV[b, i_B[b]] -> [B, V]."""
    return jnp.take_along_axis(a_BKV, i_B[:, None, None], axis=1)[:, 0]


def verify(uniform_BK, uniform_B, p_BKV, q_BKV, x_BK, *, residual_p_BKV=None, bonus_BV=None):
    """Stochastic verification of k proposals per row -> (num_accepted [B], next_token [B]).

    p_BKV: target probs at positions 1..k+1 [B, k+1, V]; q_BKV: draft probs [B, k, V] that
    x_BK [B, k] was drawn from. uniform_BK (acceptance) and uniform_B (residual/bonus draw) are
    independent U[0, 1) noise. residual_p_BKV / bonus_BV replace p in the residual / bonus (only
    the negative-control tests pass them).
    """
    k = x_BK.shape[1]
    p_x = jnp.take_along_axis(p_BKV[:, :k], x_BK[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q_BKV, x_BK[..., None], axis=-1)[..., 0]
    num_accepted = leading_true(accept_mask(p_x, q_x, uniform_BK))
    at = jnp.minimum(num_accepted, k - 1)
    res_p = p_BKV if residual_p_BKV is None else residual_p_BKV
    res = residual(take_position(res_p, at), take_position(q_BKV, at))
    bonus = p_BKV[:, k] if bonus_BV is None else bonus_BV
    dist = jnp.where((num_accepted < k)[:, None], res, bonus)
    return num_accepted, inverse_cdf(dist, uniform_B)


def verify_greedy(p_BKV, x_BK):
    """Greedy verification: accept while x_i == argmax p_i, then emit argmax p at the stop."""
    k = x_BK.shape[1]
    best = jnp.argmax(p_BKV, axis=-1).astype(jnp.int32)
    num_accepted = leading_true(x_BK == best[:, :k])
    return num_accepted, jnp.take_along_axis(best, num_accepted[:, None], axis=1)[:, 0]


def stop_at(num_accepted_B, next_B, m_B, bonus_B):
    """A round whose row proposed only m [B] <= k: (min(n, m), next), where next is `bonus_B`
    (a draw of p_{m+1}, or its argmax) for rows that kept all m. Positions past m were scored
    but not proposed; their outcome is ignored."""
    kept_all = num_accepted_B >= m_B
    return jnp.where(kept_all, m_B, num_accepted_B), jnp.where(kept_all, bonus_B, next_B)
