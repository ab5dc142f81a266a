"""Training sequences for distillation (DistillSpec): fixed data or model-generated continuations,
and load_data, what the distill and cotrain modes read from the data layer.

Every source yields the same batch layout for the jitted step, all [B, T] int32 unless noted:
tokens, positions, segment_ids, and bool [B, T-1] masks aligned with the logits that predict
tokens[:, 1:]: `loss_mask` (positions the divergence is averaged over) and `ce_mask` (positions
whose target is a data token, for the optional cross-entropy term); domain_ids [B] per row.

  dataset    packed data rows; both masks are the next-token targets (no padding, no document
             boundary).
  teacher    the teacher continues each row's prompt (the first `prompt_len` tokens of the row's
             first document) for `max_new_tokens` at config.sampling; loss_mask covers the
             generated tokens only (not the prompt, not padding, nothing after eos; eos itself
             is a target); ce_mask covers the prompt's data targets.
  on_policy  the same with the draft generating (DistillSpec's student-generated data).
  mixture    per step, on-policy with probability mixture_lambda, else `mixture_base`; the choice
             is a pure function of (config.seed, step), so a resumed run makes the same choices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import PAD_ID, SamplingConfig, make_autoregressive_fn
from specjax.train import runs
from specjax.train.runs import RunData

_MIXTURE_TAG = 0x6D6978  # separates the mixture coin stream from other per-step randomness
_GENERATION_TAG = 0x67656E


def data_masks(segment_ids_BT):
    """Next-token target mask [B, T-1] (works on numpy and jax arrays alike)."""
    prev, nxt = segment_ids_BT[:, :-1], segment_ids_BT[:, 1:]
    return (nxt == prev) & (prev != 0)


def dataset_batch(batch: dict) -> dict:
    """Host batch (numpy) -> the step's layout for the dataset source."""
    mask = data_masks(np.asarray(batch['segment_ids']))
    return {
        'tokens': np.asarray(batch['tokens'], np.int32),
        'positions': np.asarray(batch['positions'], np.int32),
        'segment_ids': np.asarray(batch['segment_ids'], np.int32),
        'loss_mask': mask,
        'ce_mask': mask,
        'domain_ids': np.asarray(batch['domain_ids'], np.int32)[:, 0],
    }


def prompts_from_batch(batch: dict, prompt_len: int):
    """Host batch -> (prompts int32 [B, P] right-padded, lengths int32 [B] in [1, P], domain [B]).

    A row's prompt is the start of its first packed document, at most prompt_len tokens.
    """
    tokens = np.asarray(batch['tokens'], np.int32)[:, :prompt_len]
    seg = np.asarray(batch['segment_ids'])
    width = tokens.shape[1]
    first_doc = (seg[:, :width] == seg[:, :1]) & (seg[:, :width] != 0)
    lengths = np.clip(np.cumprod(first_doc, axis=1).sum(axis=1), 1, width).astype(np.int32)
    prompts = np.where(np.arange(width)[None, :] < lengths[:, None], tokens, PAD_ID)
    domains = np.asarray(batch['domain_ids'], np.int32)[:, 0]
    return prompts.astype(np.int32), lengths, domains


def assemble(prompts_BP, prompt_lengths_B, generated_BN, generated_lengths_B):
    """Prompt + continuation per row -> the step's layout, [B, P + N] (jax or numpy in, jax out).

    Row b holds its P_b prompt tokens, then its L_b generated tokens (eos included), then
    padding (segment 0). loss_mask[t] (predicting token t+1) is true iff P_b <= t+1 < P_b + L_b.
    """
    width, new = prompts_BP.shape[1], generated_BN.shape[1]
    total = width + new
    j = jnp.arange(total, dtype=jnp.int32)[None, :]
    p = jnp.asarray(prompt_lengths_B, jnp.int32)[:, None]
    end = p + jnp.asarray(generated_lengths_B, jnp.int32)[:, None]
    prompt_part = jnp.take_along_axis(jnp.asarray(prompts_BP), jnp.minimum(j, width - 1), axis=1)
    gen_part = jnp.take_along_axis(jnp.asarray(generated_BN), jnp.clip(j - p, 0, new - 1), axis=1)
    tokens = jnp.where(j < p, prompt_part, jnp.where(j < end, gen_part, PAD_ID))
    segment_ids = (j < end).astype(jnp.int32)
    target = j[:, 1:]
    return {
        'tokens': tokens.astype(jnp.int32),
        'positions': jnp.broadcast_to(j, tokens.shape),
        'segment_ids': segment_ids,
        'loss_mask': (target >= p) & (target < end),
        'ce_mask': (target < p),
    }


def source_for_step(
    source: str, step: int, *, seed: int, mixture_lambda: float, mixture_base: str
) -> str:
    """'dataset' | 'teacher' | 'on_policy' for 0-based `step`; a mixture flips a seeded coin."""
    if source != 'mixture':
        return source
    coin = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(step), _MIXTURE_TAG]).random()
    return 'on_policy' if coin < mixture_lambda else mixture_base


def generation_key(seed: int, step: int):
    """The PRNG key generation uses at `step` (resume-safe: depends on nothing else)."""
    return jax.random.fold_in(jax.random.key(int(seed) ^ _GENERATION_TAG), int(step))


@dataclasses.dataclass
class Generator:
    """Continues data prompts with a model via the jitted autoregressive sampler, then assembles.

    __call__(params, host_batch, key) -> device batch in the step's layout (domain_ids on host).
    """

    graphdef: object
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingConfig
    eos_id: int | None
    mesh: object
    rules: tuple
    batch_sharding: object

    def __post_init__(self):
        self._sample = make_autoregressive_fn(
            self.graphdef,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            eos_id=self.eos_id,
            mesh=self.mesh,
            rules=self.rules,
        )
        self._assemble = jax.jit(assemble, out_shardings=self.batch_sharding)

    def prompts(self, host_batch):
        return prompts_from_batch(host_batch, self.prompt_len)

    def generate(self, params, prompts, lengths, key):
        """SampleOutput of the sampler for host prompts [B, P] and lengths [B]."""
        return self._sample(params, prompts, lengths, key)

    def __call__(self, params, host_batch, key) -> dict:
        prompts, lengths, domains = self.prompts(host_batch)
        out = self.generate(params, prompts, lengths, key)
        # Host-local rows -> global arrays (each process holds its own rows of the batch).
        rows = lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x)
        batch = self._assemble(rows(prompts), rows(lengths), out.tokens, out.lengths)
        batch['domain_ids'] = domains
        return batch


DistillData = RunData  # the name distill / cotrain callers and tests use


def load_data(config) -> RunData:
    """The real pipeline (specjax.data) for config.data (eval batches: config.train)."""
    return runs.load_data(config, num_eval_batches=config.train.eval_batches)
