"""The loop state of the chain and tree speculative samplers (specjax.sampling.speculative,
specjax.sampling.tree_speculative)."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from specjax.models import KVCache


@struct.dataclass
class SpeculativeState:
    """Loop state of the chain and tree samplers (B rows, K = k proposals for a chain or the
    tree's depth D, N = max_new_tokens + K + 1).

    tcache / dcache: target / draft KV caches. last [B]: the newest context token, not yet fed
    to the target; prev [B]: the last accepted proposal of the previous round (x_k, or the
    depth-D node), fed to a token draft with `last` when draft_pending [B] is 2; a feature
    draft's draft_pending entries are in dfeed (specjax.sampling.drafters). out [B, N] emitted
    tokens, emitted [B] their count, done [B]. round (scalar) batched rounds so far, row_rounds
    [B] rounds each row was active in; row_examined_per_position / row_accepted_per_position
    [B, K]: rounds in which the row tested / accepted a proposal at position (depth) i + 1.
    nonfinite_target / nonfinite_draft (bool scalars): whether that model's logits held NaN or
    inf in an active row in some round so far (specjax.sampling.guards).
    """

    tcache: KVCache
    dcache: KVCache
    last: jax.Array
    prev: jax.Array
    draft_pending: jax.Array
    out: jax.Array
    emitted: jax.Array
    done: jax.Array
    round: jax.Array
    row_rounds: jax.Array
    row_examined_per_position: jax.Array
    row_accepted_per_position: jax.Array
    row_drafted: Any = None  # [B] proposals made (chain sampler; k per round without a stop)
    nonfinite_target: jax.Array = False  # defaults: states built outside the samplers
    nonfinite_draft: jax.Array = False
    dfeed: Any = ()
    task: Any = ()  # a task.TaskState under stops or a grammar
    verified: Any = ()  # [B, N, V] the target's log-probs per output position (verified.py)
