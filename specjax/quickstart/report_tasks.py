"""The report's task bucket: JSON answers under a schema, per way of serving.

From <root>/tasks/tasks.json (specjax.evaluation.task_stage): the section `section_tasks` (one
row per method: schema-valid rate, field agreement with the target's constrained greedy answer
and with the truth, new tokens, seconds per answer, speedup against the constrained target,
cost per valid answer, acceptance and tau under the constraint, answers equal to the target's;
then the format failures of the unconstrained and reduced-vocabulary answers) and the verdict's
sentence `tasks_sentence`. Nothing here when the run has no tasks stage.
"""

from __future__ import annotations

from specjax.evaluation.tables import fmt, markdown_table

NAMES = {
    'target': 'target alone, constrained (the reference)',
    'target_free': 'target alone, unconstrained',
    'student': 'distilled student alone, constrained',
    'student_free': 'distilled student alone, unconstrained',
    'spec_ce': 'target + CE draft, constrained',
    'spec_distilled': 'target + distilled draft, constrained',
    'spec_feature': 'target + feature draft (EAGLE-3), constrained',
    'spec_ngram': 'target + n-gram draft, constrained',
}
FAILURE_WORDS = {'schema_error': 'JSON that fails the schema', 'not_json': 'no JSON object'}
EXAMPLE_CHARS = 80


def _name(method: str, t: dict) -> str:
    k = (t.get('ks') or {}).get(method)
    return NAMES.get(method, method) + (f' (k = {k})' if k else '')


def _short(text: str) -> str:
    text = ' '.join(text.split()).replace('`', "'")  # shown inside a code span
    return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 3] + '...'


def _reasons(s: dict) -> str:
    return ', '.join(f'{r} {n}' for r, n in sorted(s['finish_reasons'].items()))


def _row(method: str, s: dict, t: dict) -> list:
    spec = method.startswith('spec_')
    return [
        _name(method, t),
        fmt(s['valid_rate']),
        fmt(s['agreement']),
        fmt(s['truth_agreement']),
        fmt(s['mean_new_tokens']),
        fmt(s['seconds_per_answer']),
        fmt(s['speedup']),
        fmt(s['cost_per_valid_s']) if s['cost_per_valid_s'] is not None else 'no valid answer',
        fmt(s.get('alpha')) if spec else '-',
        fmt(s.get('tau')) if spec else '-',
        fmt(s.get('equal_to_target')) if spec else '-',
        _reasons(s),
    ]


def failures(method: str, s: dict) -> list[str]:
    """Bullets: how the method's answers failed the schema, with the first of each kind."""
    out = []
    for kind, words in FAILURE_WORDS.items():
        bad = [p for p in s['per_task'] if p['format'] == kind]
        if bad:
            out.append(
                f'- {NAMES.get(method, method)}: {len(bad)} of {s["answers"]} answers {words} '
                f'(finish {bad[0]["finish"]}; e.g. `{_short(bad[0]["answer"])}`)'
            )
    lenient = s['valid_rate'] - s['strict_rate']
    if lenient > 0:
        out.append(
            f'- {NAMES.get(method, method)}: {fmt(lenient)} of its answers validate only once '
            'the JSON object is cut out of surrounding text (e.g. a Markdown fence)'
        )
    return out


def section_tasks(d: dict) -> list[str]:
    """'## Tasks: JSON answers under a schema', or nothing without a tasks stage."""
    t = d.get('tasks')
    if not t:
        return []
    methods = t['methods']
    fields = ', '.join(f'`{f}`' for f in t['schema']['required'])
    out = [
        '## Tasks: JSON answers under a schema',
        '',
        f'{len(t["tasks"])} tasks: a short function of the standard library (the embedded '
        f"corpus's validation split) in the target's chat template, one JSON object asked for "
        f'with the fields {fields} (additional properties refused). Greedy (T = '
        f'{fmt(t["sampling"]["temperature"])}), batch 1, at most {t["max_new_tokens"]} new '
        f'tokens, seconds the median of {t["repeats"]} interleaved repeats per answer. '
        '"Constrained": decoded under the schema\'s grammar (a token automaton masking every '
        "distribution); the reference is the target's constrained greedy answer. Valid: "
        'jsonschema accepts the answer. Field agreement: the fraction of fields equal to the '
        "reference's; truth: equal to the function's own syntax tree. Cost per valid answer: "
        "seconds over all tasks / valid answers. Speedup: the constrained target's seconds per "
        "answer / the method's.",
        '',
        "**Exact here** means the speculative methods verify their drafts against the target's "
        'constrained law (both models masked at the grammar state along the drafted prefix), '
        "so at T = 0 their answers are the target's constrained answers token for token: "
        '"equal to target" measures it (below 1 only through floating-point near-ties of the '
        "target's logits between one-token and k-token calls). Alpha: accepted / examined "
        'proposals; tau: tokens per target call, both under the constraint.',
        '',
    ]
    head = ['method', 'valid', 'field agreement', 'truth', 'new tokens', 's / answer', 'speedup',
            'cost per valid (s)', 'alpha', 'tau', 'equal to target', 'finish']  # fmt: skip
    out += [markdown_table(head, [_row(m, s, t) for m, s in methods.items()]), '']
    inexact = [m for m, s in methods.items() if m.startswith('spec_') and s['equal_to_target'] < 1]
    if inexact:
        out += [
            f"**Not every speculative answer equals the target's**: {', '.join(inexact)} "
            '(floating-point near-ties; per-task answers in tasks/tasks.json).',
            '',
        ]
    bullets = [b for m, s in methods.items() if not m.startswith('spec_') for b in failures(m, s)]
    out += ['### Format failures', '']
    out += bullets or ['- none: every answer of every method validates']
    return out + ['']


def tasks_sentence(d: dict) -> list[str]:
    """The verdict's sentence on the task bucket (nothing without a tasks stage)."""
    t = d.get('tasks')
    if not t:
        return []
    m = t['methods']
    spec = {k: s for k, s in m.items() if k.startswith('spec_')}
    words = [
        f'Under a JSON schema ({len(t["tasks"])} tasks, report section "Tasks"): the '
        f"constrained target's valid rate {fmt(m['target']['valid_rate'])} "
        f'({fmt(m["target"]["seconds_per_answer"])} s an answer); unconstrained '
        f'{fmt(m["target_free"]["valid_rate"])}.'
    ]
    if spec:
        best = max(spec, key=lambda k: spec[k]['speedup'] or 0)
        s = spec[best]
        words.append(
            f'Fastest exact method: {_name(best, t)}, {fmt(s["speedup"])}x the constrained '
            f'target, share of answers equal to its {fmt(s["equal_to_target"])}.'
        )
    st = m['student']
    cost = st['cost_per_valid_s']
    words.append(
        f'The distilled student alone, constrained: valid {fmt(st["valid_rate"])}, field '
        f'agreement {fmt(st["agreement"])}, {fmt(st["speedup"])}x, cost per valid answer '
        + (f'{fmt(cost)} s' if cost is not None else 'none valid')
        + f' (unconstrained: valid {fmt(m["student_free"]["valid_rate"])}).'
    )
    return [' '.join(words), '']
