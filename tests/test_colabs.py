"""Notebooks in colabs/ are stored without outputs and their code runs top to bottom."""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'colabs').glob('*.ipynb'))


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_no_outputs_and_runs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb['cells'] if c['cell_type'] == 'code']
    assert code, f'{path.name} has no code cells'
    for cell in code:
        assert not cell['outputs'] and cell['execution_count'] is None, (
            f'{path.name} stores outputs'
        )
    namespace: dict = {}
    for cell in code:
        source = ''.join(cell['source'])
        imports = [line for line in source.splitlines() if line.startswith(('import ', 'from '))]
        for line in imports:
            module = line.split()[1].split('.')[0]
            assert module in {'jax', 'numpy', 'flax', 'specjax', 'matplotlib'}, line
        exec(compile(source, f'{path.name}', 'exec'), namespace)  # noqa: S102
