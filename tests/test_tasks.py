"""The task bucket (specjax.evaluation.tasks, task_stage; specjax.sampling.task_vocab): tasks
built from Python source with their truth, scores of hand-made answers, config errors naming
the field, a grammar restricted to a reduced vocabulary, and - through the stage's own
functions on tiny random models - speculative answers under the grammar equal to the
constrained target's, the reduced student's answers inside its set and valid."""

from __future__ import annotations

import json

import jsonschema
import ml_collections
import numpy as np
import pytest
from sampling_models import make_model, tiny_config
from task_fixtures import TEXT

from specjax.evaluation import task_stage, tasks
from specjax.models import split
from specjax.sampling import FinishReason, Grammar, NGramDraft, SamplingConfig, Stops
from specjax.sampling import task as task_lib
from specjax.sampling.task_vocab import restrict_task

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')

SOURCE = '''
def plain(a=1, *rest, key, **kw):
    """Doc."""
    def inner():
        return 3
    inner()


def gives(x):
    """Doc."""
    if x:
        return x + 1


@decorated
def skipped(x):
    """Doc."""
    return x


def gen(x):
    """Doc."""
    yield x


def nodoc(x):
    return x


def many(a, b, c, d, e):
    """Doc."""
'''


def test_tasks_come_with_their_truth_and_a_stable_order():
    found = tasks.functions('pkg/mod.py', SOURCE, max_chars=200)
    assert [t.source for t in found] == ['pkg/mod.py:plain', 'pkg/mod.py:gives']
    # `inner`'s return is not plain's; decorated, generator, undocumented, 5 parameters: out
    assert found[0].truth == {'name': 'plain', 'arguments': ['a', 'rest', 'key', 'kw'],
                              'returns': False}  # fmt: skip
    assert found[1].truth == {'name': 'gives', 'arguments': ['x'], 'returns': True}
    assert 'module pkg.mod' in found[1].question and found[1].code in found[1].question
    for t in found:
        jsonschema.validate(t.truth, tasks.SCHEMA)
    docs = [('pkg/mod.py', SOURCE), ('other.py', 'def f(y):\n    """D."""\n    return y\n')]
    a, b = tasks.make_tasks(docs, 2, 200, seed=0), tasks.make_tasks(docs[::-1], 2, 200, seed=0)
    assert [t.source for t in a] == [t.source for t in b]  # independent of document order
    with pytest.raises(ValueError, match=r'config.tasks.count=9: only 3 functions .*max_chars=200'):
        tasks.make_tasks(docs, 9, 200)


REF = {'name': 'gives', 'arguments': ['x'], 'returns': True}


@pytest.mark.parametrize(
    'text, fmt, valid, strict, agreement',
    [
        (json.dumps(REF), 'valid', True, True, 1.0),
        ('Sure:\n```json\n' + json.dumps(REF) + '\n```', 'valid', True, False, 1.0),
        ('{"name": "gives", "arguments": ["y"], "returns": true}', 'valid', True, True, 2 / 3),
        ('{"name": "gives", "arguments": ["x"], "returns": true, "extra": 1}', 'schema_error',
         False, False, 1.0),
        ('{"name": "gives", "arguments": ["x"]}', 'schema_error', False, False, 2 / 3),
        ('The function gives returns x + 1.', 'not_json', False, False, 0.0),
        ('{"name": "giv', 'not_json', False, False, 0.0),
    ],
)  # fmt: skip
def test_scores_of_hand_made_answers(text, fmt, valid, strict, agreement):
    s = tasks.score_answer(text, REF, REF)
    assert (s['format'], s['valid'], s['strict']) == (fmt, valid, strict)
    assert s['agreement'] == pytest.approx(agreement)
    assert s['truth_agreement'] == pytest.approx(agreement)
    assert s['same'] == (agreement == 1.0 and fmt == 'valid')


def test_summary_counts_cost_per_valid_answer_and_speedup():
    scores = [tasks.score_answer(x, REF, REF) for x in (json.dumps(REF), 'no', json.dumps(REF))]
    s = tasks.summarize(scores, [1.0, 2.0, 3.0], [10, 40, 12], ['grammar', 'length', 'stop_token'],
                        reference_seconds=4.0)  # fmt: skip
    assert s['valid_rate'] == pytest.approx(2 / 3) and s['formats'] == {'valid': 2, 'not_json': 1}
    assert s['cost_per_valid_s'] == pytest.approx(6.0 / 2)
    assert s['speedup'] == pytest.approx(4.0 / 2.0)
    assert s['finish_reasons'] == {'grammar': 1, 'length': 1, 'stop_token': 1}
    assert s['agreement'] == pytest.approx(2 / 3) and s['mean_new_tokens'] == pytest.approx(62 / 3)
    none = tasks.summarize(scores[1:2], [1.0], [5], ['length'])
    assert none['cost_per_valid_s'] is None and none['speedup'] is None
    with pytest.raises(ValueError, match='2 scores, 1 seconds'):
        tasks.summarize(scores[:2], [1.0], [5], ['length'])


@pytest.mark.parametrize('field, value', [('count', 0), ('max_new_tokens', -1), ('repeats', 1.5),
                                          ('max_chars', 10), ('count', True)])  # fmt: skip
def test_bad_task_config_names_the_field_and_value(field, value):
    values = dict(count=2, max_chars=240, max_new_tokens=40, repeats=1)
    values[field] = value  # a ConfigDict built from it, as --config.tasks.<field>=<value> gives
    cfg = ml_collections.ConfigDict(values)
    with pytest.raises(ValueError, match=rf'config.tasks.{field} must be an int >= \d+, got '
                                         rf'{value!r}'):  # fmt: skip
        task_stage.check_config(cfg)


SMALL = {  # documents of a few single-character tokens: tiny random models end them in time
    'type': 'object',
    'properties': {'a': {'type': 'boolean'}, 'b': {'type': 'string', 'pattern': '^[a-c]{1,2}$'}},
    'required': ['a', 'b'],
    'additionalProperties': False,
}


def _unpack(bits, n):
    return np.unpackbits(bits.view(np.uint8), axis=-1, bitorder='little')[:, :n].astype(bool)


def test_a_restricted_grammar_is_the_grammar_on_the_set():
    """Per state: the allowed indices are the grammar's tokens inside the set, their next
    states the grammar's; a state is terminal where it accepts and no index leads on."""
    g = Grammar.from_json_schema(TEXT, SMALL)
    v = TEXT.vocab_size
    stops = Stops(TEXT, token_ids=(TEXT.eos_id,))
    ids = np.array([1] + list(range(3, 98)) + [150, 200], np.int64)  # eos, 95 chars, 2 pairs
    full = task_lib.build(g, stops, v, 'test')
    small = restrict_task(full, ids, v)
    gs, gf = small.grammar, full.grammar
    allowed_full = _unpack(gf.allowed_SW, v)[:, ids]
    np.testing.assert_array_equal(_unpack(gs.allowed_SW, len(ids)), allowed_full)
    for s in range(g.num_states):
        row = slice(gs.offsets_S1[s], gs.offsets_S1[s + 1])
        idx, nxt = gs.tokens_T[row], gs.next_T[row]
        assert (np.diff(idx) > 0).all()  # sorted: the device bisects
        np.testing.assert_array_equal(idx, np.flatnonzero(allowed_full[s]))
        full_row = slice(gf.offsets_S1[s], gf.offsets_S1[s + 1])
        by_token = dict(zip(gf.tokens_T[full_row], gf.next_T[full_row]))
        assert [by_token[ids[i]] for i in idx] == list(nxt)
        assert gs.terminal_S[s] == (gf.final_S[s] and not len(idx))
    assert list(small.stop.ids_RI[0][small.stop.ids_RI[0] >= 0]) == [0]  # eos is index 0
    with pytest.raises(ValueError, match=r'ids\[1\]=999 outside'):
        restrict_task(full, [1, 999], v)


@pytest.fixture(scope='module')
def answered():
    """The stage's build_calls and timed_answers on a tiny random target (TEXT's vocabulary),
    a reduced-vocabulary student (97 ids) that is also a draft, and the n-gram draft."""
    v = TEXT.vocab_size
    ids = np.array([1] + list(range(3, 98)) + [150], np.int32)
    target = make_model(tiny_config(v, max_len=64), seed=0, scale=4.0)
    student = make_model(tiny_config(len(ids), max_len=64), seed=1, scale=4.0)
    grammar = Grammar.from_json_schema(TEXT, SMALL)
    stops = Stops(TEXT, token_ids=(TEXT.eos_id,))
    s_gd, s_params = split(student)
    drafts = {
        'spec_distilled': (s_gd, s_params, ids, 2),
        'spec_ngram': (NGramDraft(3, 1), (), None, 2),
    }
    common = dict(mesh=None, rules=None, dynamic_sampling=False)
    calls = task_stage.build_calls(
        split(target), (s_gd, s_params, ids), drafts, grammar, stops, max_new=36,
        sampling=SamplingConfig(0.0), common=common,
    )  # fmt: skip
    prompts = [TEXT.encode(q) for q in ('give json: ', 'a b c', 'json for x please')]
    tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    seconds, answers = task_stage.timed_answers(calls, tokens, lengths, v, 1, 0)
    return ids, grammar, seconds, answers


def test_speculative_answers_under_the_grammar_equal_the_constrained_target(answered):
    _, grammar, seconds, answers = answered
    ref = answers['target']
    assert (ref['finish'] != FinishReason.LENGTH).all()
    for m in ('spec_distilled', 'spec_ngram'):
        np.testing.assert_array_equal(answers[m]['tokens'], ref['tokens'])
        np.testing.assert_array_equal(answers[m]['lengths'], ref['lengths'])
        assert answers[m]['examined'].sum() > 0
    for text in task_stage.answer_texts(TEXT, ref, (TEXT.eos_id,)):
        jsonschema.validate(json.loads(text), SMALL)
    assert set(seconds) == {'target', 'target_free', 'student', 'student_free', 'spec_distilled',
                            'spec_ngram'}  # fmt: skip


def test_the_reduced_student_writes_only_its_ids_and_valid_documents(answered):
    ids, grammar, _, answers = answered
    a = answers['student']
    for row, n, why in zip(a['tokens'], a['lengths'], a['finish'], strict=True):
        assert np.isin(row[:n], ids).all()
        assert why != FinishReason.LENGTH
        assert grammar.walk(row[:n]) is not None  # every token allowed where it was written
    for text in task_stage.answer_texts(TEXT, a, (TEXT.eos_id,)):
        jsonschema.validate(json.loads(text), SMALL)
    free = answers['student_free']
    assert all(np.isin(r[:n], ids).all() for r, n in zip(free['tokens'], free['lengths']))


def test_fit_max_len_keeps_the_parameters_and_the_logits():
    """A draft trained on short rows gets a larger max_len and the same function (RoPE stores
    no positions); a model whose parameters a plain Transformer would not hold is refused."""
    from flax import nnx

    from specjax.models import Transformer, apply

    short = Transformer(tiny_config(11, max_len=8), rngs=nnx.Rngs(0))
    long = task_stage.fit_max_len(short, 40)
    assert long.config.max_len == 40 and task_stage.fit_max_len(short, 8) is short
    x = np.array([[1, 2, 3, 4, 5]], np.int32)
    np.testing.assert_array_equal(apply(*split(long), x), apply(*split(short), x))
    with pytest.raises(ValueError, match='a max_len of 40 changes'):
        task_stage.fit_max_len(make_model(tiny_config(11, max_len=8), seed=0), 40)
