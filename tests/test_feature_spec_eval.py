"""spec_eval on a trained feature draft (EAGLE-3 style): a feature_draft workdir is read as the
draft (params, vocabulary map, the target's max_len), calibrated and decoded at T = 0 and T = 1;
greedy output is the target's, and spec_eval.json carries tau, per-position acceptance and alpha
(the first proposal's, from the target's true features)."""

from __future__ import annotations

import json
import os

import pytest
from data_fixtures import prepare_toy, toy_data_config
from flax import nnx

from specjax.checkpoint import write_workdir
from specjax.config_files import join_spec, load_config
from specjax.data.tokenizers import ByteTokenizer
from specjax.distill import feature_mode
from specjax.distill.config import default_feature_config, default_feature_distill_config
from specjax.evaluation import spec_eval
from specjax.models import Transformer, TransformerConfig
from specjax.parallel import default_mesh_config
from specjax.train.config import default_train_config

_CONFIGS = os.path.join(os.path.dirname(__file__), '..', 'configs')
V = ByteTokenizer.vocab_size


class _Tok:  # what write_workdir needs of a tokenizer: the identity the toy data builds
    def identity(self):
        return ByteTokenizer().identity()

    def save(self, workdir):
        pass


@pytest.fixture(scope='module')
def workdirs(tmp_path_factory):
    root = tmp_path_factory.mktemp('feature_eval')
    data = toy_data_config(prepare_toy(str(root / 'tfds')))
    data.vocab_size = V
    cfg = TransformerConfig(
        vocab_size=V, d_model=32, n_layers=3, n_heads=2, n_kv_heads=2, d_ff=64, max_len=64
    )
    write_workdir(Transformer(cfg, rngs=nnx.Rngs(0)), _Tok(), str(root / 'target'), source={})
    c = load_config(os.path.join(_CONFIGS, 'feature_draft.py'))
    c.data = data
    c.distill = default_feature_distill_config()
    c.distill.update(teacher_workdir=str(root / 'target'), prompt_len=8, max_new_tokens=8)
    c.feature = default_feature_config()
    c.train = default_train_config()
    c.train.update(
        steps=2, batch_size=2, warmup_steps=1, log_every=1, eval_every=2, eval_batches=1,
        checkpoint_every=2, async_checkpointing=False,
    )  # fmt: skip
    c.mesh = default_mesh_config()
    feature_mode.run_feature_draft(c, str(root / 'feature'))
    return root, data


def test_spec_eval_reads_a_feature_draft_workdir(workdirs, tmp_path):
    root, data = workdirs
    c = load_config(join_spec(os.path.join(_CONFIGS, 'spec_eval.py'), 'checkpoints'))
    c.data = data
    c.target_workdir, c.draft_workdir = str(root / 'target'), str(root / 'feature')
    c.eval.update(
        prompts_per_domain=2, prompt_len_min=4, prompt_len_max=12, max_new_tokens=8,
        batch_size=4, ks=(2,), samplings=((0.0, 0, 1.0), (1.0, 0, 1.0)), prompt_len_edges=(8,),
        gen_len_edges=(8,), calibration_iters=2, timing_repeats=1, calibration_repeats=1,
    )  # fmt: skip
    result = spec_eval.run(c, str(tmp_path))
    assert result['models']['draft']['feature_layers'] == [0, 1, 2]
    assert result['models']['draft']['num_params'] > 0
    written = json.loads((tmp_path / 'spec_eval.json').read_text())
    spec = [r for r in written['runs'] if r['method'] == 'speculative']
    assert len(spec) == 2 and 'T=0' in {r['sampling_label'] for r in spec}
    for r in spec:
        assert 1.0 <= r['block_efficiency'] <= r['k'] + 1
        assert r['examined'] <= r['drafted'] and r['accepted'] <= r['examined']
        assert r['alpha'] is None or 0.0 <= r['alpha'] <= 1.0
        assert len(r['acceptance_per_position_conditional']) == 2
    assert written['calibration']['c'] > 0


def test_serving_serves_a_feature_draft_beside_the_drafts(workdirs, tmp_path, monkeypatch):
    """The serve stage with <root>/draft_feature present times the target with the feature draft
    too ('spec_feature'); greedy, its tokens are the target's. Each (method, batch) compiles
    once: its 1-token (time to first token) call runs the same program with a limit of 1."""
    import ml_collections

    from specjax.evaluation import measure, serving

    compiles = []
    real_compile = measure.compile_samplers
    monkeypatch.setattr(
        measure, 'compile_samplers', lambda jobs: compiles.extend(jobs) or real_compile(jobs)
    )

    root, data = workdirs
    serve_root = tmp_path / 'root'
    serve_root.mkdir()
    os.symlink(root / 'target', serve_root / 'target')
    os.symlink(root / 'feature', serve_root / 'draft_feature')
    small = TransformerConfig(
        vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, max_len=64
    )
    for i, name in enumerate(('draft_ce', 'draft_distilled')):
        model = Transformer(small, rngs=nnx.Rngs(i + 1))
        write_workdir(model, _Tok(), str(serve_root / name), source={})
    c = ml_collections.ConfigDict(
        dict(batch_sizes=(1,), max_new_tokens=4, temperature=0.0, k=2, repeats=1, samples=1,
             prompts=2, seed=0)
    )  # fmt: skip
    c.data = data
    c.eval = ml_collections.ConfigDict(
        dict(prompts_per_domain=1, prompt_len_min=4, prompt_len_max=8)
    )
    c.mesh = default_mesh_config()
    result = serving.run(c, str(tmp_path / 'serve'), str(serve_root))
    rows = {r['method']: r for r in result['rows']}
    assert set(rows) == {'target', 'draft_distilled', 'spec_ce', 'spec_distilled', 'spec_feature'}
    assert rows['spec_feature']['same_tokens_as_target'] == 1.0 and rows['spec_feature']['k'] == 2
    assert result['num_params']['draft_feature'] > 0
    assert len(compiles) == 5 + 1  # five methods at batch 1, draft_ce for its samples
    assert all(0 < r['ttft_s'] for r in result['rows'])
