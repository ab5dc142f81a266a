"""Grammars: device tables against outlines-core's index, the three samplers under a regex and a
JSON schema (greedy speculation equals greedy autoregression; sampled outputs match and the
automaton state after rejections equals a host walk of the accepted tokens), and bad input."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from sampling_models import make_model, perturbed, tiny_config
from task_fixtures import TEXT, PieceTokenizer

from specjax.data.tokenizers import ByteTokenizer
from specjax.models import split
from specjax.sampling import (
    DynamicTree,
    FinishReason,
    Grammar,
    NGramDraft,
    SamplingConfig,
    Stops,
    make_autoregressive_fn,
    make_speculative_fn,
    make_tree_speculative_fn,
    ngram_tree_paths,
)
from specjax.sampling.constrain import next_state

PATTERN = r'(ab|ba)+(c[0-9]{1,2}|d[a-d]{2})'  # branching, two tokenisations, accepting states
SCHEMA = {  # with more ways on and terminal
    'type': 'object',
    'properties': {'n': {'type': 'integer'}, 'tag': {'enum': ['ab', 'c d']}},
    'required': ['n', 'tag'],
    'additionalProperties': False,
}
CONFIG = tiny_config(TEXT.vocab_size, max_len=80)
TARGET = make_model(CONFIG, seed=0, scale=4.0)
DRAFT = perturbed(TARGET, seed=1, noise=1.0)
PROMPTS = np.array([[10, 20, 30, 40], [50, 60, 0, 0], [70, 0, 0, 0], [80, 90, 100, 0]] * 2)
LENGTHS = np.array([4, 2, 1, 3] * 2, np.int32)
MAX_NEW, K = 40, 3
TREE = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
KINDS = ['autoregressive', 'chain', 'tree', 'dynamic', 'ngram_chain', 'ngram_tree']


@functools.cache
def grammar(kind='regex'):
    if kind == 'regex':
        return Grammar.from_regex(TEXT, PATTERN)
    return Grammar.from_json_schema(TEXT, json.dumps(SCHEMA))


def run(kind, sampling, **task):
    tgd, tp = split(TARGET)
    dgd, dp = (NGramDraft(2, 1), ()) if kind.startswith('ngram') else split(DRAFT)
    if kind == 'autoregressive':
        fn = make_autoregressive_fn(tgd, max_new_tokens=MAX_NEW, sampling=sampling, **task)
        return fn(tp, PROMPTS, LENGTHS, 1)
    if kind in ('chain', 'ngram_chain'):
        fn = make_speculative_fn(tgd, dgd, num_draft_tokens=K, max_new_tokens=MAX_NEW,
                                 sampling=sampling, **task)  # fmt: skip
    else:
        tree = {'tree': TREE, 'ngram_tree': ngram_tree_paths(2, K)}.get(kind)
        tree = DynamicTree(depth=3, expand=2, nodes=5) if tree is None else tree
        fn = make_tree_speculative_fn(tgd, dgd, tree=tree, max_new_tokens=MAX_NEW,
                                      sampling=sampling, **task)  # fmt: skip
    return fn(tp, dp, PROMPTS, LENGTHS, 1)


def rows(out):
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return [tokens[r, : lengths[r]] for r in range(len(lengths))]


def test_device_tables_agree_with_the_index():
    g = grammar()
    index = g._index
    dense = {v: k for k, v in g._dense.items()}
    states, tokens, expected = [], [], []
    for s in range(g.num_states):
        allowed = sorted(set(index.get_allowed_tokens(dense[s])) - {TEXT.eos_id})
        np.testing.assert_array_equal(g.allowed(s), allowed)
        assert g.is_final(s) == index.is_final_state(dense[s])
        for t in range(TEXT.vocab_size):  # every token: a transition, or the state itself
            nxt = index.get_next_state(dense[s], t) if t in allowed else None
            states.append(s)
            tokens.append(t)
            expected.append(s if nxt is None else g._dense[nxt])
    tables = jax.device_put(g.tables)
    got = jax.jit(next_state)(tables, jnp.asarray(states), jnp.asarray(tokens))
    np.testing.assert_array_equal(got, expected)
    bits = np.unpackbits(g.tables.allowed_SW.view(np.uint8), axis=1, bitorder='little')
    for s in range(g.num_states):
        np.testing.assert_array_equal(np.flatnonzero(bits[s, : TEXT.vocab_size]), g.allowed(s))


@pytest.mark.parametrize('kind', KINDS[1:])
def test_greedy_speculation_equals_greedy_autoregression_under_grammar_and_stops(kind):
    stops = [Stops(TEXT, strings=('bc', 'a1')), Stops(TEXT, strings=('9',)), None,
             Stops(TEXT, token_ids=(TEXT.encode('d')[0],), min_new_tokens=3)] * 2  # fmt: skip
    task = dict(grammar=grammar(), stops=stops)
    reference = run('autoregressive', SamplingConfig(0.0), **task)
    out = run(kind, SamplingConfig(0.0), **task)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.lengths, reference.lengths)
    np.testing.assert_array_equal(out.finish_reason, reference.finish_reason)
    assert len(set(np.asarray(out.finish_reason).tolist())) > 1


@pytest.mark.parametrize('kind', KINDS)
def test_sampled_outputs_match_and_the_state_follows_the_accepted_tokens(kind):
    g = grammar()
    out = run(kind, SamplingConfig(1.0), grammar=g)
    finish = np.asarray(out.finish_reason)
    for r, row in enumerate(rows(out)):
        walked = g.walk(row)
        assert walked is not None, TEXT.decode(row)
        assert walked[-1] == int(out.stats['row_grammar_state'][r])  # after rejections too
        text = TEXT.decode(row)
        if finish[r] in (FinishReason.GRAMMAR, FinishReason.STOP_TOKEN):
            assert re.fullmatch(PATTERN, text), (finish[r], text)
            assert (finish[r] == FinishReason.STOP_TOKEN) == (row[-1] == TEXT.eos_id)
    assert FinishReason.GRAMMAR in finish.tolist()
    if kind != 'autoregressive':  # some rounds rejected (every shape here has depth K)
        assert int(out.stats['accepted']) < K * int(out.stats['rounds'])


@pytest.mark.parametrize('kind', ['autoregressive', 'chain'])
def test_json_schema_outputs_parse_and_validate(kind):
    g = grammar('json')
    out = run(kind, SamplingConfig(1.0), grammar=g)
    finish = np.asarray(out.finish_reason)
    assert (finish != FinishReason.LENGTH).sum() >= 6
    for row, why in zip(rows(out), finish, strict=True):
        if why == FinishReason.LENGTH:  # cut by max_new_tokens: a prefix of a document
            assert g.walk(row) is not None
        else:
            jsonschema.validate(json.loads(TEXT.decode(row)), SCHEMA)


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    'build, match',
    [
        (lambda: Grammar.from_regex(TEXT, '(ab'), r"pattern='\(ab' cannot be compiled"),
        (lambda: Grammar.from_regex(TEXT, ''), 'pattern must be a non-empty str'),
        (lambda: Grammar.from_regex(PieceTokenizer(['', '', 'a']), 'ab'), 'cannot be compiled'),
        (lambda: Grammar.from_json_schema(TEXT, '{"type": '), 'schema is not valid JSON'),
        (lambda: Grammar.from_json_schema(TEXT, 3), 'schema must be a JSON string or a dict'),
        (lambda: Grammar.from_json_schema(TEXT, {'type': 5}), 'invalid schema at type'),
        (
            lambda: Grammar.from_json_schema(
                TEXT, {'type': 'object', 'properties': {'age': {'type': 'integer', 'minimum': 0}}}
            ),
            r"schema\['properties'\]\['age'\] uses 'minimum'",
        ),
        (lambda: Grammar.from_json_schema(TEXT, {'oneOf': [{'type': 'integer'}]}), "'oneOf'"),
        (
            lambda: Grammar.from_json_schema(TEXT, {'type': 'string', 'format': 'hostname'}),
            'outlines-core cannot compile: Format hostname is not supported',
        ),
        (lambda: Grammar.from_json_schema(TEXT, {'not': {'type': 'null'}}), "uses 'not'"),
        (
            lambda: Grammar.from_regex(TEXT, '[a-z]{1,30}', max_bytes=1000),
            r'needs .* MiB of device tables \(\d+ states, \d+ transitions.*over max_bytes=1000',
        ),
        (lambda: Grammar.from_regex(object(), 'a'), 'object has no token_bytes'),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_grammar_of_another_tokenizer_is_refused():
    g = grammar()
    other = ByteTokenizer()  # same vocabulary size, other bytes
    with pytest.raises(ValueError, match='vocabulary digest'):
        g.check_tokenizer(other)
    g.check_tokenizer(TEXT)
    tgd = split(TARGET)[0]
    with pytest.raises(
        ValueError, match=r'stops were built for a tokenizer with vocabulary digest'
    ):
        make_autoregressive_fn(tgd, max_new_tokens=4, sampling=SamplingConfig(1.0), grammar=g,
                               stops=Stops(other, strings=('a',)))  # fmt: skip
    small = make_model(tiny_config(5), seed=0)
    with pytest.raises(ValueError, match='grammar: built for a tokenizer of 259 tokens'):
        make_autoregressive_fn(split(small)[0], max_new_tokens=4, sampling=SamplingConfig(1.0),
                               grammar=g)  # fmt: skip
    with pytest.raises(ValueError, match='grammar must be a specjax.sampling.Grammar'):
        make_autoregressive_fn(tgd, max_new_tokens=4, sampling=SamplingConfig(1.0), grammar='x')
