"""spec_eval mode: end to end on tiny random-init models over the toy dataset; bad inputs raise."""

from __future__ import annotations

import collections
import json
import os

import ml_collections
import numpy as np
import pytest
from data_fixtures import prepare_toy, toy_data_config, toy_documents

from specjax.config_files import join_spec, load_config
from specjax.data import ByteTokenizer
from specjax.evaluation import serving, spec_eval
from specjax.evaluation.pairs import check_identities
from specjax.evaluation.prompts import make_prompts

_CONFIG = os.path.join(os.path.dirname(__file__), '..', 'configs', 'spec_eval.py')


def _load_config(arg):
    return load_config(join_spec(_CONFIG, arg))


@pytest.fixture(scope='module')
def toy_dir(tmp_path_factory):
    return prepare_toy(str(tmp_path_factory.mktemp('toy_tfds')))


def _tiny_config(toy_dir):
    c = _load_config('random')
    c.data = toy_data_config(toy_dir)
    c.data.vocab_size = ByteTokenizer.vocab_size
    for m, d in ((c.model, 32), (c.draft, 16)):
        m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 259, d, 1, 2, 2
        m.d_ff, m.max_len = 2 * d, 64
    c.eval.update(
        prompts_per_domain=2,
        prompt_len_min=4,
        prompt_len_max=12,
        max_new_tokens=8,
        batch_size=4,
        ks=(2,),
        samplings=((0.0, 0, 1.0), (1.0, 0, 1.0)),
        prompt_len_edges=(8,),
        gen_len_edges=(8,),
        calibration_iters=2,
        timing_repeats=1,
        calibration_repeats=1,
    )
    return c


def test_prompts_are_document_prefixes_with_domains(toy_dir):
    c = _tiny_config(toy_dir)
    tok = ByteTokenizer()
    p = make_prompts(c.data, tok, per_domain=2, min_len=4, max_len=12, seed=0)
    assert len(p) == 6 and sorted(set(p.domains)) == ['alpha', 'beta', 'gamma']
    assert p.tokens.shape == (6, 12) and ((p.lengths >= 4) & (p.lengths <= 12)).all()
    assert (p.tokens[:, 0] == tok.bos_id).all()
    docs = toy_documents('validation')
    for row in range(len(p)):
        content, topic = docs[p.docs[row]]
        n = p.lengths[row]
        assert p.tokens[row, 1:n].tolist() == tok.encode(content)[: n - 1]
        assert (p.tokens[row, n:] == 0).all() and p.domains[row] == topic
    batches = list(p.batches(4))
    assert [len(r) for r, _, _ in batches] == [4, 2] and batches[1][1].shape == (4, 12)


def test_spec_eval_end_to_end_writes_json(toy_dir, tmp_path):
    c = _tiny_config(toy_dir)
    result = spec_eval.run(c, str(tmp_path))
    with open(tmp_path / 'spec_eval.json') as f:
        saved = json.load(f)
    assert set(saved) >= {
        'config',
        'models',
        'tokenizer',
        'prompts',
        'calibration',
        'runs',
        'buckets',
        'optimal_k',
        'environment',
        'memory',
    }
    assert saved['calibration']['c'] > 0 and set(saved['calibration']['v']) == {'2'}
    runs = saved['runs']
    assert len(runs) == 2 * (1 + 1)
    spec = [r for r in runs if r['method'] == 'speculative']
    for r in spec:
        for key in (
            'acceptance_rate',
            'accepted_fraction',
            'block_efficiency',
            'alpha',
            'expected_block_efficiency',
            'acceptance_per_position_conditional',
            'time_per_token_s',
            'measured_speedup',
            'predicted_speedup',
            'speedup_ratio',
            'memory',
        ):
            assert key in r, key
        assert r['rows'] == 6 and 6 <= r['generated_tokens'] <= 6 * 8  # eos may stop rows
        assert 1.0 <= r['block_efficiency'] <= r['k'] + 1
        assert r['examined'] <= r['drafted'] and r['accepted'] <= r['examined']
        assert r['memory']['process']['peak_rss_bytes'] > 0
    greedy = [r for r in runs if r['sampling_label'] == 'T=0']
    assert all(r['alpha'] in (None,) or 0 <= r['alpha'] <= 1 for r in greedy)
    domains = {(b['sampling_label'], b['k'], b['domain']) for b in saved['buckets']['domain']}
    assert ('T=0', 2, 'beta') in domains
    assert (
        sum(
            b['rows']
            for b in saved['buckets']['all']
            if b['k'] == 2 and b['sampling_label'] == 'T=0'
        )
        == 6
    )
    with open(tmp_path / 'results.json') as f:
        headline = json.load(f)
    assert headline['T0']['k2']['measured_speedup'] > 0
    assert result['optimal_k']['T=0']['predicted_optimal_k'] == 2


def test_spec_eval_with_the_ngram_draft(toy_dir, tmp_path):
    """draft_kind 'ngram': no draft model (c = 0, no draft workdir), the same runs and tables;
    greedy outputs equal the target's, alpha counts only positions where the lookup proposes."""
    c = _tiny_config(toy_dir)
    c.draft_kind = 'ngram'
    c.ngram.max_n, c.ngram.min_n, c.ngram.proposals_by_n = 2, 1, (1, 2)
    result = spec_eval.run(c, str(tmp_path))
    assert result['calibration']['c'] == 0.0 and result['models']['draft']['kind'] == 'ngram'
    assert result['models']['draft']['proposals_by_n'] == [1, 2]
    greedy = {r['method']: r for r in result['runs'] if r['sampling_label'] == 'T=0'}
    assert greedy['speculative']['drafted'] >= greedy['speculative']['examined'] > 0
    assert 0.0 <= greedy['autoregressive']['alpha'] <= 1.0
    c.ngram.proposals_by_n = ()
    c.ngram.min_n = 3
    with pytest.raises(ValueError, match='config.ngram: NGramDraft.min_n=3 must not exceed'):
        spec_eval.run(c, str(tmp_path / 'bad'))


def test_identity_and_vocab_mismatches_raise(toy_dir, tmp_path):
    ident = ByteTokenizer().identity()
    other = dict(ident, hash='0' * 16)
    check_identities({'tokenizer': ident}, {'tokenizer': ident}, ident)
    with pytest.raises(ValueError, match='tokenizer identity differs.*hash'):
        check_identities({'tokenizer': ident}, {'tokenizer': other}, ident)
    with pytest.raises(ValueError, match='config.data builds tokenizer'):
        check_identities({'tokenizer': other}, {'tokenizer': other}, ident)
    with pytest.raises(ValueError, match='no tokenizer identity'):
        check_identities({'tokenizer': ident}, {}, ident)

    c = _tiny_config(toy_dir)
    c.draft = ml_collections.ConfigDict(dict(c.draft.to_dict(), vocab_size=300))  # unlinked
    with pytest.raises(ValueError, match='draft vocab_size=300'):
        spec_eval.run(c, str(tmp_path))
    c = _tiny_config(toy_dir)
    c.random_init = False
    with pytest.raises(ValueError, match='config.target_workdir is empty'):
        spec_eval.run(c, str(tmp_path))
    c = _tiny_config(toy_dir)
    c.eval.ks = (0, 2)
    with pytest.raises(ValueError, match='config.eval.ks'):
        spec_eval.run(c, str(tmp_path))


@pytest.mark.parametrize(
    'rule, params, match',
    [('nope', {}, 'acceptance rule must be one of'), ('lenient', {'lenience': 2.0}, 'lenience')],
)
def test_bad_acceptance_config_raises_before_compiling(toy_dir, rule, params, match):
    c = _tiny_config(toy_dir)
    c.eval.acceptance = rule
    c.eval.acceptance_params.update(params)
    with pytest.raises(ValueError, match=match):
        spec_eval._check_eval(c.eval)


def test_domains_short_of_documents_are_filled_with_windows(toy_dir):
    # 3 validation documents per topic: 5 prompts per topic need windows of the long ones.
    c = _tiny_config(toy_dir)
    tok = ByteTokenizer()
    p = make_prompts(c.data, tok, per_domain=5, min_len=4, max_len=12, seed=0)
    assert sorted(collections.Counter(p.domains).values()) == [5, 5, 5]
    docs = toy_documents('validation')
    for row in range(len(p)):
        full = [tok.bos_id] + tok.encode(docs[p.docs[row]][0])
        n = p.lengths[row]
        starts = [
            o for o in range(0, len(full), 48) if full[o : o + n] == p.tokens[row, :n].tolist()
        ]
        assert starts, f'prompt {row} is no window of its document'


def test_serving_takes_every_domain_round_robin():
    domains = np.asarray(['code'] * 5 + ['prose'] * 2, dtype=object)
    rows = serving.serve_rows(domains, 6)
    assert rows.tolist() == [0, 5, 1, 6, 2, 3]
    assert [c.tolist() for c in serving._chunks(rows, 4)] == [[0, 5, 1, 6], [2, 3, 2, 2]]
