"""Reproducible inputs: the corpus prepared twice gives the same records, tokenizer and token
streams (the same digests), whatever the thread count; results.json records the digests."""

from __future__ import annotations

import json
import pathlib
import types

import ml_collections
import numpy as np
import pytest
from data_fixtures import prepare_toy, stdlib_data_config, toy_data_config

from specjax.data import (
    build_tokenizer,
    data_digests,
    digests,
    make_eval_batches,
    open_dataset,
    stdlib_source,
    tokenizers,
)
from specjax.workdir import write_results


def _kept(ds) -> pathlib.Path:
    return pathlib.Path(str(ds.builder.data_dir)) / digests.DIGEST_FILE


def _prepare(data_dir, threads, monkeypatch):
    """config.data of the stdlib corpus prepared into `data_dir` (a fresh folder) and its
    tokenizer trained there with `threads` threads, as on a machine with that many cores."""
    monkeypatch.setattr(tokenizers, '_num_threads', lambda: threads)
    cfg = stdlib_data_config(str(data_dir))
    return cfg, data_digests(cfg)


def test_preparing_the_corpus_twice_gives_the_same_digests(tmp_path, monkeypatch):
    cfg_a, a = _prepare(tmp_path / 'a', 1, monkeypatch)
    cfg_b, b = _prepare(tmp_path / 'b', 2, monkeypatch)
    assert a == b  # records in the same order, the same tokenizer
    corpus, tok = a['corpus'], a['tokenizer']
    assert set(corpus['splits']) == {'train', 'validation'} and len(corpus['sha256']) == 64
    assert corpus['splits']['train']['sha256'] != corpus['splits']['validation']['sha256']
    assert tok['kind'] == 'sentencepiece' and tok['vocab_size'] == cfg_a.vocab_size
    tok_a, tok_b = build_tokenizer(cfg_a), build_tokenizer(cfg_b)
    assert tok_a.model_proto == tok_b.model_proto  # the thread count is not in the model
    assert tok_a.identity() == tok_b.identity() and tok_a.digest() == tok['sha256']
    eval_a, eval_b = (
        make_eval_batches(cfg, t, global_batch_size=4, max_batches=3, process_index=0,
                          process_count=1)
        for cfg, t in ((cfg_a, tok_a), (cfg_b, tok_b))
    )  # fmt: skip
    for x, y in zip(eval_a, eval_b, strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    # Kept in the prepared folder and read from there (not recomputed) while it is current.
    ds = open_dataset(cfg_a)
    kept = json.loads(_kept(ds).read_text())
    assert kept['sha256'] == corpus['sha256'] and str(tmp_path / 'a') in str(_kept(ds))
    monkeypatch.setattr(digests, 'split_records_digest', lambda *a: pytest.fail('recomputed'))
    assert digests.corpus_digest(ds)['sha256'] == corpus['sha256']


def test_sentencepiece_digest_ignores_the_recorded_thread_count(tmp_path, monkeypatch):
    from sentencepiece import sentencepiece_model_pb2

    texts = [f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(300)]
    proto = tokenizers.train_sentencepiece(texts, 300)
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    assert not model.trainer_spec.HasField('num_threads')
    model.trainer_spec.num_threads = 8  # as models trained before the thread count was dropped
    old = tokenizers.SentencePieceTokenizer(model.SerializeToString())
    new = tokenizers.SentencePieceTokenizer(proto)
    assert old.identity()['hash'] != new.identity()['hash']  # identities recorded stay valid
    assert old.digest() == new.digest() and new.identity()['hash'] == new.digest()[:16]


def test_records_digest_depends_on_content_and_order():
    class Source(list):  # as_data_source's interface: len() and __getitems__
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    def digest(records):
        builder = types.SimpleNamespace(as_data_source=lambda split: Source(records))
        return digests.split_records_digest(types.SimpleNamespace(builder=builder), 'train')

    a = {'text': b'ab', 'domain': np.int64(0)}
    b = {'text': b'', 'domain': np.int64(1)}
    base = digest([a, b])
    assert base == digest([dict(a), dict(b)]) and base[0] == 2
    assert base != digest([b, a])  # order
    assert base != digest([{'text': b'a', 'domain': np.int64(0)}, b])  # content
    assert base != digest([{'text': b'a', 'domain': np.int64(0)}, {**b, 'text': b'b'}])
    assert base != digest([{**a, 'domain': np.int32(0)}, b])  # dtype
    assert digest([{'text': 'ab'}]) == digest([{'text': b'ab'}])  # str and bytes alike


def test_a_stale_kept_digest_is_recomputed(tmp_path):
    cfg = toy_data_config(prepare_toy(str(tmp_path)))
    ds = open_dataset(cfg)
    first = digests.corpus_digest(ds)
    path = _kept(ds)
    kept = json.loads(path.read_text())
    kept['splits']['train']['records'] += 1  # not the dataset's any more
    path.write_text(json.dumps(kept))
    assert digests.corpus_digest(ds) == first
    assert json.loads(path.read_text())['splits']['train']['records'] == len(
        ds.builder.as_data_source('train')
    )


def test_stdlib_selection_leaves_out_install_specific_files(tmp_path):
    files = {
        'os.py': 'import abc\n',
        'json/__init__.py': '"""json"""\n',
        '_sysconfigdata__linux_x86_64-linux-gnu.py': "build_time_vars = {'prefix': '/x'}\n",
        'config-3.11-x86_64-linux-gnu/python-config.py': '#!/x/bin/python3.11\n',
        'sitecustomize.py': 'import site\n',
        'test/test_os.py': 'pass\n',
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    docs = stdlib_source.code_documents(tmp_path)
    assert [d.source for d in docs] == ['json/__init__.py', 'os.py']


def test_results_json_carries_the_digests_of_what_the_run_read(tmp_path):
    data = toy_data_config(prepare_toy(str(tmp_path / 'tfds')))
    expected = json.loads(json.dumps(data_digests(data)))  # opened and built here, as a run does
    config = ml_collections.ConfigDict({'mode': 'pretrain', 'seed': 0, 'data': data.to_dict()})
    path = write_results(str(tmp_path / 'run'), 'pretrain', {'step': 1}, config)
    recorded = json.loads(open(path).read())['digests']
    assert recorded == expected and len(recorded['corpus']['sha256']) == 64
    assert recorded['tokenizer'] == {
        'kind': 'byte',
        'vocab_size': 259,
        'sha256': tokenizers.ByteTokenizer().digest(),
    }
    # Data this process did not read (another data_dir) and a config without data: None, and
    # nothing is prepared or trained for them.
    config.data.data_dir = str(tmp_path / 'elsewhere')
    path = write_results(str(tmp_path / 'other'), 'pretrain', {'step': 1}, config)
    assert json.loads(open(path).read())['digests'] == {'corpus': None, 'tokenizer': None}
    assert not (tmp_path / 'elsewhere').exists()
    mesh = ml_collections.ConfigDict({'shape': (1,)})
    path = write_results(str(tmp_path / 'selfcheck'), 'selfcheck', {}, mesh)
    assert json.loads(open(path).read())['digests'] == {'corpus': None, 'tokenizer': None}
    given = {'corpus': None, 'tokenizer': {'kind': 'huggingface', 'sha256': 'f' * 64}}
    path = write_results(str(tmp_path / 'import'), 'import', {'digests': given}, mesh)
    assert json.loads(open(path).read())['digests'] == given  # a mode's own record is kept


def test_an_import_records_its_tokenizer_and_no_corpus(tmp_path):
    from gguf_fixtures import write_tiny_gguf

    from specjax.data import HuggingFaceTokenizer
    from specjax.interop.workdir import import_workdir

    source = write_tiny_gguf(str(tmp_path / 'tiny.gguf'))
    summary = import_workdir(f'gguf:{source}', str(tmp_path / 'wd'))
    tok = HuggingFaceTokenizer.from_file(str(tmp_path / 'wd'))
    assert summary['digests'] == {'corpus': None, 'tokenizer': digests.tokenizer_digest(tok)}
    assert summary['digests']['tokenizer']['sha256'][:16] == tok.identity()['hash']
