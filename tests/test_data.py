"""Data layer: corpus pinning and splits, tokenizers, grain pipeline, baselines, config errors."""

from __future__ import annotations

import collections
import json
import pickle
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds
from data_fixtures import (
    TOY_NAME,
    prepare_toy,
    prepared_stdlib_dir,
    stdlib_data_config,
    toy_data_config,
    toy_documents,
)

from specjax.data import (
    ByteTokenizer,
    baseline_losses,
    build_tokenizer,
    corpus_identity,
    make_eval_batches,
    make_train_iterator,
    pipeline,
    stdlib_source,
    tokenized_split,
)
from specjax.data import baselines as bl
from specjax.data import corpus as corpus_lib


@pytest.fixture(scope='module')
def stdlib_cfg():
    return stdlib_data_config(prepared_stdlib_dir())


@pytest.fixture(scope='module')
def toy_dir(tmp_path_factory):
    return prepare_toy(str(tmp_path_factory.mktemp('toy_tfds')))


@pytest.fixture(scope='module')
def spm_tok(stdlib_cfg):
    return build_tokenizer(stdlib_cfg)


@pytest.fixture(scope='module')
def stdlib_docs():
    return stdlib_source.stdlib_documents()


def _records(data_config, split):
    """(source, domain id, text) of a prepared split, read with plain TFDS by name."""
    name, version = corpus_identity(data_config)['full_name'].rsplit('/', 1)
    name = f'{name}:{version}'
    ds = tfds.data_source(name, split=split, data_dir=data_config.data_dir, download=False)
    records = ds.__getitems__(list(range(len(ds))))
    return [(r['source'].decode(), r['domain'], r['text'].decode()) for r in records]


# --- corpus -----------------------------------------------------------------------------------


def test_split_is_deterministic_stratified_and_prepared_as_assigned(stdlib_cfg, stdlib_docs):
    docs = stdlib_docs
    assert {d.source for d in docs if d.domain == 'code'} >= {'os.py', 'asyncio/tasks.py'}
    assert not any(
        d.source.startswith(('test/', 'encodings/')) or '/idle_test/' in d.source for d in docs
    )
    assert 'pydoc_data/topics.py' not in {d.source for d in docs}
    a, b = stdlib_source.assign_splits(docs), stdlib_source.assign_splits(docs[::-1])
    assert a == b
    for domain in stdlib_source.DOMAINS:
        n_val = sum(d.domain == domain for d in a['validation'])
        n_all = sum(d.domain == domain for d in docs)
        assert 1 <= n_val <= 0.05 * n_all + 1
    val_keys = {(d.source, d.domain) for d in a['validation']}
    assert not val_keys & {(d.source, d.domain) for d in a['train']}
    # The prepared dataset (read with plain TFDS, by name) holds exactly that split.
    domain_ids = {name: i for i, name in enumerate(stdlib_source.DOMAINS)}
    val = {(s, d) for s, d, _ in _records(stdlib_cfg, 'validation')}
    assert val == {(s, domain_ids[d]) for s, d in val_keys}
    assert len(_records(stdlib_cfg, 'train')) == len(a['train'])
    ident = corpus_identity(stdlib_cfg)
    assert ident['name'] == 'specjax_stdlib'
    assert ident['manifest_hash'] == stdlib_source.manifest_hash(docs)


def test_manifest_changes_with_content_and_stale_data_is_rejected(
    stdlib_cfg, stdlib_docs, tmp_path
):
    docs = stdlib_docs
    edited = [*docs[:-1], stdlib_source.Document('prose', docs[-1].source, docs[-1].text + '!')]
    assert stdlib_source.manifest_hash(edited) != stdlib_source.manifest_hash(docs)
    assert (
        corpus_lib.StdlibConfig.for_documents(edited).name
        != corpus_lib.StdlibConfig.for_documents(docs).name
    )
    # A prepared folder whose stored manifest disagrees is refused, not silently reused.
    src = corpus_lib.stdlib_builder(stdlib_cfg.data_dir, docs).data_path
    dst = tmp_path / src.relative_to(stdlib_cfg.data_dir)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns('*.array_record*'))
    meta = dst / 'metadata.json'
    meta.write_text(json.dumps({**json.loads(meta.read_text()), 'manifest_hash': 'f' * 64}))
    with pytest.raises(ValueError, match='manifest_hash'):
        corpus_lib.prepare_stdlib(str(tmp_path), docs)


# --- tokenizers -------------------------------------------------------------------------------


def test_sentencepiece_round_trips_every_validation_document(stdlib_cfg, spm_tok):
    assert (spm_tok.pad_id, spm_tok.bos_id, spm_tok.eos_id) == (0, 1, 2)
    assert spm_tok.vocab_size == stdlib_cfg.vocab_size
    records = _records(stdlib_cfg, 'validation')
    assert {d for _, d, _ in records} == {0, 1}  # Both domains.
    texts = [t for _, _, t in records]
    for text, ids in zip(texts, spm_tok.encode_batch(texts)):
        assert spm_tok.decode(ids) == text
    tricky = ['', ' ', '\n\n', '  x\n\tif y:\r\n        pass  \n', 'λ データ 🙂 \x00\x7f', ' lead']
    for text in tricky:
        assert spm_tok.decode(spm_tok.encode(text)) == text
    assert spm_tok.decode([spm_tok.bos_id, *spm_tok.encode('a b'), spm_tok.eos_id, 0]) == 'a b'
    ident = spm_tok.identity()
    assert ident['kind'] == 'sentencepiece' and ident['vocab_size'] == stdlib_cfg.vocab_size


def test_sentencepiece_model_is_cached_and_reused(stdlib_cfg, spm_tok, monkeypatch):
    from specjax.data import tokenizers

    monkeypatch.setattr(tokenizers, 'train_sentencepiece', lambda *a, **k: 1 / 0)
    again = build_tokenizer(stdlib_cfg)
    assert again.identity() == spm_tok.identity()
    assert pickle.loads(pickle.dumps(again)).identity() == spm_tok.identity()
    path = tokenizers.sentencepiece_model_path(
        pipeline.sources.open_dataset(stdlib_cfg), stdlib_cfg.vocab_size
    )
    assert path.exists() and corpus_identity(stdlib_cfg)['manifest_hash'][:12] in path.name


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 0, 1, 2)
    text = 'def f(x):\n\treturn "λ🙂"\r\n'
    ids = tok.encode(text)
    assert min(ids) >= 3 and max(ids) < 259 and len(ids) == len(text.encode())
    assert tok.decode([1, *ids, 2, 0, 0]) == text
    assert tok.decode(np.asarray(ids)) == text
    assert tok.decode([0xFF + 3]) == '\ufffd'
    assert tok.identity() == ByteTokenizer().identity()


# --- pipeline ---------------------------------------------------------------------------------


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for x, y in zip(batches_a, batches_b):
        for k in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k])


def test_train_stream_is_deterministic_per_seed(stdlib_cfg, spm_tok):
    a = _take(make_train_iterator(stdlib_cfg, spm_tok, global_batch_size=8, seed=3), 3)
    b = _take(make_train_iterator(stdlib_cfg, spm_tok, global_batch_size=8, seed=3), 3)
    c = _take(make_train_iterator(stdlib_cfg, spm_tok, global_batch_size=8, seed=4), 1)
    _assert_same(a, b)
    assert not np.array_equal(a[0]['tokens'], c[0]['tokens'])
    assert set(a[0]) == set(pipeline.BATCH_KEYS)
    assert all(v.shape == (8, stdlib_cfg.seq_len) and v.dtype == np.int32 for v in a[0].values())


def test_documents_shard_disjointly_and_reshuffle_per_epoch(stdlib_cfg, spm_tok):
    n = len(tokenized_split(stdlib_cfg, spm_tok, 'train'))
    count = 3
    shards = []
    for p in range(count):
        docs = pipeline.train_documents(
            stdlib_cfg, spm_tok, seed=7, process_index=p, process_count=count
        )
        shards.append([docs[i]['doc'] for i in range(len(range(p, n, count)))])
    flat = [d for s in shards for d in s]
    assert len(flat) == len(set(flat)) == n  # Disjoint, and together one full epoch.
    one = pipeline.train_documents(stdlib_cfg, spm_tok, seed=7, process_index=0, process_count=1)
    epoch0, epoch1 = [one[i]['doc'] for i in range(n)], [one[i]['doc'] for i in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n)) and epoch0 != epoch1
    local = make_train_iterator(
        stdlib_cfg, spm_tok, global_batch_size=6, seed=7, process_index=1, process_count=3
    )
    assert next(local)['tokens'].shape == (2, stdlib_cfg.seq_len)
    with pytest.raises(ValueError, match='global_batch_size=8'):
        make_train_iterator(
            stdlib_cfg, spm_tok, global_batch_size=8, seed=0, process_count=3, process_index=0
        )


def _segments(batches):
    """Every packed segment as a tuple of tokens; checks row invariants on the way."""
    out = []
    for b in batches:
        for tok, seg, pos, dom in zip(
            b['tokens'], b['segment_ids'], b['positions'], b['domain_ids']
        ):
            pad = seg == 0
            assert (tok[pad] == 0).all() and (dom[pad] == -1).all() and (pos[pad] == 0).all()
            assert (dom[~pad] >= 0).all()
            ids = seg[~pad]
            assert (np.diff(ids) >= 0).all() and (ids[0] == 1 if len(ids) else True)
            for s in np.unique(ids):
                (where,) = np.nonzero(seg == s)
                assert (np.diff(where) == 1).all()  # Contiguous.
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                assert len(set(dom[where])) == 1
                out.append(tuple(tok[where]))
    return out


def test_packing_invariants_and_no_token_lost(stdlib_cfg, spm_tok):
    split = tokenized_split(stdlib_cfg, spm_tok, 'validation')
    seq_len = stdlib_cfg.seq_len
    batches = make_eval_batches(stdlib_cfg, spm_tok, global_batch_size=16)
    expected = collections.Counter(
        tuple(split[i]['tokens'][a : a + seq_len])
        for i in range(len(split))
        for a in range(0, len(split[i]['tokens']), seq_len)
    )
    assert collections.Counter(_segments(batches)) == expected
    assert sum(int((b['segment_ids'] > 0).sum()) for b in batches) == split.num_tokens()
    train = _take(make_train_iterator(stdlib_cfg, spm_tok, global_batch_size=16, seed=0), 4)
    segs = _segments(train)
    assert max(len(s) for s in segs) == seq_len and any(s[0] == spm_tok.bos_id for s in segs)
    fill = np.mean([(b['segment_ids'] > 0).mean() for b in train])
    assert fill > 0.9, fill


def test_state_round_trips_through_json_and_resumes_exactly(stdlib_cfg, spm_tok):
    it = make_train_iterator(stdlib_cfg, spm_tok, global_batch_size=4, seed=11)
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 6)
    resumed = make_train_iterator(stdlib_cfg, spm_tok, global_batch_size=4, seed=11)
    resumed.set_state(state)
    _assert_same(_take(resumed, 6), expected)


def test_eval_batches_are_deterministic_finite_and_split_by_process(stdlib_cfg, spm_tok):
    full = make_eval_batches(stdlib_cfg, spm_tok, global_batch_size=8)
    _assert_same(full, make_eval_batches(stdlib_cfg, spm_tok, global_batch_size=8))
    capped = make_eval_batches(stdlib_cfg, spm_tok, global_batch_size=8, max_batches=2)
    assert len(capped) == 2
    # Domains are interleaved, so even a capped evaluation sees both code (0) and prose (1).
    assert {0, 1} <= set(np.unique(np.concatenate([b['domain_ids'] for b in capped])))
    last = full[-1]
    assert last['tokens'].shape == (8, stdlib_cfg.seq_len)
    halves = [
        make_eval_batches(
            stdlib_cfg,
            spm_tok,
            global_batch_size=8,
            max_batches=3,
            process_index=p,
            process_count=2,
        )
        for p in range(2)
    ]
    for i in range(3):
        for k in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(
                np.concatenate([halves[0][i][k], halves[1][i][k]]), full[i][k]
            )


# --- other datasets, config errors ------------------------------------------------------------


def test_other_prepared_dataset_works_by_name_and_text_feature(toy_dir):
    cfg = toy_data_config(toy_dir)
    tok = build_tokenizer(cfg)
    batches = make_eval_batches(cfg, tok, global_batch_size=4, process_index=0, process_count=1)
    texts = collections.Counter(
        tok.decode(s) for s in _segments(batches) if s[0] == tok.bos_id and s[-1] == tok.eos_id
    )
    docs = toy_documents('validation')
    short = [c for c, _ in docs if len(c.encode()) + 2 <= cfg.seq_len]
    assert short and all(texts[c] >= 1 for c in short)
    domains = {int(d) for b in batches for d in np.unique(b['domain_ids'])} - {-1}
    assert domains == {0, 1, 2}
    it = make_train_iterator(
        cfg, tok, global_batch_size=4, seed=0, process_index=0, process_count=1
    )
    assert next(it)['tokens'].shape == (4, 64)
    ident = corpus_identity(cfg)
    assert ident['name'] == TOY_NAME and len(ident['manifest_hash']) == 64
    on_the_fly = toy_data_config(toy_dir, cache_tokens=False, read_threads=2)
    _assert_same(
        batches,
        make_eval_batches(on_the_fly, tok, global_batch_size=4, process_index=0, process_count=1),
    )
    no_domain = toy_data_config(toy_dir, domain_feature=None)
    b = make_eval_batches(
        no_domain, tok, global_batch_size=4, max_batches=1, process_index=0, process_count=1
    )[0]
    assert set(np.unique(b['domain_ids'])) <= {-1, 0}


@pytest.mark.parametrize(
    'overrides, field',
    [
        ({'name': 'no_such_dataset_xyz'}, "config.data.name='no_such_dataset_xyz'"),
        ({'text_feature': 'body'}, "config.data.text_feature='body'"),
        ({'domain_feature': 'nope'}, "config.data.domain_feature='nope'"),
        ({'domain_feature': 'length'}, "config.data.domain_feature='length'"),
        ({'eval_split': 'test'}, "config.data.eval_split='test'"),
        ({'tokenizer': 'wordpiece'}, 'config.data.tokenizer must be one of'),
        ({'seq_len': 1}, 'config.data.seq_len'),
        ({'tokenizer': 'sentencepiece', 'vocab_size': 100}, 'config.data.vocab_size'),
    ],
)
def test_bad_config_raises_value_error_naming_field(toy_dir, overrides, field):
    cfg = toy_data_config(toy_dir, **overrides)
    with pytest.raises(ValueError, match=field.replace('(', r'\(')):
        build_tokenizer(cfg)


# --- baselines --------------------------------------------------------------------------------


def test_bigram_is_normalised_and_beats_unigram(stdlib_cfg, spm_tok):
    v = 5
    prev, nxt = np.array([0, 0, 1, 2, 2, 2]), np.array([1, 1, 2, 0, 3, 3])
    counts = bl.fit_counts(prev, nxt, v)
    for ctx in range(v):
        p = [
            np.exp(-bl.cross_entropies(counts, np.array([ctx]), np.array([w]))['bigram'])
            for w in range(v)
        ]
        np.testing.assert_allclose(sum(p), 1.0, rtol=1e-12)
    losses = baseline_losses(stdlib_cfg, spm_tok)
    assert 0 < losses['bigram'] < losses['unigram'] < np.log(spm_tok.vocab_size)
    batches = make_eval_batches(stdlib_cfg, spm_tok, global_batch_size=16)
    on_batches = baseline_losses(stdlib_cfg, spm_tok, batches)
    assert on_batches['num_targets'] == losses['num_targets']
    np.testing.assert_allclose(on_batches['bigram'], losses['bigram'], rtol=1e-9)
