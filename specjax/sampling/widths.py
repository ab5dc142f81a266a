"""Verification as wide as a round's proposals: the target's call picked from a few widths.

When rows propose m <= k tokens (an n-gram draft without a match proposes none; confidence-stopped
chains stop early), scoring all k + 1 positions wastes work: on hardware where a wider call costs
more (XLA:CPU's small matrix products), the round's target call is the narrowest of
`verify_widths(k)` that holds every active row's m + 1 positions, chosen by `lax.switch` inside
the compiled loop (every width compiled once, only the chosen one runs). Positions past a row's m
are never read (specjax.sampling.verify.stop_at), so the outputs are those of the full-width call.
The branches only read the KV cache and return their new entries; one write after the switch
stores them (a cache written inside a branch is copied there, every layer, every round).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import kv_cache as kvc


def verify_widths(k: int) -> tuple[int, ...]:
    """The call widths for k proposals: 1, 2, 3, 5, 9, ... (2^i + 1) below k + 1, and k + 1."""
    widths = {1, k + 1}
    w = 2
    while w < k + 1:
        widths.add(w)
        w = 2 * w - 1
    return tuple(sorted(widths))


def scored_call(drafter, tgd, tparams, tokens_BK1, m_B, active_B, tcache):
    """The target's cached call on the first w tokens of tokens_BK1 ([B, k + 1]: `last` and the
    proposals), w the narrowest width holding max(m + 1) over active rows -> (logits [B, k + 1, V]
    and features [B, k + 1, n, E] or None, zero past w; cache with k + 1 entries written, those
    past w zeros that no call reads: the round leaves every row's length at most w past it)."""
    k1 = tokens_BK1.shape[1]
    widths = verify_widths(k1 - 1)
    need = jnp.max(jnp.where(active_B, m_B, 0)) + 1
    index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), need, side='left')
    zeros = jnp.zeros_like(m_B)

    def call(w):
        def run(cache):
            logits, new, features = drafter.target_call(tgd, tparams, tokens_BK1[:, :w], zeros,
                                                        cache, write=False)  # fmt: skip
            pad = lambda a, axis: jnp.pad(a, [(0, k1 - w) if i == axis else (0, 0)
                                              for i in range(a.ndim)])  # fmt: skip
            new = kvc.map_layers(pad, new)  # the entries past w are never read
            return pad(logits, 1), new, None if features is None else pad(features, 1)

        return run

    if len(widths) == 1:
        logits, new, features = call(k1)(tcache)
    else:
        branches = [call(w) for w in widths]
        pick = jnp.minimum(index, len(widths) - 1)
        logits, new, features = jax.lax.switch(pick, branches, tcache)
    return logits, kvc.write_entries(tcache, new, zeros), features
