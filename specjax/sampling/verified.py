"""The target's log-probabilities at every emitted position, out of the chain sampler's loop.

What online distillation learns from (specjax.distill.online_update): each round the target
scores last + x_1..x_k, so its logits [B, k + 1, V] hold the law of output positions
emitted .. emitted + k. Position emitted + i is final once the row keeps i tokens of the round
(the accepted x_1..x_n and the replacement or bonus token at i = n); later positions are written
again by the next round, which starts at emitted + n + 1. After the loop, entry [b, j] is the
target's log-softmax (temperature 1, no top-k/top-p, no grammar mask) for tokens[b, j] given the
prompt and tokens[b, :j], for j < lengths[b]; entries past a row's length are undefined.
The buffer is [B, max_new + k + 1, V] float32 in the loop state; the output drops the tail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def initial(batch: int, width: int, vocab: int, keep: bool):
    """The loop's buffer: zeros [B, width, V] float32 when `keep`, else () (no buffer)."""
    return jnp.zeros((batch, width, vocab), jnp.float32) if keep else ()


def write(buffer, logits_BWV, emitted_B, active_B):
    """buffer with each active row's log-softmax of logits [B, W, V] at emitted_B .. + W - 1."""
    if isinstance(buffer, tuple):
        return buffer
    logp = jax.nn.log_softmax(logits_BWV.astype(jnp.float32), axis=-1)
    width = logp.shape[1:]
    old = jax.vmap(lambda buf, at: jax.lax.dynamic_slice(buf, (at, 0), width))(buffer, emitted_B)
    new = jnp.where(active_B[:, None, None], logp, old)  # a finished row keeps its entries
    put = lambda buf, lp, at: jax.lax.dynamic_update_slice(buf, lp, (at, 0))
    return jax.vmap(put)(buffer, new, emitted_B)


def output(buffer, max_new: int):
    """[B, max_new, V] of the buffer, or None without one."""
    return None if isinstance(buffer, tuple) else buffer[:, :max_new]
