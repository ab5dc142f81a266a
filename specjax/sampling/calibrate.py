"""Measures the cost ratios speculative decoding's speedup depends on, on the hardware at hand.

  c     = draft single-step time / target single-step time
  v(k)  = time of one (k+1)-token target verification call / target single-step time

Each cached call is timed inside one jitted `lax.fori_loop` of `iters` calls at a fixed cache
position (the loop's writes are real, lengths are reset), the way the samplers' while-loops run
them, so Python dispatch is excluded. The tokens fed back are the argmax of the previous call's
logits, so nothing is dead code. Warm-up (compile and first run) is excluded; the reported time is
the median over `repeats` runs, divided by `iters`.

`loop_overhead` compares `autoregressive_sample`'s tokens/s with 1 / (single-step time): what the
sampler adds per token (sampling, bookkeeping, the while loop).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import (
    DECODE_COMPILER_OPTIONS,
    Transformer,
    apply_cached,
    check_capacity,
    init_cache,
    merge,
    split,
)
from specjax.sampling import aot, drafters
from specjax.sampling import common as sampling_common
from specjax.sampling.ngram import is_ngram


@dataclasses.dataclass
class Calibration:
    """Timings (seconds per call) and the ratios c and v(k) for one batch size."""

    batch_size: int
    context_len: int
    capacity: int
    target_step_s: float
    draft_step_s: float
    verify_s: dict[int, float]

    @property
    def c(self) -> float:
        return self.draft_step_s / self.target_step_s

    @property
    def v(self) -> dict[int, float]:
        return {k: t / self.target_step_s for k, t in self.verify_s.items()}

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out['verify_s'] = {str(k): t for k, t in self.verify_s.items()}
        out['c'] = self.c
        out['v'] = {str(k): x for k, x in self.v.items()}
        return out


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() (blocked until ready) over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cached_step(graphdef, params, tokens_BT, num_valid_B, cache):
    """One cached call -> (logits, cache); a feature draft reads zero features (its cost does
    not depend on their values)."""
    if drafters.feature_config_of(graphdef) is None:
        return apply_cached(graphdef, params, tokens_BT, num_valid_B, cache)
    model = merge(graphdef, params)
    features = jnp.zeros((*tokens_BT.shape, model.config.target.d_model), jnp.float32)
    logits, _, cache = model.decode(tokens_BT, features, num_valid_B, cache)
    return logits, cache


@functools.lru_cache(maxsize=64)
def _loop_fn(graphdef, iters: int):
    """Jitted (params, tokens [B, T], cache) -> tokens: `iters` cached calls at one position."""

    def run(params, tokens, cache):
        num_valid = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)

        def body(_, carry):
            toks, c = carry
            logits, new_c = _cached_step(graphdef, params, toks, num_valid, c)
            return jnp.argmax(logits, -1).astype(jnp.int32), new_c.replace(lengths=c.lengths)

        return jax.lax.fori_loop(0, iters, body, (tokens, cache))[0]

    return jax.jit(run, compiler_options=DECODE_COMPILER_OPTIONS)


def timed_call(model, *, batch_size, num_tokens, context_len, capacity, iters, seed=0):
    """A zero-argument call running `iters` cached calls of [batch_size, num_tokens] at cache
    length context_len in one jitted loop (time it and divide by iters)."""
    fn, args = _loop_call(model, batch_size, num_tokens, context_len, capacity, iters, seed)
    return lambda: fn(*args)


def _loop_call(model, batch_size, num_tokens, context_len, capacity, iters, seed=0):
    """(jitted loop, its arguments) of timed_call."""
    graphdef, params = split(model)
    cfg = sampling_common.config_of(graphdef)  # a feature draft: its own blocks' config
    for name, value in (('batch_size', batch_size), ('num_tokens', num_tokens), ('iters', iters)):
        if value < 1:
            raise ValueError(f'calibrate: {name} must be >= 1, got {value}')
    check_capacity(capacity, context_len + num_tokens, what='calibrate')
    cache = init_cache(cfg, batch_size, capacity, lengths=jnp.full((batch_size,), context_len))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch_size, num_tokens)), jnp.int32)
    return _loop_fn(graphdef, iters), (params, tokens, cache)


def compiled_calls(parts: dict) -> dict:
    """name -> zero-argument call of each (jitted fn, args) in `parts`, all compiled ahead of
    time side by side (specjax.sampling.aot)."""
    lowered = [fn.lower(*args) for fn, args in parts.values()]
    compiled, _, _ = aot.compile_lowered(lowered)
    return {
        name: functools.partial(c, *args)
        for (name, (_, args)), c in zip(parts.items(), compiled, strict=True)
    }


def interleaved_times(
    calls: dict, repeats: int = 5, warmup: int = 1, clock=time.perf_counter
) -> dict[object, list[float]]:
    """Times every call once per repeat, round-robin, so load drift hits all of them alike.

    Returns name -> list of `repeats` times (after `warmup` untimed runs of each): wall time by
    default; `clock=time.process_time` gives this process's CPU seconds (all its threads), which
    other processes' load on a shared machine barely moves.
    """
    for fn in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = clock()
            jax.block_until_ready(fn())
            times[name].append(clock() - t0)
    return times


def call_time(
    model: Transformer,
    *,
    batch_size: int,
    num_tokens: int,
    context_len: int,
    capacity: int,
    iters: int = 16,
    repeats: int = 5,
    seed: int = 0,
) -> float:
    """Seconds per cached call of `num_tokens` new tokens per row at cache length `context_len`."""
    fn = timed_call(
        model,
        batch_size=batch_size,
        num_tokens=num_tokens,
        context_len=context_len,
        capacity=capacity,
        iters=iters,
        seed=seed,
    )
    return median_time(fn, repeats=repeats) / iters


def calibrate(
    target: Transformer,
    draft: Transformer,
    *,
    batch_size: int,
    ks: Sequence[int] = tuple(range(1, 9)),
    context_len: int = 64,
    capacity: int | None = None,
    iters: int = 16,
    repeats: int = 5,
    draft_vocab_ids=None,
) -> Calibration:
    """Measures target/draft single-step times and (k+1)-token verification times (an
    NGramDraft has no draft step: c = 0).

    Its programs compile side by side (`compiled_calls`), then all calls are timed round-robin
    (`interleaved_times`); c and v(k) are medians of the per-repeat ratios, which shrugs off
    load drift on a shared machine better than ratios of medians. capacity defaults to
    context_len + max(ks) + 1 rounded up to a multiple of 64 (attention reads the whole cache:
    use the capacity your sampler runs with).
    """
    ks = tuple(int(k) for k in ks)
    if not ks or min(ks) < 1:
        raise ValueError(f'calibrate: ks must be non-empty positive ints, got {ks}')
    ngram = is_ngram(draft)  # no draft model: c = 0 (a lookup, no draft step)
    if ngram:
        pass
    elif draft_vocab_ids is not None:  # a reduced-vocabulary draft: only the mapping must hold
        from specjax.sampling.draft_vocab import check_draft_vocab

        check_draft_vocab(draft_vocab_ids, target.config.vocab_size, draft.config.vocab_size)
    elif target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(
            f'calibrate: target vocab_size={target.config.vocab_size} != draft '
            f'vocab_size={draft.config.vocab_size}'
        )
    if capacity is None:
        capacity = -(-(context_len + max(ks) + 1) // 64) * 64
    common = (context_len, capacity, iters)
    parts = {'target': _loop_call(target, batch_size, 1, *common)}
    if not ngram:
        parts['draft'] = _loop_call(draft, batch_size, 1, *common)
    parts.update({k: _loop_call(target, batch_size, k + 1, *common) for k in ks})
    times = interleaved_times(compiled_calls(parts), repeats=repeats)
    target_t = np.asarray(times['target'])
    target_step = float(np.median(target_t)) / iters
    ratio = lambda name: float(np.median(np.asarray(times[name]) / target_t))
    return Calibration(
        batch_size,
        context_len,
        capacity,
        target_step,
        draft_step_s=0.0 if ngram else ratio('draft') * target_step,
        verify_s={k: ratio(k) * target_step for k in ks},
    )


def cost_ratio(
    model: Transformer,
    reference: Transformer,
    *,
    batch_size: int,
    context_len: int,
    capacity: int,
    iters: int = 16,
    repeats: int = 5,
) -> float:
    """Single-step time of `model` / that of `reference` (c for another draft), round-robin."""
    common = dict(batch_size=batch_size, context_len=context_len, capacity=capacity, iters=iters)
    calls = {
        'model': timed_call(model, num_tokens=1, **common),
        'reference': timed_call(reference, num_tokens=1, **common),
    }
    times = interleaved_times(calls, repeats=repeats)
    return float(np.median(np.asarray(times['model']) / np.asarray(times['reference'])))


def loop_overhead(
    model: Transformer,
    *,
    batch_size: int,
    prompt_len: int = 16,
    max_new_tokens: int = 64,
    sampling=None,
    repeats: int = 5,
    iters: int = 16,
    seed: int = 0,
) -> dict:
    """autoregressive_sample's tokens/s against 1 / (single-step time), at the sampler's capacity.

    The sampler runs prefill once and max_new_tokens single-token steps: per_token_s =
    (sampler time - prefill time) / max_new_tokens, with the prefill ([B, prompt_len] call) and
    the single step timed like `calibrate` at the sampler's cache capacity (prompt_len +
    max_new_tokens + 1). All three are timed round-robin. overhead = per_token_s / step_s - 1:
    what sampling, bookkeeping and the while loop add to each model call.
    """
    from specjax.sampling import SamplingConfig, make_autoregressive_fn

    sampling = SamplingConfig() if sampling is None else sampling
    cfg = model.config
    capacity = prompt_len + max_new_tokens + 1
    rng = np.random.default_rng(seed)
    prompts = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch_size, prompt_len)), jnp.int32)
    lengths = jnp.full((batch_size,), prompt_len, jnp.int32)
    graphdef, params = split(model)
    sampler = make_autoregressive_fn(graphdef, max_new_tokens=max_new_tokens, sampling=sampling)
    key = jax.random.key(seed)
    common = dict(batch_size=batch_size, capacity=capacity, iters=iters)
    calls = {
        'sampler': lambda: sampler(params, prompts, lengths, key).tokens,
        'prefill': timed_call(model, num_tokens=prompt_len, context_len=0, **common),
        'step': timed_call(model, num_tokens=1, context_len=prompt_len, **common),
    }
    times = {name: float(np.median(t)) for name, t in interleaved_times(calls, repeats).items()}
    step, prefill = times['step'] / iters, times['prefill'] / iters
    per_token = (times['sampler'] - prefill) / max_new_tokens
    return {
        'batch_size': batch_size,
        'prompt_len': prompt_len,
        'max_new_tokens': max_new_tokens,
        'sampling': sampling.to_dict(),
        'sampler_s': times['sampler'],
        'prefill_s': prefill,
        'per_token_s': per_token,
        'step_s': step,
        'tokens_per_s': batch_size / per_token,
        'step_tokens_per_s': batch_size / step,
        'end_to_end_tokens_per_s': batch_size * max_new_tokens / times['sampler'],
        'overhead': per_token / step - 1.0,
    }
