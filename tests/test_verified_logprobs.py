"""The chain sampler's `target_logprobs`: the target's law at every emitted position.

speculative_sample(..., target_logprobs=True) returns, per row and emitted token, the target's
log-softmax given the prompt and the tokens before it (specjax.sampling.verified): checked
against one uncached forward of the target over prompt + output, with fixed-width chains, with
rows that propose fewer than k (stop_below: the narrower verification widths) and greedy; the
tokens equal those of the same call without it. The online mode's draft-only scoring of served
rows (rescore_program(..., served=True), served_entries) gives the alpha and log-probs of the
target's forward.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampling_models import make_model, ragged_prompts, tiny_config

from specjax.distill.online_update import rescore_program, served_entries
from specjax.distill.sources import assemble
from specjax.models import apply, split
from specjax.parallel import make_mesh
from specjax.parallel.mesh import default_mesh_config
from specjax.sampling import SamplingConfig, make_speculative_fn

V, NEW, ROWS = 11, 9, 12
TARGET = make_model(tiny_config(V), seed=0, scale=3.0)
DRAFT = make_model(tiny_config(V), seed=1, scale=3.0)
PROMPTS = ([1, 3], [4, 0, 2, 2, 7], [5])


def _sample(sampling, k, logprobs, **kw):
    fn = make_speculative_fn(
        split(TARGET)[0], split(DRAFT)[0], num_draft_tokens=k, max_new_tokens=NEW,
        sampling=sampling, target_logprobs=logprobs, **kw,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, ROWS)
    return prompts, lengths, fn(split(TARGET)[1], split(DRAFT)[1], prompts, lengths, 3)


@pytest.mark.parametrize(
    'sampling, k, kw',
    [(SamplingConfig(1.0), 3, {}), (SamplingConfig(1.0), 4, {'stop_below': 0.4}),
     (SamplingConfig(0.0), 2, {'eos_id': 8})],
    ids=['chain', 'variable_widths', 'greedy_eos'],
)  # fmt: skip
def test_logprobs_are_the_targets_at_every_emitted_position(sampling, k, kw):
    prompts, lengths, out = _sample(sampling, k, True, **kw)
    plain = _sample(sampling, k, False, **kw)[2]
    np.testing.assert_array_equal(out.tokens, plain.tokens)  # the flag changes no token
    assert plain.target_logprobs is None and out.target_logprobs.shape == (ROWS, NEW, V)
    batch = assemble(prompts, lengths, out.tokens, out.lengths)
    args = (batch['tokens'], batch['positions'], batch['segment_ids'])
    want = jax.nn.log_softmax(apply(*split(TARGET), *args), axis=-1)  # [B, P + N, V]
    got, n = np.asarray(out.target_logprobs), np.asarray(out.lengths)
    assert n.min() >= 1 and (kw.get('eos_id') is None or n.min() < NEW)  # eos ends some rows
    for b in range(ROWS):
        p = int(lengths[b])
        np.testing.assert_allclose(got[b, : n[b]], want[b, p - 1 : p - 1 + n[b]], atol=2e-5)


def test_draft_only_scoring_of_served_rows_equals_the_targets_forward():
    """The online mode's learning path: alpha and the target's log-probs at the served
    positions from the sampler's log-probs equal those of the target's own forward."""
    prompts, lengths, out = _sample(SamplingConfig(1.0), 3, True)
    (tgd, tparams), (dgd, dparams) = split(TARGET), split(DRAFT)
    mesh = make_mesh(default_mesh_config())
    args = (tparams, dparams, prompts, lengths, out.tokens, out.lengths)
    ref = jax.device_get(rescore_program(tgd, dgd, SamplingConfig(1.0), mesh, True)(*args))
    served = rescore_program(tgd, dgd, SamplingConfig(1.0), mesh, True, served=True)
    got = jax.device_get(served(*args, out.target_logprobs))
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
    mask = ref[1]
    assert mask.sum() == int(np.sum(out.lengths))
    np.testing.assert_allclose(got[2][mask], ref[2][mask], atol=2e-5)
    assert got[3] is None and (got[2][~mask] == 0).all()
    rows, cols = np.nonzero(mask)
    entries = served_entries(out.target_logprobs, lengths, rows, cols)
    np.testing.assert_allclose(entries, ref[3][rows, cols], atol=2e-5)
