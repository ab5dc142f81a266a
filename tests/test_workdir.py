"""Workdir hygiene without training: results owned by one mode, spec_eval's early checks, the
one-flag unknown-field message, and the README's TensorBoard instruction."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import ml_collections
import pytest

from specjax import main
from specjax.experiments import spec_eval
from specjax.workdir import check_results_owner, config_hash, write_results

ROOT = pathlib.Path(__file__).parents[1]


def spec_eval_config(arg='random'):
    spec = importlib.util.spec_from_file_location('spec_eval_cfg', ROOT / 'configs/spec_eval.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def test_spec_eval_leaves_a_training_workdirs_results_intact(tmp_path, monkeypatch):
    config = ml_collections.ConfigDict({'mode': 'pretrain', 'seed': 0})
    path = write_results(str(tmp_path), 'pretrain', {'step': 5, 'eval': {'loss': 1.5}}, config)
    before = pathlib.Path(path).read_bytes()
    assert json.loads(before)['config_hash'] == config_hash(config)
    monkeypatch.setattr(spec_eval, 'build_tokenizer', lambda *a: pytest.fail('loaded data'))
    with pytest.raises(ValueError, match=r"written by mode 'pretrain', not 'spec_eval'"):
        spec_eval.run(spec_eval_config(), str(tmp_path))
    assert pathlib.Path(path).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['.lock', 'results.json']
    check_results_owner(str(tmp_path), 'pretrain')  # its own mode may rewrite it


def test_results_from_before_modes_were_recorded(tmp_path):
    (tmp_path / 'results.json').write_text(json.dumps({'step': 3, 'checkpoint_dir': 'x'}))
    check_results_owner(str(tmp_path), 'distill')  # a training result: checkpoints decide
    with pytest.raises(ValueError, match='never replaced'):
        check_results_owner(str(tmp_path), 'spec_eval')
    (tmp_path / 'results.json').write_text(json.dumps({'c': 0.1, 'v': {'1': 2.0}}))
    check_results_owner(str(tmp_path), 'spec_eval')
    with pytest.raises(ValueError, match="mode 'spec_eval', not 'pretrain'"):
        check_results_owner(str(tmp_path), 'pretrain')


def test_spec_eval_lengths_fail_early_with_the_arithmetic():
    c = spec_eval_config()
    c.draft.max_len = 128
    c.eval.update(prompt_len_max=64, max_new_tokens=64, ks=(1, 8))
    with pytest.raises(ValueError, match=r'prompt_len_max \(64\) .* = 137 .*draft max_len=128'):
        spec_eval.run(c, '/nonexistent/never/created')


def test_samplings_without_trailing_comma_names_the_field():
    c = spec_eval_config()
    c.eval.samplings = (0.0, 0, 1.0)  # what --config.eval.samplings='((0.0,0,1.0))' gives
    with pytest.raises(ValueError, match=r'config\.eval\.samplings .*trailing comma'):
        spec_eval.run(c, '/nonexistent/never/created')


def test_a_sampling_may_have_its_own_ks_checked_before_loading():
    c = spec_eval_config()
    c.eval.update(ks=(1, 2), samplings=((0.0, 0, 1.0), (0.7, 0, 1.0, (3,))))
    pairs, every_k = spec_eval._check_eval(c.eval)
    assert [ks for _, ks in pairs] == [(1, 2), (3,)] and every_k == (1, 2, 3)
    c.eval.samplings = ((0.0, 0, 1.0), (0.7, 0, 1.0, (0,)))
    with pytest.raises(ValueError, match=r'samplings entry .*0\.7.*its ks must be'):
        spec_eval.run(c, '/nonexistent/never/created')


def test_unknown_field_message_names_only_the_bad_flag():
    argv = [
        'prog',
        f'--config={ROOT / "configs/target.py"}:size=tiny',
        '--workdir=/tmp/x',
        '--config.train.steps=5',
        '--config.train.stepz=1',
    ]
    assert main.bad_overrides(argv, "'stepz'") == ['--config.train.stepz=1']


def test_readme_tensorboard_instruction_is_runnable():
    readme = (ROOT / 'README.md').read_text()
    pyproject = (ROOT / 'pyproject.toml').read_text()
    if 'tensorboard --logdir' in readme:
        installs = re.search(r'pip install tensorboard(?!X)', readme)
        assert installs or re.search(r'"tensorboard[<>=~"]', pyproject)
