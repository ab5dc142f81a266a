"""SmolLM2-135M-Instruct (the bundled GGUF) under a JSON-schema grammar and stops, in all three
samplers at T = 1 on chat prompts: every output parses and validates, rows end where the
grammar or a stop token (eos, <|im_end|>) says, and the tables for its 49,152-token vocabulary
stay small."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from specjax.data.tokenizers import token_bytes
from specjax.sampling import (
    FinishReason,
    Grammar,
    SamplingConfig,
    Stops,
    autoregressive_sample,
    speculative_sample,
    tree_speculative_sample,
)

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')

SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string', 'maxLength': 10},
        'args': {'type': 'array', 'items': {'type': 'string', 'maxLength': 6}, 'maxItems': 2},
    },
    'required': ['name', 'args'],
    'additionalProperties': False,
}
QUESTIONS = (
    'Describe the Python function len(obj) as JSON.',
    'Give the name and arguments of os.path.join as JSON.',
    'JSON for the function max(a, b).',
)
MAX_NEW = 40


@pytest.fixture(scope='module')
def smollm2():
    from specjax.interop.gguf import import_gguf
    from specjax.interop.workdir import bundled_path
    from specjax.models.early_exit import early_exit_draft
    from specjax.models.layout import to_layout

    try:
        path = bundled_path('smollm2-135m')
    except ValueError as e:
        pytest.skip(str(e))
    model, tok = import_gguf(path)
    model = to_layout(model, scan_layers=True)  # compiles several times faster
    return model, early_exit_draft(model, 2), tok


@pytest.fixture(scope='module')
def prompts(smollm2):
    tok = smollm2[2]
    ids = [tok.encode(tok.apply_chat_template([{'role': 'user', 'content': q}])) for q in QUESTIONS]
    table = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, row in enumerate(ids):
        table[r, : len(row)] = row
    return table, np.array([len(r) for r in ids], np.int32)


@pytest.fixture(scope='module')
def grammar(smollm2):
    return Grammar.from_json_schema(smollm2[2], SCHEMA)


def test_tables_for_the_smollm2_vocabulary_are_small(smollm2, grammar):
    tok = smollm2[2]
    assert grammar.vocab_size == tok.vocab_size == 49_152
    assert grammar.nbytes < 16 << 20  # measured 6.9 MiB: 318 states, 618k transitions
    grammar.check_tokenizer(tok)
    tb = token_bytes(tok)
    for text in ('{"name": "len", "args": ["obj"]}', 'naïve café 日本語 🙂\n\t x'):
        assert b''.join(tb[i] for i in tok.encode(text)) == text.encode()


@pytest.mark.parametrize('kind', ['autoregressive', 'chain', 'tree'])
def test_json_outputs_validate_in_every_sampler(smollm2, prompts, grammar, kind):
    target, draft, tok = smollm2
    end_of_turn = tok.encode('<|im_end|>')
    stops = Stops(tok, token_ids=end_of_turn)  # with eos, allowed where the document may end
    args = dict(max_new_tokens=MAX_NEW, sampling=SamplingConfig(1.0), rng=0, grammar=grammar,
                stops=stops)  # fmt: skip
    if kind == 'autoregressive':
        out = autoregressive_sample(target, *prompts, **args)
    elif kind == 'chain':
        out = speculative_sample(target, draft, *prompts, num_draft_tokens=3, **args)
    else:
        out = tree_speculative_sample(target, draft, *prompts, tree=((0,), (1,), (0, 0)), **args)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    finish = np.asarray(out.finish_reason)
    assert (finish != FinishReason.LENGTH).all(), [tok.decode(t) for t in tokens]
    states = np.asarray(out.stats['row_grammar_state'])
    for row, n, why, state in zip(tokens, lengths, finish, states, strict=True):
        jsonschema.validate(json.loads(tok.decode(row[:n])), SCHEMA)
        stopped = row[n - 1] in (tok.eos_id, *end_of_turn)
        ended = FinishReason.STOP_TOKEN if stopped else FinishReason.GRAMMAR
        assert why == ended and grammar.walk(row[:n])[-1] == state
