"""The report's task bucket from a faked tasks.json: report_data loads it, the section shows each
method's figures as the JSON has them and the student's format failures, the verdict's
sentence names the fastest exact method, and report.render places the section."""

from __future__ import annotations

import json
import os

from specjax.evaluation import tasks
from specjax.evaluation.tables import fmt
from specjax.quickstart import report as quickstart_report
from specjax.quickstart import report_data
from specjax.quickstart.report_tasks import section_tasks, tasks_sentence

REF = {'name': 'f', 'arguments': ['x'], 'returns': True}
TEXTS = {
    'target': [json.dumps(REF)] * 2,
    'target_free': ['```json\n' + json.dumps(REF) + '\n```', 'It returns x.'],
    'student': [json.dumps(REF), json.dumps(dict(REF, name='g'))],
    'student_free': ['{"name": "f"}', 'f takes x'],
    'spec_distilled': [json.dumps(REF)] * 2,
    'spec_ngram': [json.dumps(REF)] * 2,
}
SECONDS = {
    'target': [2.0, 2.0], 'target_free': [3.0, 3.0], 'student': [0.5, 0.5],
    'student_free': [1.0, 1.0], 'spec_distilled': [1.6, 1.6], 'spec_ngram': [1.0, 1.0],
}  # fmt: skip


def _fake() -> dict:
    methods = {}
    for m, texts in TEXTS.items():
        scores = [tasks.score_answer(t, REF, REF) for t in texts]
        finish = ['grammar', 'length'] if m.endswith('_free') else ['grammar', 'stop_token']
        s = tasks.summarize(scores, SECONDS[m], [12, 30], finish, reference_seconds=2.0)
        if m.startswith('spec_'):
            s.update(alpha=0.5, tau=1.8, equal_to_target=1.0 if m == 'spec_ngram' else 0.5)
        s['per_task'] = [
            dict(answer=t, format=sc['format'], agreement=sc['agreement'], finish=f,
                 new_tokens=12, seconds=1.0)
            for t, sc, f in zip(texts, scores, finish)
        ]  # fmt: skip
        methods[m] = s
    return dict(
        methods=methods, reference='target', schema=tasks.SCHEMA, student='draft_distilled',
        ks={'spec_distilled': 1, 'spec_ngram': 2}, sampling={'temperature': 0.0},
        max_new_tokens=40, repeats=1, tasks=[{'source': 'a.py:f'}, {'source': 'b.py:f'}],
    )  # fmt: skip


def test_the_section_and_sentence_show_the_json(tmp_path):
    t = _fake()
    path = str(tmp_path / 'tasks.json')
    with open(path, 'w') as f:
        json.dump(t, f)
    d = {'tasks': report_data._json(path)}
    text = '\n'.join(section_tasks(d))
    assert text.startswith('## Tasks: JSON answers under a schema')
    rows = {line.split(' | ')[0][2:]: line.split(' | ') for line in text.splitlines()
            if line.startswith('| ') and not line.startswith('| method')}  # fmt: skip
    m = t['methods']
    st = rows['distilled student alone, constrained']
    assert st[1:4] == [fmt(1.0), fmt((1 + 2 / 3) / 2), fmt(m['student']['truth_agreement'])]
    assert st[7] == fmt((0.5 + 0.5) / 2)  # seconds over both tasks / 2 valid answers
    spec = rows['target + distilled draft, constrained (k = 1)']
    assert spec[6] == fmt(2.0 / 1.6) and spec[10] == fmt(0.5)
    assert rows['distilled student alone, unconstrained'][7] == 'no valid answer'
    assert "Not every speculative answer equals the target's**: spec_distilled" in text
    assert '1 of 2 answers JSON that fails the schema' in text  # student_free's '{"name": "f"}'
    assert '1 of 2 answers no JSON object' in text
    assert 'validate only once the JSON object is cut out' in text  # target_free's fence
    sentence = ' '.join(tasks_sentence(d))
    assert f'target + n-gram draft, constrained (k = 2), {fmt(2.0)}x' in sentence
    assert f'cost per valid answer {fmt(0.5)} s' in sentence and 'none valid' not in sentence
    assert section_tasks({}) == [] and tasks_sentence({}) == []


def test_render_places_the_tasks_section(monkeypatch):
    """report.render calls section_tasks between the routing section and the rest (the other
    sections stubbed: they need every stage's JSON)."""
    for name in dir(quickstart_report):
        if name.startswith('section_') and name != 'section_tasks':
            monkeypatch.setattr(quickstart_report, name, lambda d, name=name: [f'<{name}>'])
    text = quickstart_report.render({'tasks': _fake()}, [])
    assert (
        text.index('<section_route>')
        < text.index('## Tasks: JSON answers')
        < text.index('<section_feature_goals>')
    )


def test_report_data_loads_tasks_json_when_present(tmp_path, monkeypatch):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, 'tasks'))
    with open(os.path.join(root, 'tasks', 'tasks.json'), 'w') as f:
        json.dump(_fake(), f)
    calls = []
    real = report_data._json

    def fake(path):
        calls.append(path)
        return real(path) if path.endswith('tasks.json') else {'eval': {}, 'runs': []}

    monkeypatch.setattr(report_data, '_json', fake)
    monkeypatch.setattr(report_data, 'alpha_curve', lambda root, stage: [])
    d = report_data.load(root)
    assert d['tasks']['methods']['target']['valid_rate'] == 1.0
