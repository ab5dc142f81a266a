"""A sampled row's output: when it stops (`Stop`, run-time values), each round's emitted
tokens written at the row's own offset, and the final [B, max_new_tokens] tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PAD_ID = 0


@struct.dataclass
class Stop:
    """When a row ends, as jit arguments (int32 scalars, so one compiled sampler serves every
    value): after max_new tokens (1 <= max_new <= the program's buffer, its max_new_tokens) or
    at the first eos_id, which is kept (-1: no eos)."""

    max_new: jax.Array
    eos_id: jax.Array


def stop_values(max_new: int, eos_id) -> Stop:
    """A Stop of host int32 scalars; eos_id None -> -1 (never matches a token id)."""
    return Stop(np.int32(max_new), np.int32(-1 if eos_id is None else eos_id))


def write_rows(buffer_BN, block_BT, offsets_B):
    """Writes each row's block at its own offset (caller sizes the buffer so nothing clamps)."""
    update = lambda buf, blk, i: jax.lax.dynamic_update_slice(buf, blk, (i,))
    return jax.vmap(update)(buffer_BN, block_BT, offsets_B)


def finish_tokens(buffer_BN, lengths_B, max_new_tokens: int):
    """[B, max_new_tokens] tokens with PAD_ID at and after each row's length."""
    tokens = buffer_BN[:, :max_new_tokens]
    keep = jnp.arange(max_new_tokens)[None, :] < lengths_B[:, None]
    return jnp.where(keep, tokens, PAD_ID).astype(jnp.int32)


def first_eos_count(block_BT, count_B, eos_id):
    """Tokens of each row's block that are emitted: up to count, cut just after the first eos
    (eos_id: an int or a traced int32, -1 = none; None: no eos, nothing computed)."""
    if eos_id is None:
        return count_B
    idx = jnp.arange(block_BT.shape[1])[None, :]
    is_eos = (block_BT == eos_id) & (idx < count_B[:, None])
    first = jnp.where(is_eos.any(-1), jnp.argmax(is_eos, -1) + 1, count_B)
    return jnp.minimum(count_B, first).astype(jnp.int32)


def round_block(proposed_BK, num_acc_B, next_token_B):
    """[B, K + 1]: each row's accepted proposals then its replacement/bonus token, 0 after."""
    j = jnp.arange(proposed_BK.shape[1] + 1)[None, :]
    padded = jnp.pad(proposed_BK, ((0, 0), (0, 1)))
    block = jnp.where(j == num_acc_B[:, None], next_token_B[:, None], 0)
    return jnp.where(j < num_acc_B[:, None], padded, block)


def emit_round(proposed_BK, num_acc_B, next_token_B, out_BN, emitted_B, act_B, *, max_new, eos_id):
    """Writes a round's accepted proposals and its replacement/bonus token into each row's output.

    Row b emits proposed[b, :num_acc[b]] then next_token[b], cut at eos and at max_new tokens
    (static ints, or a traced Stop's fields).
    Returns (count [B] tokens emitted, hit_eos [B], emitted [B], out [B, N]); act (0/1 int32)
    masks rows that are already done.
    """
    j = jnp.arange(proposed_BK.shape[1] + 1)[None, :]
    block = round_block(proposed_BK, num_acc_B, next_token_B)
    count = jnp.minimum(num_acc_B + 1, max_new - emitted_B)
    count = first_eos_count(block, count, eos_id)
    hit_eos = jnp.zeros(count.shape, bool)
    if eos_id is not None:
        hit_eos = jnp.any((block == eos_id) & (j < count[:, None]), axis=1)
    return count, hit_eos, emitted_B + count * act_B, write_rows(out_BN, block, emitted_B)
