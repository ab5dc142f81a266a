"""Stop conditions: the device automaton against a plain-Python reference on decoded bytes
(strings spanning two and three tokens, any tokenisation, overlapping prefixes, rounds split
anywhere), then the three samplers ending rows at stops (per-row stops finishing at different
rounds, a stop inside an accepted speculative run, min_new_tokens, eos_id), and bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_models import make_model, perturbed, tiny_config
from task_fixtures import TEXT, PieceTokenizer, first_stop

from specjax.models import split
from specjax.sampling import (
    FinishReason,
    SamplingConfig,
    Stops,
    make_autoregressive_fn,
    make_speculative_fn,
    make_tree_speculative_fn,
)
from specjax.sampling import task as task_lib
from specjax.sampling.constrain import Constraint

# Pieces that tokenise 'abc' five ways ('abc', 'ab'+'c', 'a'+'bc', 'a'+'b'+'c', inside 'xabc').
PIECES = ['', '', 'a', 'b', 'c', 'ab', 'bc', 'abc', 'ca', 'x', 'xab', 'cab', 'cc']
TOY = PieceTokenizer(PIECES)
ROW_STOPS = [  # overlapping prefixes ('ab' then 'abc'), strings of 2 and 3 bytes, stop ids
    dict(strings=('abc', 'bca')),
    dict(strings=('ab', 'abc'), min_new_tokens=2),
    dict(strings=('cc',), token_ids=(9,), min_new_tokens=1),
    dict(token_ids=(8, 12)),
]


@functools.partial(jax.jit, static_argnums=(3,))
def _cut(tables, blocks_BT, state, width):
    """Cuts blocks of `width` tokens one after another, carrying the task state, as rounds do."""
    batch = blocks_BT.shape[0]
    con = Constraint(tables, batch, TOY.vocab_size, jnp.int32(-1))
    state = con.initial() if state is None else state
    emitted = jnp.zeros((batch,), jnp.int32)
    done = jnp.zeros((batch,), bool)
    for start in range(0, blocks_BT.shape[1], width):
        block = blocks_BT[:, start : start + width]
        count = jnp.where(done, 0, block.shape[1])
        g_after = state.grammar[:, None] + 0 * block
        count, reason, new = con.cut(state, block, count, emitted, g_after)
        state = con.keep(~done, new, state)
        emitted = emitted + count
        done = done | (reason != 0)
    return emitted, state.finish


@pytest.mark.parametrize('width', [1, 3, 14])
def test_device_cut_matches_python_reference_on_decoded_bytes(width):
    rng = np.random.default_rng(width)
    tokens = rng.integers(2, TOY.vocab_size, (400, 14)).astype(np.int32)
    rows = [Stops(TOY, **kw) for kw in ROW_STOPS]
    per_row = [rows[i % len(rows)] for i in range(len(tokens))]
    tables = task_lib.build(None, per_row, TOY.vocab_size, 'test')
    lengths, finish = (np.asarray(a) for a in _cut(tables, jnp.asarray(tokens), None, width))
    reasons = {'token': FinishReason.STOP_TOKEN, 'string': FinishReason.STOP_STRING, None: 0}
    hits = 0
    for i, row in enumerate(tokens):
        kw = ROW_STOPS[i % len(rows)]
        n, why = first_stop(TOY.pieces, row, kw.get('strings', ()), kw.get('token_ids', ()),
                            kw.get('min_new_tokens', 0))  # fmt: skip
        assert (lengths[i], finish[i]) == (n, reasons[why]), (i, row, kw)
        hits += why is not None
    assert hits > 300  # most rows stop, at many different places
    assert len(set(lengths.tolist())) > 8


def test_every_tokenisation_of_a_string_completes_it():
    stops = Stops(TOY, strings=('abc',))
    tables = task_lib.build(None, stops, TOY.vocab_size, 'test')
    ways = [['abc'], ['ab', 'c'], ['a', 'bc'], ['a', 'b', 'c'], ['xab', 'c'], ['x', 'ab', 'c']]
    rows = [[PIECES.index(p) for p in w] + [PIECES.index('x')] * (5 - len(w)) for w in ways]
    lengths, finish = _cut(tables, jnp.asarray(rows, jnp.int32), None, 5)
    np.testing.assert_array_equal(lengths, [len(w) for w in ways])
    assert (np.asarray(finish) == FinishReason.STOP_STRING).all()


# --- the samplers -----------------------------------------------------------------------------

CONFIG = tiny_config(TEXT.vocab_size, max_len=64)
TARGET = make_model(CONFIG, seed=0, scale=4.0)
DRAFT = perturbed(TARGET, seed=1, noise=0.3)
PROMPTS = np.array([[10, 20, 30, 40], [50, 60, 0, 0], [70, 0, 0, 0], [80, 90, 100, 0]], np.int32)
LENGTHS = np.array([4, 2, 1, 3], np.int32)
MAX_NEW, K = 24, 4
TREE = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))


def _run(kind, sampling, draft=DRAFT, **task):
    tgd, tp = split(TARGET)
    dgd, dp = split(draft)
    if kind == 'autoregressive':
        fn = make_autoregressive_fn(tgd, max_new_tokens=MAX_NEW, sampling=sampling, **task)
        return fn(tp, PROMPTS, LENGTHS, 0)
    if kind == 'chain':
        fn = make_speculative_fn(tgd, dgd, num_draft_tokens=K, max_new_tokens=MAX_NEW,
                                 sampling=sampling, **task)  # fmt: skip
    else:
        fn = make_tree_speculative_fn(tgd, dgd, tree=TREE, max_new_tokens=MAX_NEW,
                                      sampling=sampling, **task)  # fmt: skip
    return fn(tp, dp, PROMPTS, LENGTHS, 0)


@functools.cache
def _free_greedy():
    out = _run('autoregressive', SamplingConfig(0.0))
    assert (np.asarray(out.finish_reason) == FinishReason.LENGTH).all()
    return np.asarray(out.tokens)


def _row_stops():
    """Per row a 2- or 3-byte string (valid UTF-8) first seen in its own greedy text at a
    different place, so rows stop at different token counts (speculative rows at different
    rounds)."""
    free = _free_greedy()
    out = []
    for r, row in enumerate(free):
        size = 2 + r % 2
        for start in range(2 + 5 * r, MAX_NEW - size):
            string = TEXT.decode(row[start : start + size])[-size:]
            if first_stop(TEXT.pieces, row, (string,))[0] == start + size:
                out.append(Stops(TEXT, strings=(string,)))
                break
        else:
            raise AssertionError(f'row {r}: no usable stop string in its greedy text')
    return out


def _check_reference(out, stops):
    """Each row ends exactly where the Python reference finds its first stop in its own text,
    and says why."""
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    finish = np.asarray(out.finish_reason)
    reasons = {'token': FinishReason.STOP_TOKEN, 'string': FinishReason.STOP_STRING, None: 0}
    for r, s in enumerate(stops):
        n, why = first_stop(s.pieces, tokens[r], s.strings, s.token_ids, s.min_new_tokens)
        assert (n, reasons[why]) == (lengths[r], finish[r]), (r, TEXT.decode(tokens[r]), s)


@pytest.mark.parametrize('kind', ['autoregressive', 'chain', 'tree'])
def test_per_row_stop_strings_end_rows_where_the_reference_says(kind):
    stops = _row_stops()
    out = _run(kind, SamplingConfig(0.0), stops=stops)
    _check_reference(out, stops)
    assert (np.asarray(out.finish_reason) == FinishReason.STOP_STRING).all()
    free = _free_greedy()
    for r, n in enumerate(np.asarray(out.lengths)):  # greedy: the unconstrained text, cut
        np.testing.assert_array_equal(np.asarray(out.tokens)[r, :n], free[r, :n])
    assert len(set(np.asarray(out.lengths).tolist())) == len(stops)
    if kind != 'autoregressive':
        assert len(set(np.asarray(out.stats['row_rounds']).tolist())) > 1


def test_a_stop_inside_an_accepted_run_truncates_the_row():
    """A perfect draft: every proposal is accepted, rounds emit k + 1 tokens, and the rows end
    mid-run at their stop."""
    stops = _row_stops()
    out = _run('chain', SamplingConfig(0.0), draft=TARGET, stops=stops)
    _check_reference(out, stops)
    s = {k: np.asarray(v) for k, v in out.stats.items()}
    assert (s['row_accepted'] == s['row_examined']).all()
    lengths = np.asarray(out.lengths)
    assert (lengths % (K + 1) != 0).any()
    np.testing.assert_array_equal(s['row_rounds'], -(-lengths // (K + 1)))


@pytest.mark.parametrize('kind', ['chain', 'tree'])
def test_sampled_rows_end_at_their_first_stop(kind):
    stops = Stops(TEXT, strings=('a', 'e', 'i', 'o'), token_ids=(TEXT.encode('u')[0],))
    out = _run(kind, SamplingConfig(1.0), stops=[stops] * len(PROMPTS))
    _check_reference(out, [stops] * len(PROMPTS))


@pytest.mark.parametrize('kind', ['autoregressive', 'chain', 'tree'])
def test_min_new_tokens_masks_stop_tokens_and_greedy_agrees(kind):
    free = _free_greedy()
    stop_ids = tuple(sorted({int(free[r, 1]) for r in range(len(free))}))
    stops = Stops(TEXT, token_ids=stop_ids, min_new_tokens=3)
    reference = _run('autoregressive', SamplingConfig(0.0), stops=stops)
    out = _run(kind, SamplingConfig(0.0), stops=stops)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.finish_reason, reference.finish_reason)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert (lengths > 3).all()
    assert not np.isin(tokens[:, :3], stop_ids).any()  # masked before min_new_tokens
    _check_reference(out, [stops] * len(PROMPTS))


@pytest.mark.parametrize('kind', ['autoregressive', 'chain'])
def test_eos_id_is_one_stop_token(kind):
    """eos_id alone (the plain program) and eos_id beside stops end rows alike (a string that
    never occurs, of _row_stops' automaton size: the same compiled program)."""
    free = _free_greedy()
    at = next(j for j in range(3, MAX_NEW) if free[0, j] not in free[0, :j])
    eos = int(free[0, at])
    plain = _run('autoregressive', SamplingConfig(0.0), eos_id=eos)
    never = [Stops(TEXT, strings=('\t' * 9,))] * len(PROMPTS)
    both = _run(kind, SamplingConfig(0.0), eos_id=eos, stops=never)
    np.testing.assert_array_equal(plain.tokens, both.tokens)
    np.testing.assert_array_equal(plain.finish_reason, both.finish_reason)
    finish, lengths = np.asarray(plain.finish_reason), np.asarray(plain.lengths)
    assert (finish[0], lengths[0]) == (FinishReason.STOP_TOKEN, at + 1)
    np.testing.assert_array_equal(finish == FinishReason.STOP_TOKEN, lengths < MAX_NEW)


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(strings=('ab', '')), r"Stops.strings\[1\]=''"),
        (dict(strings=(3,)), r'Stops.strings\[0\]=3'),
        (dict(token_ids=(2, 13)), r'Stops.token_ids\[1\]=13 .*vocab_size=13'),
        (dict(token_ids=(-1,)), r'Stops.token_ids\[0\]=-1'),
        (dict(min_new_tokens=-2), 'min_new_tokens must be an int >= 0'),
    ],
)
def test_bad_stops_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Stops(TOY, **kwargs)


def test_bad_task_arguments_are_refused_before_compiling():
    tgd = split(TARGET)[0]
    sampling = SamplingConfig(1.0)
    with pytest.raises(ValueError, match='2 per-row Stops for a batch of 4 rows'):
        fn = make_autoregressive_fn(tgd, max_new_tokens=4, sampling=sampling,
                                    stops=[Stops(TEXT), Stops(TEXT)])  # fmt: skip
        fn(split(TARGET)[1], PROMPTS, LENGTHS, 0)
    with pytest.raises(ValueError, match='stops must be a Stops'):
        make_autoregressive_fn(tgd, max_new_tokens=4, sampling=sampling, stops='abc')
    with pytest.raises(ValueError, match='different tokenizers'):
        make_autoregressive_fn(tgd, max_new_tokens=4, sampling=sampling,
                               stops=[Stops(TEXT), Stops(TOY)] * 2)  # fmt: skip
    small = make_model(tiny_config(5), seed=0)
    with pytest.raises(ValueError, match='tokenizer of 259 tokens, but the model has'):
        make_autoregressive_fn(split(small)[0], max_new_tokens=4, sampling=sampling,
                               stops=Stops(TEXT, strings=('a',)))  # fmt: skip
    many = Stops(TEXT, strings=tuple(chr(97 + i) * 2 for i in range(26)) + ('xy', 'yz') * 4)
    more = Stops(TEXT, strings=tuple(f'{i:02d}' for i in range(10)))
    with pytest.raises(ValueError, match='distinct stop strings over all rows, at most 32'):
        make_autoregressive_fn(tgd, max_new_tokens=4, sampling=sampling, stops=[many, more] * 2)
