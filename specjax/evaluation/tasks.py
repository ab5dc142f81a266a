"""The task bucket: JSON answers under a schema, built from the embedded corpus, and their scores.

A task shows the chat model one short function of the standard library (a module-level `def`
with a docstring, from the embedded corpus's validation split: specjax.data.stdlib_source) and
asks for one JSON object under SCHEMA: the function's `name`, its parameter names in order
(`arguments`, `*args` / `**kwargs` by name) and whether it `returns` a value (a `return` with
a value in its own body). The truth of every field comes from the function's syntax tree, so
answers are also scored against it. Tasks are chosen deterministically: every qualifying
function (no decorators, not async, not a generator, its source at most `max_chars` characters,
at most MAX_ARGUMENTS parameters, names that SCHEMA's patterns admit) ordered by
sha256(seed:source:name), the first `count` taken.

Scoring (`score_answer`, pure): an answer is the decoded text the model wrote before its stop
token. `parse_answer` reads it strictly (the whole text is one JSON document) or, failing that,
leniently (the first balanced {...} in it, e.g. inside a Markdown fence: what an unconstrained
chat model tends to write); `valid` means jsonschema accepts the document read either way,
`strict` the whole text was the document. Field agreement: the fraction of SCHEMA's fields
whose value equals the reference answer's (the target's greedy constrained answer); truth
agreement the same against the syntax tree. `summarize` aggregates one method's scores.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
from collections import Counter

MAX_ARGUMENTS = 4
IDENTIFIER = r'^[A-Za-z_][A-Za-z0-9_]{0,23}$'  # <= 24 characters: bounded, so the grammar is
SCHEMA = {  # finite (every document ends) and its tables small
    'type': 'object',
    'properties': {
        'name': {'type': 'string', 'pattern': IDENTIFIER},
        'arguments': {
            'type': 'array',
            'items': {'type': 'string', 'pattern': IDENTIFIER},
            'maxItems': MAX_ARGUMENTS,
        },
        'returns': {'type': 'boolean'},
    },
    'required': ['name', 'arguments', 'returns'],
    'additionalProperties': False,
}
FIELDS = tuple(SCHEMA['required'])
QUESTION = (
    'Here is a function from the Python standard library module {module}:\n'
    '```python\n{code}\n```\n'
    'Answer with one JSON object only, with the keys "name" (the function\'s name), '
    '"arguments" (its parameter names, in order) and "returns" (true if it returns a value, '
    'else false).'
)
FORMATS = ('valid', 'schema_error', 'not_json')  # an answer's format, best first


@dataclasses.dataclass(frozen=True)
class Task:
    """One extraction task: source ('<stdlib path>:<function>'), the function's code, the
    true answer from its syntax tree, the user message."""

    source: str
    code: str
    truth: dict
    question: str


def _returns_value(fn: ast.FunctionDef) -> bool:
    """A `return <value>` in the function's own body (nested defs and lambdas excluded)."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Return) and node.value is not None:
            return True
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _is_generator(fn: ast.FunctionDef) -> bool:
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Yield | ast.YieldFrom):
            return True
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _arguments(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    names += [a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    return names + ([a.kwarg.arg] if a.kwarg else [])


def functions(source: str, text: str, max_chars: int) -> list[Task]:
    """The qualifying module-level functions of one stdlib file (module docstring)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    ident = re.compile(IDENTIFIER)
    module = source.removesuffix('.py').replace('/', '.').removesuffix('.__init__')
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            continue
        code = ast.get_source_segment(text, node)
        args = _arguments(node)
        if (
            code is None
            or len(code) > max_chars
            or ast.get_docstring(node) is None
            or _is_generator(node)
            or len(args) > MAX_ARGUMENTS
            or not all(ident.match(x) for x in (node.name, *args))
        ):
            continue
        truth = {'name': node.name, 'arguments': args, 'returns': _returns_value(node)}
        question = QUESTION.format(module=module, code=code)
        out.append(Task(f'{source}:{node.name}', code, truth, question))
    return out


def make_tasks(documents, count: int, max_chars: int, seed: int = 0) -> list[Task]:
    """`count` tasks from `documents` ((source, text) pairs of Python files), ordered by
    sha256(seed:source:name) (module docstring); ValueError naming the fields when fewer
    functions qualify."""
    found = [t for source, text in documents for t in functions(source, text, max_chars)]
    key = lambda t: hashlib.sha256(f'{seed}:{t.source}'.encode()).hexdigest()
    found.sort(key=key)
    if len(found) < count:
        raise ValueError(
            f'config.tasks.count={count}: only {len(found)} functions of the corpus validation '
            f'split fit config.tasks.max_chars={max_chars}'
        )
    return found[:count]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _first_object(text: str):
    """The first balanced {...} in `text` that parses as JSON, or None."""
    decoder = json.JSONDecoder()
    start = text.find('{')
    while start >= 0:
        try:
            return decoder.raw_decode(text, start)[0]
        except json.JSONDecodeError:
            start = text.find('{', start + 1)
    return None


def parse_answer(text: str) -> tuple[object, bool]:
    """(document or None, strict): the whole stripped text as JSON (strict), else the first
    balanced {...} that parses (not strict), else None."""
    try:
        return json.loads(text), True
    except json.JSONDecodeError:
        return _first_object(text), False


def _agreement(doc, ref) -> float | None:
    """Fraction of FIELDS equal in doc and ref (None without a reference object)."""
    if not isinstance(ref, dict):
        return None
    if not isinstance(doc, dict):
        return 0.0
    return sum(f in doc and f in ref and doc[f] == ref[f] for f in FIELDS) / len(FIELDS)


def score_answer(text: str, reference, truth: dict, schema=SCHEMA) -> dict:
    """One answer's scores: format (FORMATS), valid, strict, agreement with `reference` (a
    parsed document or None), truth agreement, same (the document equals the reference)."""
    import jsonschema

    doc, strict = parse_answer(text)
    valid = False
    if doc is not None:
        valid = jsonschema.Draft202012Validator(schema).is_valid(doc)
    fmt = 'valid' if valid else 'schema_error' if doc is not None else 'not_json'
    return {
        'format': fmt,
        'valid': valid,
        'strict': bool(valid and strict),
        'agreement': _agreement(doc, reference),
        'truth_agreement': _agreement(doc, truth),
        'same': doc is not None and doc == reference,
        'document': doc,
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(scores: list[dict], seconds: list[float], new_tokens: list[int], finish: list[str],
              reference_seconds: float | None = None) -> dict:  # fmt: skip
    """One method over the tasks: valid / strict rates, mean agreements, formats and finish
    reasons counted, mean new tokens, mean seconds per answer, cost per valid answer (total
    seconds / valid answers; None with none valid), speedup = reference_seconds / mean
    seconds (reference: the constrained target's mean)."""
    n = len(scores)
    if not n or not len(seconds) == len(new_tokens) == len(finish) == n:
        raise ValueError(f'summarize: {n} scores, {len(seconds)} seconds, {len(finish)} reasons')
    valid = sum(s['valid'] for s in scores)
    mean_s = sum(seconds) / n
    return {
        'answers': n,
        'valid_rate': valid / n,
        'strict_rate': sum(s['strict'] for s in scores) / n,
        'agreement': _mean(s['agreement'] for s in scores),
        'same_rate': sum(s['same'] for s in scores) / n,
        'truth_agreement': _mean(s['truth_agreement'] for s in scores),
        'formats': {f: c for f in FORMATS if (c := sum(s['format'] == f for s in scores))},
        'finish_reasons': dict(Counter(finish)),
        'mean_new_tokens': sum(new_tokens) / n,
        'seconds_per_answer': mean_s,
        'cost_per_valid_s': sum(seconds) / valid if valid else None,
        'speedup': reference_seconds / mean_s if reference_seconds else None,
    }
