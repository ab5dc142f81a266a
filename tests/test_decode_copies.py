"""The compiled decode loops update the KV cache in place: no copy of a cache layer inside a loop.

Attention reads the cache as it is and the model writes the new entries after (the chain sampler's
width switch returns entries and writes once after it), compiled with the samplers' compiler
options (specjax.models.kv_cache.DECODE_COMPILER_OPTIONS). Before, XLA:CPU copied every layer's
keys and values on every step of a loop, twice more in each width branch (docs/performance.md).
The only cache-shaped copies left are the initial zero caches, in the program's entry.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Transformer, TransformerConfig, apply_cached, init_cache, split
from specjax.models.kv_cache import write_entries
from specjax.sampling import (
    NGramDraft,
    SamplingConfig,
    make_autoregressive_fn,
    make_speculative_fn,
)

CFG = TransformerConfig(vocab_size=512, d_model=192, n_layers=3, n_heads=3, n_kv_heads=3,
                        d_ff=256, max_len=512, head_dim=64)  # fmt: skip
COPY = re.compile(r'= \w+\[([\d,]*)\](?:\{[^}]*\})? copy\(')


def _cache_copies_by_computation(hlo: str, capacity: int) -> dict:
    """{computation name: count} of copies shaped like one cache layer ([1, 3, C, 64] or its
    transpose) in compiled HLO text."""
    layer = sorted((1, CFG.n_kv_heads, capacity, CFG.head_dim))
    counts, computation = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(' ') and line.rstrip().endswith('{'):
            computation = line.split(' ')[1] if line.startswith('ENTRY') else line.split(' ')[0]
        m = COPY.search(line)
        if m and sorted(int(x) for x in m.group(1).split(',') if x) == layer:
            counts[computation] = counts.get(computation, 0) + 1
    return counts


@pytest.mark.parametrize('method', ['autoregressive', 'chain'])
def test_decode_loops_copy_no_cache_layer(method):
    graphdef, params = split(Transformer(CFG, rngs=nnx.Rngs(0)))
    greedy = SamplingConfig(0.0)
    if method == 'autoregressive':
        fn, args = make_autoregressive_fn(graphdef, max_new_tokens=32, sampling=greedy), [params]
        capacity = 16 + 32 + 1
    else:  # k = 4: widths 1, 2, 3, 5 in a lax.switch
        draft = NGramDraft(3, 1)
        fn = make_speculative_fn(graphdef, draft, num_draft_tokens=4, max_new_tokens=32,
                                 sampling=greedy)  # fmt: skip
        args, capacity = [params, ()], 16 + 32 + 4 + 1
    prompts, lengths = np.ones((1, 16), np.int32), np.array([16], np.int32)
    hlo = fn.lower(*args, prompts, lengths, jax.random.key(0)).compile().as_text()
    copies = _cache_copies_by_computation(hlo, capacity)
    assert all(c.startswith('%main') for c in copies), copies  # none in a loop body
    assert sum(copies.values()) <= 2 * CFG.n_layers, copies  # the zero caches, once


def test_entries_written_after_the_call_equal_the_written_call(highest_precision):
    """decode(write=False) + write_entries is decode(write=True): same logits, same cache."""
    graphdef, params = split(Transformer(CFG, rngs=nnx.Rngs(1)))
    tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, CFG.vocab_size)
    num_valid = jnp.array([5, 3], jnp.int32)
    cache = init_cache(CFG, 2, 32, lengths=jnp.array([4, 9], jnp.int32))
    cache = jax.tree.map(lambda a: a + 0.1 if a.dtype == jnp.float32 else a, cache)
    logits, written = apply_cached(graphdef, params, tokens, num_valid, cache)
    logits_e, entries = apply_cached(graphdef, params, tokens, num_valid, cache, write=False)
    assert entries.capacity == 5 and np.array_equal(entries.lengths, cache.lengths)
    np.testing.assert_array_equal(logits, logits_e)
    later = write_entries(cache, entries, num_valid)
    for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(later), strict=True):
        np.testing.assert_array_equal(a, b)
