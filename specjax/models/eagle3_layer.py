"""EAGLE-3's first draft decoder layer (vLLM / SGLang `llama_eagle3.py`), Flax NNX.

Inputs per position: the token embedding emb [B, T, E] and the feature f [B, T, E] (fused target
hidden states, or the draft's own fed-back state). With RMSNorms n_in (`input_norm`, vLLM's
input_layernorm), n_h (`hidden_norm`) and n_post (`post_norm`, post_attention_layernorm):

    x   = concat(n_in(emb), n_h(f))                     [B, T, 2E]   (embedding half first)
    r   = f              (norm_before_residual=False: vLLM's default, SGLang's only behaviour)
        = n_h(f)         (norm_before_residual=True: vLLM only)
    s   = r + o(attend(rope(q(x)), rope(k(x)), v(x)))   q, k, v read the 2E-wide x
    out = s + mlp(n_post(s))                            SwiGLU, as a Llama MLP

`out` is the residual stream (vLLM's hidden_states + residual): later layers are standard Llama
blocks over it (specjax.models.transformer.Block), and the final norm of the last one's output
gives the logits while the un-normed sum is the draft's output state. Attention, RoPE, SwiGLU,
RMSNorm and the KV-cache writes are specjax.models.layers' and kv_cache's own functions.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from specjax.models.config import TransformerConfig
from specjax.models.layers import Attention, RMSNorm, SwiGLU, inv_frequencies, param

_INIT_STD = 0.02


class WideAttention(Attention):
    """Attention whose q / k / v projections read `in_dim` inputs (EAGLE-3: 2E); the output
    projection, RoPE and `project_qkv` / `project_out` are Attention's."""

    def __init__(self, cfg: TransformerConfig, in_dim: int, *, rngs: nnx.Rngs):
        h, k, d, pd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        out_std = _INIT_STD / (2 * cfg.n_layers) ** 0.5
        self.q = param(rngs, (in_dim, h, d), ('embed', 'heads', 'head_dim'), pd)
        self.k = param(rngs, (in_dim, k, d), ('embed', 'kv_heads', 'head_dim'), pd)
        self.v = param(rngs, (in_dim, k, d), ('embed', 'kv_heads', 'head_dim'), pd)
        self.o = param(rngs, (h, d, cfg.d_model), ('heads', 'head_dim', 'embed'), pd, std=out_std)
        self.inv_freq = tuple(inv_frequencies(d, cfg.rope_theta, cfg.rope_scaling).tolist())
        self.dtype = cfg.dtype


class Eagle3FirstLayer(nnx.Module):
    """The equations of the module docstring; cfg is the draft's decoder config (width E)."""

    def __init__(self, cfg: TransformerConfig, *, norm_before_residual: bool, rngs: nnx.Rngs):
        e, eps, pd = cfg.d_model, cfg.norm_eps, cfg.param_dtype
        self.input_norm = RMSNorm(e, eps, pd, rngs=rngs)
        self.hidden_norm = RMSNorm(e, eps, pd, rngs=rngs)
        self.attn = WideAttention(cfg, 2 * e, rngs=rngs)
        self.post_norm = RMSNorm(e, eps, pd, rngs=rngs)
        self.mlp = SwiGLU(cfg, rngs=rngs)
        self.norm_before_residual = bool(norm_before_residual)

    def __call__(self, emb_BTE, f_BTE, positions_BT, mask_BTS, cache_kv=None, lengths_B=None):
        """-> (out [B, T, E], this call's (k, v) entries); with (k, v) caches attends over them
        and the entries as if written at lengths_B (mask [B, T, capacity]; Attention), else
        within the T positions (mask [B, T, T])."""
        h = self.hidden_norm(f_BTE)
        residual = h if self.norm_before_residual else f_BTE
        x = jnp.concatenate([self.input_norm(emb_BTE), h], -1)
        out, kv = self.attn(x, positions_BT, mask_BTS, cache_kv, lengths_B)
        s = residual + out
        return s + self.mlp(self.post_norm(s)), kv
