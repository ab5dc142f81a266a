"""Greedy decoding with a reduced-vocabulary draft (vocab N, draft_vocab_ids), checked against an
independent simulation: the draft's own teacher-forced argmax, mapped to target ids by a numpy
table, replayed through the greedy round rule.

Why: the SmolLM2 quickstart once showed the CE and the distilled draft with identical T = 0
acceptance (7 of 128 positions each). That was a coincidence of two weak drafts on 4 prompts
(6 of their 7 matches at the same positions), not a mapping bug; these tests pin the mapping
down so that a real bug (proposals not mapped through the ids, inputs not remapped, a draft
that always proposes one token) cannot hide behind such figures again. Negative controls show
the simulation rejects each of those bugs.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from sampling_models import perturbed, ragged_prompts

from specjax.models import Transformer, TransformerConfig, apply, split
from specjax.sampling import SamplingConfig, autoregressive_sample, rescore, speculative_sample

V, MAX_NEW, KS = 32, 12, (1, 3)
IDS = np.random.default_rng(0).permutation(V)[:20].astype(np.int32)  # N = 20, not sorted
PROMPTS = [[int(i) for i in IDS[[0, 3, 5, 7, 1]]], [int(i) for i in IDS[[2, 4, 6]]]]
GREEDY = SamplingConfig(0.0)
BUGS = {  # draft index -> target id, wrongly: what the mapping tests must tell apart
    'proposals not mapped through the ids': lambda x: x,
    'always the most frequent token': lambda x: np.full_like(x, IDS[0]),
}


def _config(vocab):
    return TransformerConfig(
        vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_len=48,
        tie_embeddings=False,  # tied random models echo their last token: greedy is degenerate
    )  # fmt: skip


@pytest.fixture(scope='module')
def models():
    """The target, its exact restriction to IDS (vocab N: embedding rows and head columns IDS,
    same blocks) and a perturbed copy of that restriction: two different reduced drafts."""
    target = Transformer(_config(V), rngs=nnx.Rngs(0))
    restricted = Transformer(_config(len(IDS)), rngs=nnx.Rngs(1))
    restricted.embed[...] = target.embed[...][IDS]
    restricted.lm_head[...] = target.lm_head[...][:, IDS]
    nnx.update(restricted.blocks, nnx.state(target.blocks))
    nnx.update(restricted.final_norm, nnx.state(target.final_norm))
    return target, {'restricted': restricted, 'perturbed': perturbed(restricted, 3, 0.3)}


def _table():
    """target id -> draft index (off the set: 0), built here independently of DraftVocab."""
    table = np.zeros((V,), np.int32)
    for i, t in enumerate(IDS):
        table[t] = i
    return table


def _greedy_predictions(draft, prompts, lengths, gen, to_target):
    """[B, M] the draft's greedy token (target id) for gen[:, t], teacher-forced on gen[:, :t]."""
    b, m = gen.shape
    seq = np.zeros((b, prompts.shape[1] + m), np.int32)
    for r in range(b):
        seq[r, : lengths[r]] = prompts[r, : lengths[r]]
        seq[r, lengths[r] : lengths[r] + m] = gen[r]
    logits = np.asarray(apply(*split(draft), _table()[seq]))
    idx = lengths[:, None] - 1 + np.arange(m)[None, :]
    return to_target(np.take_along_axis(logits.argmax(-1), idx, axis=1))


def _simulate(gen, pred, k, max_new):
    """Greedy rounds over the target's tokens: accept while pred == gen, then emit the target's
    token; (accepted, examined) [B, k] per position, counted inside the output as the sampler
    counts them."""
    accepted = np.zeros((len(gen), k), np.int64)
    examined = np.zeros((len(gen), k), np.int64)
    for r in range(len(gen)):
        t = 0
        while t < max_new:
            n = 0
            while n < k and pred[r, t + n] == gen[r, t + n]:
                n += 1
            count = min(n + 1, max_new - t)
            for i in range(min(count, k)):
                examined[r, i] += i < min(n + 1, k)
                accepted[r, i] += i < n
            t += n + 1
    return accepted, examined


@pytest.fixture(scope='module')
def runs(models):
    target, drafts = models
    prompts, lengths = ragged_prompts(PROMPTS, 4)
    # The target's greedy tokens, k past max_new: proposals beyond the output are still scored.
    ar = autoregressive_sample(
        target, prompts, lengths, max_new_tokens=MAX_NEW + max(KS), sampling=GREEDY, rng=0
    )
    gen = np.asarray(ar.tokens)
    out = {}
    for name, draft in drafts.items():
        for k in KS:
            out[name, k] = speculative_sample(
                target, draft, prompts, lengths, num_draft_tokens=k, max_new_tokens=MAX_NEW,
                sampling=GREEDY, rng=0, draft_vocab_ids=IDS,
            )  # fmt: skip
    return prompts, lengths, gen, out


def test_greedy_reduced_draft_proposes_its_own_argmax_mapped_to_target_ids(models, runs):
    target, drafts = models
    prompts, lengths, gen, out = runs
    totals = {}
    for name, draft in drafts.items():
        pred = _greedy_predictions(draft, prompts, lengths, gen, lambda x: IDS[x])
        for k in KS:
            o = out[name, k]
            np.testing.assert_array_equal(np.asarray(o.tokens), gen[:, :MAX_NEW])
            acc, exa = _simulate(gen, pred, k, MAX_NEW)
            np.testing.assert_array_equal(np.asarray(o.stats['row_accepted_per_position']), acc)
            np.testing.assert_array_equal(np.asarray(o.stats['row_examined_per_position']), exa)
            totals[name, k] = int(acc.sum())
            if name == 'restricted':  # negative controls: bugs that would not match
                for bug in BUGS.values():
                    wrong = _greedy_predictions(draft, prompts, lengths, gen, bug)
                    assert not np.array_equal(_simulate(gen, wrong, k, MAX_NEW)[0], acc)
    # Two different drafts, different greedy acceptance; the exact restriction accepts more.
    per_draft = {d: sum(totals[d, k] for k in KS) for d in drafts}
    assert per_draft['restricted'] > per_draft['perturbed'] > 0, totals


def test_greedy_alpha_of_sequences_is_argmax_agreement_through_the_ids(models, runs):
    """spec_eval's alpha at T = 0 (stats.alpha_of_sequences with draft_vocab_ids) is the
    fraction of generated positions where the draft's mapped argmax is the target's token."""
    target, drafts = models
    prompts, lengths, gen, _ = runs
    n = np.full((len(gen),), MAX_NEW, np.int32)
    for draft in drafts.values():
        pred = _greedy_predictions(draft, prompts, lengths, gen, lambda x: IDS[x])[:, :MAX_NEW]
        alpha, mask = rescore.alpha_of_sequences(
            target, draft, prompts, lengths, gen[:, :MAX_NEW], n, GREEDY, IDS
        )
        assert mask.all()
        np.testing.assert_array_equal(alpha, (pred == gen[:, :MAX_NEW]).astype(np.float32))


def test_serving_a_reduced_draft_alone_gives_its_argmax_in_target_ids(models):
    """The serve stage's draft-alone path (serving.alone_inputs / alone_tokens around the
    autoregressive sampler): target-id prompts in, target-id tokens out, each the draft's own
    greedy argmax mapped through draft_vocab_ids."""
    from specjax.evaluation import serving
    from specjax.sampling import make_autoregressive_fn

    _, drafts = models
    prompts, lengths = ragged_prompts(PROMPTS, 4)
    for draft in drafts.values():
        graphdef, params = split(draft)
        fn = make_autoregressive_fn(graphdef, max_new_tokens=MAX_NEW, sampling=GREEDY)
        raw = jax.device_get(fn(params, serving.alone_inputs(IDS, V, prompts), lengths, 0))
        tokens = serving.alone_tokens(IDS, raw.tokens)
        assert np.isin(tokens, IDS).all()
        pred = _greedy_predictions(draft, prompts, lengths, tokens, lambda x: IDS[x])
        np.testing.assert_array_equal(tokens, pred)
        # A full-vocabulary model passes through unchanged.
        np.testing.assert_array_equal(serving.alone_inputs(None, V, prompts), prompts)
        np.testing.assert_array_equal(serving.alone_tokens(None, raw.tokens), raw.tokens)
