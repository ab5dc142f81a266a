"""Workdir hygiene without training: results owned by one mode, spec_eval's early checks, the
one-flag unknown-field message, and the README's TensorBoard instruction."""

from __future__ import annotations

import json
import pathlib
import re

import ml_collections
import pytest

from specjax import main
from specjax.config_files import join_spec, load_config
from specjax.evaluation import spec_eval
from specjax.workdir import check_results_owner, config_hash, write_results

ROOT = pathlib.Path(__file__).parents[1]


def spec_eval_config(arg='random'):
    return load_config(join_spec(ROOT / 'configs/spec_eval.py', arg))


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
        f'--config={ROOT / "configs/pretrain.py"}:size=tiny',
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


def _drop(tree: dict, name: str) -> dict:
    """A config's JSON without `name` anywhere: what a workdir from before the field recorded."""
    return {k: _drop(v, name) if isinstance(v, dict) else v for k, v in tree.items() if k != name}


def _parse(argv):
    from absl import flags
    from ml_collections import config_flags

    fv, argv = flags.FlagValues(), ['specjax', *argv]  # as specjax.main parses its flags
    config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, sys_argv=argv)
    fv(argv)
    return fv.config


@pytest.mark.parametrize(
    'config_arg, group',
    [
        ('configs/pretrain.py:size=tiny', 'model'),
        ('configs/distill.py', 'draft'),
        ('configs/cotrain.py', 'draft'),
        ('configs/spec_eval.py:random', 'draft'),
    ],
)
def test_scan_layers_is_settable_and_old_workdirs_still_match(config_arg, group):
    """The shipped configs carry scan_layers=False (so --config.<group>.scan_layers=True
    parses); a workdir recorded before the field existed has the same identity, a stacked run
    does not (its checkpoints hold another parameter layout)."""
    from specjax.checkpoint import to_json
    from specjax.models import Transformer, TransformerConfig
    from specjax.models.layout import is_stacked
    from specjax.workdir import config_changes

    path, _, arg = config_arg.partition(':')
    flag = f'--config={ROOT / path}' + (f':{arg}' if arg else '')
    config = _parse([flag])
    assert config[group].scan_layers is False
    old = _drop(to_json(config), 'scan_layers')
    assert 'scan_layers' not in json.dumps(old)
    assert config_changes(old, config) == []
    assert config_hash(ml_collections.ConfigDict(old)) == config_hash(config)

    scanned = _parse([flag, f'--config.{group}.scan_layers=True'])
    assert config_changes(old, scanned) == [(f'{group}.scan_layers', None, True)]
    assert config_hash(scanned) != config_hash(config)
    cfg = TransformerConfig.from_dict(scanned[group])
    assert cfg.scan_layers is True and cfg.to_dict()['scan_layers'] is True
    if group == 'model':  # the flag reaches the model: blocks stacked on a layers axis
        import jax
        from flax import nnx

        small = dict(scanned[group].to_dict(), d_model=16, n_heads=2, n_kv_heads=2, d_ff=32)
        model = nnx.eval_shape(
            lambda: Transformer(TransformerConfig.from_dict(small), rngs=nnx.Rngs(0))
        )
        assert is_stacked(nnx.state(model))
        assert jax.tree.leaves(nnx.state(model))[0].shape[0] == cfg.n_layers


def test_sequence_fields_at_their_default_match_as_lists_or_tuples():
    """A recorded config is JSON (a tuple reads back as a list): a DEFAULT_VALUED_FIELDS sequence
    at its default counts as absent either way, and any other value does not."""
    from specjax.workdir import at_default

    for field in ('spec_eval.ngram.proposals_by_n', 'serve.ngram_proposals_by_n'):
        assert at_default(field, ()) and at_default(field, [])
        assert not at_default(field, [0, 2, 4]) and not at_default(field, None)
    assert not at_default('spec_eval.eval.ks', [])  # not a default-valued field
