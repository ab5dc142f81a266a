"""Guards that keep the samplers from returning garbage silently.

Before compiling (host side, on concrete inputs): every prompt token inside a row's length must
be a token id in [0, vocab_size) of the target (`check_prompt_ids`; padding past it is replaced
by PAD_ID inside the compiled program, `clean_padding`), and every child rank of a
tree must be below vocab_size (`check_tree_ranks`); both raise ValueError naming the argument,
the value and its position. Traced inputs (a sampler's core called inside a caller's own jit)
cannot be read on the host, so these checks are skipped for them: such callers check their ids
themselves.

Inside the compiled loop: each round or-s into a boolean flag per model whether any logits of an
active row (finished rows and padding excluded) hold NaN or +-inf (`any_nonfinite`). The flags
come back in the output's stats as `nonfinite_target` and `nonfinite_draft` (bool scalars,
False for a sampler without that model), also when the core runs traced; on a concrete result
the samplers raise `NonFiniteLogitsError` after the call (`raise_if_nonfinite`), naming the
model and the sampler. With the internal switch `check_finite=False` (cost measurement only:
benchmarks/guard_cost.py) the flags stay False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODELS = ('target', 'draft')
FLAG_STATS = tuple(f'nonfinite_{m}' for m in MODELS)


class NonFiniteLogitsError(FloatingPointError):
    """A sampler's target or draft produced NaN or inf logits; `models` names which, `sampler`
    the sampler. Its outputs are garbage (NaN probabilities sample the pad id or anything)."""

    def __init__(self, sampler: str, models: tuple[str, ...]):
        self.sampler, self.models = sampler, tuple(models)
        which = ' and '.join(f'the {m} model' for m in self.models)
        super().__init__(
            f'{sampler}: {which} produced non-finite logits (NaN or inf) while decoding, so '
            "its tokens and statistics are garbage; check that model's parameters (a NaN or "
            'inf weight, e.g. from a diverged run or a corrupt checkpoint) and its dtype range. '
            f'Traced callers read the flags from result.stats[{", ".join(map(repr, FLAG_STATS))}]'
        )


def is_traced(x) -> bool:
    """Whether x is an abstract value inside a trace (its contents unknown on the host)."""
    return isinstance(x, jax.core.Tracer)


def check_prompt_ids(prompts, prompt_lengths, vocab_size: int, who: str) -> None:
    """ValueError unless every prompts[b, i] with i < prompt_lengths[b] lies in [0, vocab_size).

    Padding past a row's length is not checked: the cores replace it (`clean_padding`). Skipped
    when either argument is traced. `who` names the model and sampler in the message.
    """
    if is_traced(prompts) or is_traced(prompt_lengths):
        return
    tokens, lengths = np.asarray(prompts), np.asarray(prompt_lengths)
    inside = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    bad = inside & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f'prompts[{row}, {col}]={int(tokens[row, col])} is outside the vocabulary '
            f'[0, vocab_size={vocab_size}) of the {who} ({int(bad.sum())} such ids inside the '
            "prompt lengths); prompt ids must be token ids of the target's tokenizer"
        )


def clean_padding(prompts_BP, prompt_lengths_B):
    """prompts with PAD_ID (0) past each row's length (inside jit): whatever the padding holds,
    it cannot reach the models (an out-of-range id there would embed as NaN, and masked cache
    entries times zero attention weight are still NaN). Same tokens for in-range padding."""
    inside = jnp.arange(prompts_BP.shape[1])[None, :] < prompt_lengths_B[:, None]
    return jnp.where(inside, prompts_BP, 0)


def check_tree_ranks(tree, vocab_size: int) -> None:
    """ValueError unless every child rank of the canonical `tree` is < vocab_size (a node has at
    most vocab_size distinct children)."""
    for path in tree:
        for depth, rank in enumerate(path, start=1):
            if rank >= vocab_size:
                raise ValueError(
                    f'tree path {path}: child rank {rank} >= vocab_size={vocab_size} at depth '
                    f'{depth} (ranks must lie in [0, {vocab_size}))'
                )


def any_nonfinite(logits, active_B, enabled: bool = True):
    """bool scalar: whether logits [B, ...] hold NaN or +-inf in an active row (False when not
    `enabled`: the measurement switch)."""
    if not enabled:
        return jnp.zeros((), bool)
    mask = active_B.reshape(active_B.shape + (1,) * (logits.ndim - 1))
    return jnp.any(~jnp.isfinite(logits) & mask)


def initial_flags() -> dict:
    """The flags' loop-state start: False for both models."""
    return {name: jnp.zeros((), bool) for name in FLAG_STATS}


def _host_bool(x) -> bool:
    """A concrete (possibly replicated multi-process) scalar as a Python bool, read from this
    process's own copy (no collective)."""
    if isinstance(x, jax.Array):
        return bool(np.asarray(x.addressable_data(0)))
    return bool(np.asarray(x))


def raise_if_nonfinite(out, sampler: str):
    """Returns `out` (a SampleOutput) after raising NonFiniteLogitsError if a flag in its stats
    is set; a traced output is returned unchecked (its stats carry the flags)."""
    flags = {m: out.stats.get(f'nonfinite_{m}') for m in MODELS}
    bad = tuple(m for m, f in flags.items() if f is not None and not is_traced(f) and _host_bool(f))
    if bad:
        raise NonFiniteLogitsError(sampler, bad)
    return out
