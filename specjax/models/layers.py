"""Building blocks of the decoder: parameters with logical axes, RMSNorm, RoPE, attention, SwiGLU.

Parameters carry logical axis names (metadata key `out_sharding`) and are created with eager
sharding off, so a model builds and runs outside any mesh; meshes map the names via rules held in
configs (specjax.parallel). No mesh axis name appears here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import kv_cache as kvc

_INIT_STD = 0.02


def param(rngs: nnx.Rngs, shape, axes, dtype, std=_INIT_STD, ones=False) -> nnx.Param:
    """A parameter of `shape` annotated with logical `axes` (one name per dimension)."""
    assert len(shape) == len(axes), (shape, axes)
    if ones:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ('norm',), param_dtype, ones=True)
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def inv_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """RoPE's inverse frequencies float32 [head_dim / 2], with Llama 3's scaling when given.

    Computed once per model in float64 (then rounded), as Hugging Face's `default` and `llama3`
    rope types define them; `scaling` is a `RopeScaling` or None.
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        wavelen = 2 * np.pi / inv
        low_wavelen = scaling.original_max_len / scaling.low_freq_factor
        high_wavelen = scaling.original_max_len / scaling.high_freq_factor
        smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * inv / scaling.factor + smooth * inv
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(wavelen > low_wavelen, inv / scaling.factor, np.where(medium, smoothed, inv))
    return inv.astype(np.float32)


def rope(x_BTHD, positions_BT, inv_freq):
    """Rotary embedding in Hugging Face Llama's rotate-half layout: x*cos + rotate_half(x)*sin.

    inv_freq: [D / 2] inverse frequencies (see `inv_frequencies`).
    """
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * jnp.cos(emb) + rotated * jnp.sin(emb)).astype(x_BTHD.dtype)


def _scores(q_BKMD, k_BKSD, mask_BMS):
    """Scaled scores float32 [B, K, M, S] of M query rows, masked-out keys at the most negative
    float (mask [B, M, S], shared by the K heads)."""
    scores = jnp.einsum('bkmd,bksd->bkms', q_BKMD, k_BKSD, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q_BKMD.shape[-1]))
    return jnp.where(mask_BMS[:, None], scores, jnp.finfo(jnp.float32).min)


def attend(q_BTHD, k_BKSD, v_BKDS, mask_BTS, new_kv=None):
    """Grouped-query attention of T queries over S keys; softmax in float32.

    H query heads share K = n_kv_heads key/value heads in groups of G = H // K; keys come as
    [B, K, S, D] and values as [B, K, D, S] (the KV cache's layout), and each group's G x T
    queries are one block of rows, so both contractions are plain batched products over (B, K)
    with the contracted axis minor-most on both operands (XLA:CPU then transposes nothing).
    `new_kv` = (keys [B, K, U, D], values [B, K, D, U], mask [B, T, U]) adds U more keys under
    the same softmax: a cached call attends over the cache as it was plus its own new entries,
    so the cache is read before it is written (in a decode loop XLA then updates it in place).
    Masked-out keys get a large negative score (a fully masked row yields a harmless uniform
    average, never NaN).
    """
    b, t, h, d = q_BTHD.shape
    kv = k_BKSD.shape[1]
    g = h // kv
    q = jnp.transpose(q_BTHD.reshape(b, t, kv, g, d), (0, 2, 3, 1, 4)).reshape(b, kv, g * t, d)
    rows = lambda mask_BTS: jnp.broadcast_to(mask_BTS[:, None], (b, g, *mask_BTS.shape[1:]))
    segments = [(k_BKSD, v_BKDS, mask_BTS)] + ([new_kv] if new_kv is not None else [])
    scores = [_scores(q, k, rows(m).reshape(b, g * t, -1)) for k, _, m in segments]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(v_BKDS.dtype)
    splits = np.cumsum([x.shape[-1] for x in scores])[:-1]
    out = sum(
        jnp.einsum('bkms,bkds->bkmd', p, v)
        for p, (_, v, _) in zip(jnp.split(probs, splits, axis=-1), segments)
    )
    return jnp.transpose(out.reshape(b, kv, g, t, d), (0, 3, 1, 2, 4)).reshape(b, t, h, d)


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads and rotary positions."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        e, h, k, d, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        out_std = _INIT_STD / (2 * cfg.n_layers) ** 0.5
        self.q = param(rngs, (e, h, d), ('embed', 'heads', 'head_dim'), pd)
        self.k = param(rngs, (e, k, d), ('embed', 'kv_heads', 'head_dim'), pd)
        self.v = param(rngs, (e, k, d), ('embed', 'kv_heads', 'head_dim'), pd)
        self.o = param(rngs, (h, d, e), ('heads', 'head_dim', 'embed'), pd, std=out_std)
        # A static tuple (part of the graph definition, not a parameter): a constant under jit.
        self.inv_freq = tuple(inv_frequencies(d, cfg.rope_theta, cfg.rope_scaling).tolist())
        self.dtype = cfg.dtype

    def project_qkv(self, x_BTE, positions_BT):
        """Returns rotated q [B, T, H, D], rotated k [B, T, K, D] and v [B, T, K, D]."""
        dt = self.dtype
        q = jnp.einsum('bte,ehd->bthd', x_BTE, self.q[...].astype(dt))
        k = jnp.einsum('bte,ekd->btkd', x_BTE, self.k[...].astype(dt))
        v = jnp.einsum('bte,ekd->btkd', x_BTE, self.v[...].astype(dt))
        return rope(q, positions_BT, self.inv_freq), rope(k, positions_BT, self.inv_freq), v

    def project_out(self, out_BTHD):
        # One contracted axis of H * D, both operands reshaped (free on the row-major weight):
        # contracting (h, d) as two axes let XLA:CPU transpose the whole [H, D, E] weight on
        # every call to match the attention output's layout (docs/performance.md).
        b, t, h, d = out_BTHD.shape
        w_FE = self.o[...].astype(self.dtype).reshape(h * d, -1)
        return jnp.einsum('btf,fe->bte', out_BTHD.reshape(b, t, h * d), w_FE)

    def __call__(self, x_BTE, positions_BT, mask_BTS, cache_kv=None, lengths_B=None):
        """-> (output [B, T, E], this call's keys [B, K, T, D] and values [B, K, D, T]).

        Without cache_kv attends within the T tokens. With one layer's (k, v) caches attends over
        the cache as it is and this call's entries (rounded to the cache's dtype, as it will store
        them) as if written at lengths_B; it does not write them: the model writes every layer's
        entries after reading (specjax.models.kv_cache.write_entries), so a decode loop updates
        the cache in place.
        """
        q, k_BTKD, v_BTKD = self.project_qkv(x_BTE, positions_BT)
        k_BKTD = jnp.transpose(k_BTKD, (0, 2, 1, 3))  # the cache's heads-major layout
        v_BKDT = jnp.transpose(v_BTKD, (0, 2, 3, 1))  # (specjax.models.kv_cache)
        if cache_kv is None:
            return self.project_out(attend(q, k_BKTD, v_BKDT, mask_BTS)), (k_BKTD, v_BKDT)
        cache_k, cache_v = cache_kv
        k_BKTD, v_BKDT = k_BKTD.astype(cache_k.dtype), v_BKDT.astype(cache_v.dtype)
        old_mask_BTC, new_mask_BTT = kvc.split_mask(mask_BTS, lengths_B, k_BKTD.shape[2])
        new_kv = (k_BKTD.astype(q.dtype), v_BKDT.astype(q.dtype), new_mask_BTT)
        out = attend(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), old_mask_BTC, new_kv)
        return self.project_out(out), (k_BKTD, v_BKDT)


class SwiGLU(nnx.Module):
    """Gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        e, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        self.gate = param(rngs, (e, f), ('embed', 'mlp'), pd)
        self.up = param(rngs, (e, f), ('embed', 'mlp'), pd)
        self.down = param(
            rngs, (f, e), ('mlp', 'embed'), pd, std=_INIT_STD / (2 * cfg.n_layers) ** 0.5
        )
        self.dtype = cfg.dtype

    def __call__(self, x_BTE):
        dt = self.dtype
        gate = jnp.einsum('bte,ef->btf', x_BTE, self.gate[...].astype(dt))
        up = jnp.einsum('bte,ef->btf', x_BTE, self.up[...].astype(dt))
        return jnp.einsum('btf,fe->bte', jax.nn.silu(gate) * up, self.down[...].astype(dt))
