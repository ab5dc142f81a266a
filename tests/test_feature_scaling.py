"""Smoke test of benchmarks.feature_scaling on its tiny preset (the toy target on the stdlib
corpus): one row per data size, sizes increasing and nested, alpha per draft position in [0, 1]
for each unrolled step, tau from those alphas by stats.expected_block_efficiency_by_position, the
JSON (with the corpus and tokenizer digests), table and plot written, and a rerun reads the
finished sizes back instead of training them again; --init_head trains beside them."""

from __future__ import annotations

import os

import numpy as np
import pytest
from data_fixtures import stdlib_data_config

from benchmarks import feature_scaling
from specjax import jsonio
from specjax.data.digests import data_digests
from specjax.distill.sources import prompts_from_batch
from specjax.sampling.stats import expected_block_efficiency, expected_block_efficiency_by_position

DEPTH, K = 2, 4  # the tiny preset's unroll depth; tau's chain length


@pytest.fixture(scope='module')
def run(stdlib_data_dir, tmp_path_factory):
    wd = tmp_path_factory.mktemp('feature_scaling')
    argv = ['--preset=tiny', f'--workdir={wd}', f'--data_dir={stdlib_data_dir}']
    argv += ['--compilation_cache=', f'--k={K}']  # conftest's compilation cache
    return wd, argv, feature_scaling.main(argv)


def test_one_row_per_size_increasing_and_nested(run):
    _, _, r = run
    sizes = r['sizes']
    assert len(sizes) == 4 and r['ttt_steps'] == DEPTH
    for key in ('tokens', 'rows', 'steps'):
        assert all(a[key] < b[key] for a, b in zip(sizes, sizes[1:])), key
    for i, s in enumerate(sizes):  # the fewest first rows holding max_tokens / 2^(3 - i)
        assert s['tokens'] >= r['max_tokens'] / 2 ** (3 - i)
        assert s['tokens'] <= s['rows'] * r['seq_len']
        assert s['steps'] == -(-s['rows'] // r['batch'])  # one pass
    assert sizes[-1]['tokens'] >= r['max_tokens']
    assert r['feature_cache']['rows_done'] == sizes[-1]['rows']  # one cache, the largest size's


def test_alpha_per_position_and_tau(run):
    for s in run[2]['sizes']:
        alpha = np.asarray(s['alpha_per_position'])
        assert alpha.shape == (DEPTH,) and np.all((alpha >= 0) & (alpha <= 1))
        padded = np.concatenate([alpha, np.full(K - DEPTH, alpha[-1])])
        np.testing.assert_allclose(s['tau'], 1 + np.cumprod(padded).sum(), rtol=1e-12)
        assert 1 <= s['tau'] <= K + 1 and np.isfinite(s['val_loss'])
        mode = jsonio.read_json(os.path.join(s['workdir'], 'results.json'))
        assert [mode[f'alpha_step{j}'] for j in range(DEPTH)] == s['alpha_per_position']
        assert mode['step'] == s['steps']


def test_tau_formula():
    """1 + sum_i prod_{j<=i} alpha_j; Leviathan's closed form when every alpha is equal."""
    assert expected_block_efficiency_by_position([0.5, 0.4], 4) == pytest.approx(1.812)
    assert expected_block_efficiency_by_position([0.5, 0.4, 0.3, 0.2, 0.9], 2) == 1.7
    for a in (0.0, 0.3, 1.0):
        got = expected_block_efficiency_by_position([a] * 3, 3)
        assert got == pytest.approx(expected_block_efficiency(a, 3))
    with pytest.raises(ValueError, match='alphas in'):
        expected_block_efficiency_by_position([1.2], 4)


def test_json_table_and_plot_written_with_digests(run, stdlib_data_dir):
    wd, _, r = run
    saved = jsonio.read_json(os.path.join(r['workdir'], 'feature_scaling.json'))
    assert r['workdir'] == os.path.join(wd, 'corpus_seed0_4096')
    assert saved == jsonio.to_json(r)
    d = saved['digests']  # the corpus and tokenizer the rows came from
    assert d == jsonio.to_json(data_digests(stdlib_data_config(stdlib_data_dir, seq_len=32)))
    assert d['corpus']['name'] == 'specjax_stdlib' and len(d['corpus']['sha256']) == 64
    assert d['tokenizer']['kind'] == 'sentencepiece' and len(d['tokenizer']['sha256']) == 64
    table = open(saved['table']).read()
    assert table.count('\n| ') == 1 + 4  # the header and one row per size
    with open(saved['plot'], 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_rerun_reads_finished_sizes_back(run):
    _, argv, r = run
    again = feature_scaling.main(argv)
    for a, b in zip(r['sizes'], again['sizes'], strict=True):
        assert a == b  # the same figures and the first run's seconds: nothing trained again


def test_size_rows_on_made_up_rows():
    seg = np.zeros((6, 4), np.int32)
    for i, n in enumerate([4, 4, 2, 4, 3, 4]):  # real tokens per row (cumulative 4..21)
        seg[i, :n] = 1
    got = feature_scaling.size_rows({'train_segment_ids': seg}, 16, 3, 2.0)
    assert got == [(1, 4), (2, 8), (5, 17)]


def test_teacher_rows_continue_the_corpus_rows_prompts(run):
    """--rows=teacher in the same workdir: its own row stream (the corpus run's is kept), whose
    rows are the target's continuations of the corpus rows' first documents' prompts."""
    wd, argv, _ = run
    r = feature_scaling.main(argv + ['--rows=teacher', '--sizes=2', '--max_tokens=1024'])
    assert [s['tokens'] for s in r['sizes']] == [512, 1024]  # no eos in the toy: full rows
    with np.load(os.path.join(wd, 'corpus_seed0_4096', 'rows.npz')) as z:
        corpus = {x: z[f'train_{x}'][:32] for x in ('tokens', 'positions', 'segment_ids')}
    with np.load(os.path.join(wd, 'teacher_seed0_1024', 'rows.npz')) as z:
        teacher = z['train_tokens'][:32]
    corpus['domain_ids'] = np.zeros_like(corpus['tokens'])
    prompts, lengths, _ = prompts_from_batch(corpus, 8)  # the tiny preset's prompt_len
    for row, prompt, n in zip(teacher, prompts, lengths, strict=True):
        np.testing.assert_array_equal(row[:n], prompt[:n])
    assert not np.array_equal(teacher, corpus['tokens'])


def test_init_head_trains_beside_the_seeded_sizes_and_keeps_their_json(run):
    """--init_head in the same workdir: its own size workdir and JSON over the same rows and
    cache; the seeded run's JSON is left as it was."""
    wd, argv, r = run
    before = jsonio.read_json(os.path.join(r['workdir'], 'feature_scaling.json'))
    h = feature_scaling.main(argv + ['--init_head', '--sizes=1'])
    (s,) = h['sizes']
    assert h['init_head'] and not r['init_head'] and s['rows'] == r['sizes'][-1]['rows']
    assert s['workdir'] == r['sizes'][-1]['workdir'] + '_init_head'
    saved = jsonio.read_json(os.path.join(r['workdir'], 'feature_scaling_init_head.json'))
    assert saved == jsonio.to_json(h)
    assert jsonio.read_json(os.path.join(r['workdir'], 'feature_scaling.json')) == before
