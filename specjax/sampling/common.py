"""Pieces both samplers share: the output type, argument checks, and jit/sharding plumbing."""

from __future__ import annotations

import copy
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.nnx import graphlib

from specjax.models import (
    DECODE_COMPILER_OPTIONS,
    FeatureDraftConfig,
    KVCache,
    TransformerConfig,
    apply_cached,
    check_capacity,
)
from specjax.parallel import (
    DEFAULT_RULES,
    batch_sharding,
    check_divisible,
    default_mesh_config,
    host_rows,
    make_mesh,
    param_shardings,
    replicated,
)
from specjax.parallel.mesh import resolve_rules
from specjax.parallel.sharding import check_batch, check_model_on_mesh, constrain_cache
from specjax.sampling import guards, task
from specjax.sampling.emit import stop_values
from specjax.sampling.transforms import SamplingConfig


@struct.dataclass
class SampleOutput:
    """tokens int32 [B, max_new_tokens] (PAD_ID after a row's end); lengths int32 [B]; stats;
    finish_reason int32 [B]: why each row ended (specjax.sampling.FinishReason: LENGTH,
    STOP_TOKEN, STOP_STRING, GRAMMAR; None only in outputs built outside the samplers).

    stats maps names to arrays. Per row ([B], or [B, k] per position): `row_rounds` rounds in
    which the row was active (one target verification each; for autoregressive sampling one
    generated token each), `row_emitted` (= lengths), `row_drafted` (k per round),
    `row_examined` / `row_accepted` (proposals up to and including the first rejection / the
    accepted ones, both only where they fall inside the row's output: nothing after eos or
    max_new_tokens counts), `row_examined_per_position` / `row_accepted_per_position` [B, k],
    `row_target_calls` (rounds + 1 prefill), `row_draft_calls` (k per round + 1 prefill).
    Totals without the `row_` prefix are sums over rows; `batch_rounds` is the number of batched
    rounds the loop ran (the slowest row's). Block efficiency tau = emitted / rounds.
    `nonfinite_target` / `nonfinite_draft` (bool scalars): a model's logits held NaN or inf in
    an active row (specjax.sampling.guards; the samplers raise on concrete results). Under a
    grammar, `row_grammar_state` [B]: the automaton's state after the row's tokens.
    target_logprobs float32 [B, max_new_tokens, V]: the target's log-probs at each emitted
    position, where asked for (speculative_sample's `target_logprobs`; specjax.sampling.verified).
    """

    tokens: jax.Array
    lengths: jax.Array
    stats: dict[str, jax.Array]
    finish_reason: jax.Array | None = None
    target_logprobs: jax.Array | None = None


def config_of(graphdef) -> TransformerConfig:
    """The TransformerConfig a model's graphdef holds as a static attribute; for a feature draft
    (FeatureDraftConfig) the config of its own blocks and cache (vocab_size: its vocabulary)."""
    for _, attr in graphdef.attributes:
        if isinstance(attr, graphlib.Static) and isinstance(attr.value, TransformerConfig):
            return attr.value
        if isinstance(attr, graphlib.Static) and isinstance(attr.value, FeatureDraftConfig):
            return attr.value.decoder
    raise ValueError(f'graphdef of {graphdef.nodes[0].type} holds no TransformerConfig')


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f'{name} must be an int >= 1, got {value!r}')
    return int(value)


def check_sampling(sampling) -> SamplingConfig:
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f'sampling must be a SamplingConfig, got {sampling!r}')
    return sampling


def check_eos(eos_id, vocab_size: int):
    if eos_id is None:
        return None
    if isinstance(eos_id, bool) or not isinstance(eos_id, numbers.Integral):
        raise ValueError(f'eos_id must be an int or None, got {eos_id!r}')
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f'eos_id={eos_id} is outside the vocabulary [0, {vocab_size})')
    return int(eos_id)


def check_prompts(prompts, prompt_lengths) -> tuple[int, int]:
    """Checks int [B, P] prompts and int [B] lengths in [1, P]; returns (B, P)."""
    shape = np.shape(prompts)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f'prompts must be int32 [B, P] with B, P >= 1, got shape {shape}')
    if not jnp.issubdtype(jnp.result_type(prompts), jnp.integer):
        raise ValueError(f'prompts must be integer tokens, got dtype {jnp.result_type(prompts)}')
    batch, width = shape
    if np.shape(prompt_lengths) != (batch,):
        raise ValueError(
            f'prompt_lengths must have shape [B]=({batch},), got {np.shape(prompt_lengths)}'
        )
    lengths = np.asarray(prompt_lengths)
    bad = (lengths < 1) | (lengths > width)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(
            f'prompt_lengths[{row}]={int(lengths[row])} must be in [1, P={width}] '
            '(every row needs at least one prompt token)'
        )
    return batch, width


def check_fits(cfg: TransformerConfig, width: int, max_new_tokens: int, extra: int, who: str):
    """Capacity = P + max_new_tokens + extra scratch positions must fit the model's max_len."""
    check_capacity(
        cfg.max_len,
        width + max_new_tokens + extra,
        f'{who}: prompt width P={width} + max_new_tokens={max_new_tokens} + {extra} '
        f'against TransformerConfig.max_len',
    )
    return width + max_new_tokens + extra


def check_same_tokenizer(meta_a, meta_b) -> None:
    """Raises ValueError unless two checkpoints' tokenizer identities match (drafts need this)."""
    ident = lambda m: dict(m.get('tokenizer', m)) if isinstance(m, dict) else m
    a, b = ident(meta_a), ident(meta_b)
    if a != b:
        raise ValueError(f'tokenizer identities differ: {a!r} vs {b!r}')


def as_key(rng):
    """A PRNG key from a key (raw or typed) or an int seed."""
    if isinstance(rng, numbers.Integral):
        return jax.random.key(int(rng))
    return rng


def normalize_rules(rules) -> tuple:
    """Rules as hashable pairs: None = DEFAULT_RULES; a preset name or pairs otherwise."""
    return resolve_rules(DEFAULT_RULES if rules is None else rules, 'rules')


def normalize_draft_rules(draft_rules, rules: tuple) -> tuple:
    """The draft's rules: None = the target's (already normalised) `rules`."""
    return rules if draft_rules is None else resolve_rules(draft_rules, 'draft_rules')


def default_mesh():
    """A one-device mesh over the first device, from default_mesh_config()."""
    return make_mesh(default_mesh_config(), devices=jax.devices()[:1])


class ShardedSampler:
    """jax.jit of core(*params, prompts, lengths, rng[, values]) -> SampleOutput on a mesh.

    `models` gives, per params argument, (who, graphdef, rules, rules field): each model's
    parameters are sharded by its own rules (a draft may be replicated while the target is
    split), shardings built from the first params seen (the graphdef fixes their structure).
    Prompts, lengths and the outputs' per-row arrays lie on the target rules' 'batch' axes,
    the key and the totals are replicated. Prompts are host-local rows: with several processes
    each passes its own rows and the global batch is their concatenation in process order.
    One compile per prompt shape; every check (`check(width)`, batch and head divisibility,
    missing rules, prompt ids in the first model's vocabulary) runs on the host before any
    compile. A call raises guards.NonFiniteLogitsError, naming `name`, when the output's flags
    say a model produced non-finite logits (`checked`; see specjax.sampling.guards).

    With `takes_values`, core takes one more argument, a replicated pytree bound by
    `with_values`: (TracedSampling, Stop), the sampling values and when rows end. The samplers
    `with_values` returns share this one's jit, so they compile once between them (per shape
    and values structure); `max_new_tokens` is the program's output buffer, the largest Stop.
    """

    def __init__(
        self, core, mesh, rules, check, models=None, takes_values=False, name='sampler',
        max_new_tokens=None,
    ):  # fmt: skip
        self.core, self.mesh, self.rules, self.check = core, mesh, rules, check
        self.name, self.max_new_tokens = name, max_new_tokens
        self.models, self.takes_values, self.values = models, takes_values, None
        self._program = {'jitted': None, 'shardings': None}  # shared with with_values' copies

    def with_values(self, values) -> ShardedSampler:
        """A sampler sharing this one's jit (and compiled programs) that passes `values`."""
        if not self.takes_values:
            raise ValueError('with_values: this sampler takes no values argument')
        bound = copy.copy(self)
        bound.values = values
        return bound

    def with_sampling(
        self, sampling: SamplingConfig, dynamic: bool = False, eos_id=None
    ) -> ShardedSampler:
        """with_values((sampling.traced(dynamic), Stop at max_new_tokens and eos_id)), the same
        object for the same arguments."""
        return _with_sampling(self, sampling, bool(dynamic), eos_id)

    def with_max_new(self, max_new: int) -> ShardedSampler:
        """This sampler (same jit and compiled programs, same sampling and eos) ending rows
        after max_new <= max_new_tokens tokens; outputs keep their [B, max_new_tokens] shape,
        PAD_ID past each row's length."""
        n = check_positive_int('max_new', max_new)
        if self.values is None or n > self.max_new_tokens:
            raise ValueError(
                f'with_max_new({max_new}): needs a sampler with values and max_new <= its '
                f'max_new_tokens={self.max_new_tokens}'
            )
        sampling, stop, *rest = self.values
        return self.with_values((sampling, stop.replace(max_new=np.int32(n)), *rest))

    def with_task(self, tables) -> ShardedSampler:
        """This sampler's values with a task.TaskTables (stops, grammar) bound after the
        sampling values and Stop, placed replicated once; None: the values without a task (the
        same object for the same sampler; a sampler taking only a task gets (None,))."""
        if tables is None:
            return _untasked(self)
        placed = place_replicated(tables, replicated(self.mesh))
        return self.with_values((*(self.values or ())[:2], placed))

    @property
    def _jitted(self):
        return self._program['jitted']

    @property
    def _shardings(self):
        return self._program['shardings']

    def __call__(self, *args) -> SampleOutput:
        """args: (*params, prompts, prompt_lengths, rng)."""
        args = self.place(args)  # builds the jit on first use
        return self.checked(self._jitted(*args))

    def checked(self, out: SampleOutput) -> SampleOutput:
        """`out` after raising NonFiniteLogitsError where its flags are set (waits for it)."""
        return guards.raise_if_nonfinite(out, self.name)

    def host_rows(self, global_rows):
        """This process's rows of a host-global [B, ...] array (prompts or lengths that every
        process holds in full), as this sampler's batch sharding places them."""
        return host_rows(batch_sharding(self.mesh, self.rules), global_rows)

    def lower(self, *args):
        """The jit's Lowered for these arguments (ahead-of-time compile: `.compile()`)."""
        args = self.place(args)
        return self._jitted.lower(*args)

    def param_shardings(self, params) -> list:
        """Per params argument, its NamedSharding tree (checks heads and divisibility first)."""
        models = self.models or [
            (f'params[{i}]', None, self.rules, 'rules') for i in range(len(params))
        ]
        out = []
        for p, (who, graphdef, rules, field) in zip(params, models, strict=True):
            if graphdef is not None:
                check_model_on_mesh(config_of(graphdef), self.mesh, rules, who, field)
            shardings = param_shardings(self.mesh, p, rules)
            check_divisible(p, shardings)
            out.append(shardings)
        return out

    def lower_abstract(self, *args):
        """Lowered for abstract arguments (ShapeDtypeStructs; the memory planner): checks, builds
        the jit, places nothing. Prompts here are the global batch."""
        *params, prompts, _, _ = args
        self.check(prompts.shape[1])
        check_batch(prompts.shape[0], self.mesh, self.rules)
        self._build(params)
        return self._jitted.lower(*args, *self._values())

    def _values(self) -> tuple:
        if not self.takes_values:
            return ()
        if self.values is None:
            raise ValueError('this sampler takes values: call it through with_values(...)')
        return (self.values,)

    def _build(self, params):
        """Builds the jit with explicit in_shardings on first use; returns the batch sharding."""
        batch_spec = batch_sharding(self.mesh, self.rules)
        if self._jitted is None:
            rep = replicated(self.mesh)
            shardings = (*self.param_shardings(params), batch_spec, batch_spec, rep)
            shardings += (rep,) * self.takes_values
            pinned = functools.partial(_pinned_output, self.core, batch_spec, rep)
            self._program.update(
                shardings=shardings,
                jitted=jax.jit(
                    pinned, in_shardings=shardings, compiler_options=DECODE_COMPILER_OPTIONS
                ),
            )
        return batch_spec

    def place(self, args):
        """Checks (*params, prompts, lengths, rng), builds the jit on first use, places them (and
        the bound values)."""
        *params, prompts, prompt_lengths, rng = args
        local_batch, width = check_prompts(prompts, prompt_lengths)
        if self.models:
            who, graphdef = self.models[0][:2]
            vocab = config_of(graphdef).vocab_size
            guards.check_prompt_ids(prompts, prompt_lengths, vocab, f'{self.name} {who}')
        self.check(width)
        check_batch(local_batch * jax.process_count(), self.mesh, self.rules)
        task.check_rows(self.values, local_batch * jax.process_count(), self.name)
        batch_spec = self._build(params)
        placed = jax.device_put(params, list(self._shardings[: len(params)]))
        rows = [
            jax.make_array_from_process_local_data(batch_spec, np.asarray(x, np.int32))
            for x in (prompts, prompt_lengths)
        ]
        rep = self._shardings[len(params) + 2]
        values = [place_replicated(v, rep) for v in self._values()]
        return (*placed, *rows, place_key(as_key(rng), rep), *values)


@functools.lru_cache(maxsize=256)
def _with_sampling(program: ShardedSampler, sampling: SamplingConfig, dynamic: bool, eos_id):
    stop = stop_values(program.max_new_tokens, eos_id)
    return program.with_values((sampling.traced(dynamic), stop))


@functools.lru_cache(maxsize=256)
def _untasked(program: ShardedSampler) -> ShardedSampler:
    if program.values is None:
        return program.with_values((None,))
    return program if len(program.values) <= 2 else program.with_values(program.values[:2])


def place_replicated(tree, sharding):
    """A pytree of host values (the same on every process) placed on a replicated sharding."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    place = lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x))
    return jax.tree.map(place, tree)


def place_key(key, sharding):
    """A PRNG key (typed or raw) placed on `sharding`, also where it spans several processes
    (device_put refuses typed keys there: their raw data goes instead, then is re-wrapped)."""
    if jax.process_count() == 1:
        return jax.device_put(key, sharding)
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(key) if typed else key)
    placed = jax.make_array_from_process_local_data(sharding, data)
    return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(key)) if typed else placed


def _pinned_output(core, batch_spec, rep, *args) -> SampleOutput:
    """core's output with explicit layouts: tokens, lengths and `row_*` stats over the batch
    axes, totals replicated (a constraint per output: the stats' names are known only here)."""
    out = core(*args)
    pin = jax.lax.with_sharding_constraint
    stats = {k: pin(v, batch_spec if k.startswith('row_') else rep) for k, v in out.stats.items()}
    rows = lambda x: None if x is None else pin(x, batch_spec)
    return SampleOutput(
        rows(out.tokens), rows(out.lengths), stats, rows(out.finish_reason),
        rows(out.target_logprobs),
    )  # fmt: skip


def shard_caches(mesh, caches_and_rules):
    """Each (cache, rules) pinned to its layout inside jit (see parallel.constrain_cache); a
    drafter state that is not a KVCache (an n-gram draft's context) is left as it is."""
    pin = lambda c, r: constrain_cache(c, mesh, r) if isinstance(c, KVCache) else c
    return tuple(pin(c, r) for c, r in caches_and_rules)


def draft_catch_up(dgd, dparams, cache, last_B, prev_B, pending_B, active_B, to_draft=None):
    """Feeds the draft the 1-2 tokens it has not consumed -> (logits [B, V] after them, cache).

    pending 2: prev then last; 1: last only. When no active row has 2 pending (always, after a
    round that rejected something, at batch 1) a 1-token call replaces the 2-token one: a
    2-token call costs more than one step on small-M matmuls.
    """
    to_draft = to_draft or (lambda t: t)
    act = active_B.astype(jnp.int32)

    def two_tokens(cache):
        two = pending_B == 2
        tokens = jnp.stack([jnp.where(two, prev_B, last_B), jnp.where(two, last_B, 0)], axis=1)
        logits, cache = apply_cached(dgd, dparams, to_draft(tokens), pending_B * act, cache)
        return jnp.take_along_axis(logits, (pending_B - 1)[:, None, None], axis=1)[:, 0], cache

    def one_token(cache):
        logits, cache = apply_cached(dgd, dparams, to_draft(last_B[:, None]), act, cache)
        return logits[:, 0], cache

    return jax.lax.cond(jnp.any((pending_B == 2) & active_B), two_tokens, one_token, cache)
