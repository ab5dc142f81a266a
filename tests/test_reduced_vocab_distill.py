"""Reduced-vocabulary distillation (specjax.distill.reduced_vocab / reduced_train): the losses
against numpy on a tiny random teacher, with negative controls; a trained reduced draft serves
exactly (greedy speculative output = the target's). The SmolLM2 preset's config checks are in
tests/test_quickstart_presets.py."""

from __future__ import annotations

import json
import os

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from specjax.distill import reduced_train as rt
from specjax.distill import reduced_vocab as rv
from specjax.models import Transformer, TransformerConfig, apply, split

V, N, K, T = 40, 12, 4, 10


def _model(vocab, seed, max_len=32):
    cfg = TransformerConfig(
        vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
        max_len=max_len,
    )  # fmt: skip
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope='module')
def setup():
    rng = np.random.default_rng(0)
    teacher = _model(V, 1)
    tokens = rng.integers(0, V, (3, T)).astype(np.int32)
    counts = np.bincount(rng.integers(0, V, 500), minlength=V)
    ids = rv.top_ids(counts, N)
    t_logits = np.asarray(apply(*split(teacher), tokens)) * 3.0  # sharper than at init
    d_logits = rng.normal(size=(3, T, N)).astype(np.float32)
    return dict(teacher=teacher, tokens=tokens, counts=counts, ids=ids, t=t_logits, d=d_logits)


def test_top_ids_and_counts():
    counts = np.array([3, 9, 9, 0, 5])
    np.testing.assert_array_equal(rv.top_ids(counts, 3), [1, 2, 4])  # ties: smaller id first
    c = rv.corpus_counts(np.array([1, 1, 4]), np.array([0, 2, 3]), 5, bos_id=0, eos_id=3)
    np.testing.assert_array_equal(c, [2, 2, 0, 2, 1])  # bos and eos once per document


def test_kd_loss_is_fkl_to_the_renormalised_top_k_of_the_set(setup):
    """KD = FKL(p~ || q), p~ = teacher softmax over V, restricted to the top K of the N ids,
    renormalised there (numpy reference); two wrong restrictions give other values."""
    ids, t, d = setup['ids'], setup['t'], setup['d']
    idx, logp = jax.device_get(rv.teacher_topk(t, ids, K))
    mask = np.ones((3, T), bool)
    mask[0, :3] = False
    got = float(rv.kd_loss(d, idx, logp, mask))

    p_full = np.exp(_np_log_softmax(t.astype(np.float64)))[..., ids]  # [B, T, N], full-V norm
    top = np.argsort(-p_full, -1, kind='stable')[..., :K]
    np.testing.assert_array_equal(np.sort(idx, -1), np.sort(top, -1))
    p_top = np.take_along_axis(p_full, top, -1)
    p_tilde = p_top / p_top.sum(-1, keepdims=True)
    logq = np.take_along_axis(_np_log_softmax(d.astype(np.float64)), top, -1)
    ref_BT = (p_tilde * (np.log(p_tilde) - logq)).sum(-1)
    ref = ref_BT[mask].mean()
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    # negative controls: no renormalisation, or renormalising over the whole N-set
    unnorm = (p_top * (np.log(p_top) - logq)).sum(-1)[mask].mean()
    p_set = p_full / p_full.sum(-1, keepdims=True)
    logq_all = _np_log_softmax(d.astype(np.float64))
    whole_set = (p_set * (np.log(p_set) - logq_all)).sum(-1)[mask].mean()
    assert abs(got - unnorm) > 1e-3 and abs(got - whole_set) > 1e-3
    assert float(rv.kd_loss(d, idx, logp, np.zeros_like(mask))) == 0.0


def test_kd_loss_takes_any_divergence_over_the_restricted_teacher(setup):
    """kd_loss(divergence='tvd') is 1 - sum min(p~, q) over the N ids (numpy), p~ zero off the
    top K; 'fkl' is the default; jsd lies strictly between 0 and FKL's value; an unknown name
    is refused by train_draft naming config.loss.divergence."""
    ids, t, d = setup['ids'], setup['t'], setup['d']
    idx, logp = jax.device_get(rv.teacher_topk(t, ids, K))
    mask = np.ones((3, T), bool)
    p_full = np.exp(_np_log_softmax(t.astype(np.float64)))[..., ids]
    p_tilde = np.zeros_like(p_full)
    np.put_along_axis(p_tilde, idx, np.take_along_axis(p_full, idx, -1), -1)
    p_tilde /= p_tilde.sum(-1, keepdims=True)
    q = np.exp(_np_log_softmax(d.astype(np.float64)))
    tvd_ref = (1 - np.minimum(p_tilde, q).sum(-1)).mean()
    assert float(rv.kd_loss(d, idx, logp, mask, 'tvd')) == pytest.approx(tvd_ref, rel=1e-4)
    fkl = float(rv.kd_loss(d, idx, logp, mask))
    assert fkl == pytest.approx(float(rv.kd_loss(d, idx, logp, mask, 'fkl')))
    assert 0 < float(rv.kd_loss(d, idx, logp, mask, 'jsd')) < fkl
    np.testing.assert_allclose(
        np.asarray(jax.nn.softmax(rv.restricted_teacher_logits(idx, logp, N))), p_tilde, atol=1e-6
    )
    grads = jax.grad(lambda x: rv.kd_loss(x, idx, logp, mask, 'jsd'))(d)
    assert np.isfinite(np.asarray(grads)).all()  # zero teacher mass off the top K: no NaN


def test_ce_loss_masks_targets_outside_the_set(setup):
    ids, d = setup['ids'], setup['d']
    table = rv.index_table(ids, V)
    targets = setup['tokens']
    target_idx = table[targets]
    assert (target_idx < 0).any() and (target_idx >= 0).any()  # both kinds present
    mask = np.ones((3, T), bool)
    loss, count = jax.device_get(rv.ce_loss(d, target_idx, mask))
    logq = _np_log_softmax(d.astype(np.float64))
    valid = target_idx >= 0
    ref = -np.take_along_axis(logq, np.maximum(target_idx, 0)[..., None], -1)[..., 0][valid]
    assert count == valid.sum()
    assert float(loss) == pytest.approx(ref.mean(), rel=1e-5)


def test_alpha_terms_match_numpy(setup):
    ids, t, d = setup['ids'], setup['t'], setup['d']
    logp_N, argmax = jax.device_get(rv.teacher_on_set(t, ids))
    mask = np.ones((3, T), bool)
    a1, a0, n = jax.device_get(rv.alpha_terms(d, logp_N, argmax, ids, mask))
    p = np.exp(_np_log_softmax(t.astype(np.float64)))
    q_full = np.zeros_like(p)
    q_full[..., ids] = np.exp(_np_log_softmax(d.astype(np.float64)))
    assert float(a1) == pytest.approx(np.minimum(p, q_full).sum(-1).sum(), rel=1e-4)
    assert float(a0) == (q_full.argmax(-1) == p.argmax(-1)).sum()
    assert n == 3 * T


def test_bad_reduced_vocab_size_is_a_clear_error(setup):
    with pytest.raises(ValueError, match=r'config.teacher_cache.reduced_vocab_size=41 .*\[1, 40\]'):
        rv.top_ids(setup['counts'], 41, 'config.teacher_cache.reduced_vocab_size')
    with pytest.raises(ValueError, match='must be an int'):
        rv.top_ids(setup['counts'], 0)


def _cache(setup, tmp_path):
    """A teacher cache of the tiny teacher over random packed rows (two documents per row)."""
    rng = np.random.default_rng(1)
    ids = setup['ids']
    graphdef, params = split(setup['teacher'])
    seg = np.repeat(np.array([[1] * (T // 2) + [2] * (T // 2)]), 8, 0).astype(np.int32)
    pos = np.tile(np.arange(T // 2), 2)[None].repeat(8, 0).astype(np.int32)

    def batches(n):
        for _ in range(n):
            yield {
                'tokens': rng.integers(0, V, (4, T)),
                'positions': pos[:4],
                'segment_ids': seg[:4],
            }

    rt._teacher_program.cache_clear()  # other tests' rows have other shapes
    arrays = rt.teacher_arrays(graphdef, params, list(batches(2)), ids, K, 'train')
    arrays.update(rt.teacher_arrays(graphdef, params, list(batches(1)), ids, K, 'eval'))
    # train and eval rows of one shape run one compiled teacher program
    assert rt._teacher_program(graphdef, tuple(ids.tolist()), K)._cache_size() == 1
    vocab = {'ids': ids.tolist(), 'target_vocab_size': V}
    rt.save_cache(str(tmp_path / 'cache'), vocab, arrays)
    return str(tmp_path / 'cache')


class _StubTokenizer:
    """What train_draft's saved workdir needs of a tokenizer: an identity and save()."""

    def identity(self):
        return {'kind': 'stub', 'vocab_size': V}

    def save(self, workdir):
        pass


def _draft_config(kd, ce, steps=20):
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.draft = dict(vocab_size=N, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                   max_len=32)  # fmt: skip
    c.train = dict(steps=steps, batch_size=4, lr=1e-2, warmup_steps=2, eval_every=10)
    c.loss = dict(kd_weight=kd, ce_weight=ce)
    return c


def test_train_draft_learns_and_serves_exactly(setup, tmp_path):
    """Distilling onto the reduced vocabulary raises held-out alpha; the saved draft (vocab N,
    draft_vocab.json) decodes greedily with the target exactly as the target alone."""
    from specjax.checkpoint import load_model
    from specjax.sampling import SamplingConfig, autoregressive_sample, speculative_sample

    cache = _cache(setup, tmp_path)
    wd = str(tmp_path / 'draft')
    res = rt.train_draft(_draft_config(1.0, 0.0), cache, _StubTokenizer(), wd)
    rows = [json.loads(line) for line in open(os.path.join(wd, 'metrics.jsonl'))]
    evals, train = ([r for r in rows if r['split'] == s] for s in ('eval', 'train'))
    assert [r['step'] for r in evals] == [r['step'] for r in train] == [10, 20]
    assert train[-1]['kd'] < train[0]['kd'] and res['alpha_T1'] == evals[-1]['alpha_T1'] > 0
    with open(os.path.join(wd, rt.DRAFT_VOCAB_FILE)) as f:
        ids = json.load(f)['ids']
    assert ids == setup['ids'].tolist()
    draft, _ = load_model(wd)
    assert draft.config.vocab_size == N
    prompts = setup['tokens'][:, :4]
    lengths = np.full((3,), 4, np.int32)
    kw = dict(max_new_tokens=6, sampling=SamplingConfig(0.0), rng=jax.random.key(0))
    spec = speculative_sample(
        setup['teacher'], draft, prompts, lengths, num_draft_tokens=2, draft_vocab_ids=ids, **kw
    )
    ar = autoregressive_sample(setup['teacher'], prompts, lengths, **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    with pytest.raises(ValueError, match=r'config.draft.vocab_size=13 must equal .* 12'):
        c = _draft_config(1.0, 0.0)
        c.draft.vocab_size = 13
        rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'bad'))


def test_draft_from_the_target_is_its_early_exit_on_the_set(setup, tmp_path):
    """config.init=target: before training, the draft's logits on in-set contexts are the
    target's first-layer early exit restricted to the ids; a shape that differs is refused."""
    from specjax.models.early_exit import early_exit_draft
    from specjax.models.layout import to_layout

    teacher, ids = setup['teacher'], setup['ids']
    cfg = TransformerConfig(**dict(teacher.config.to_dict(), vocab_size=N))
    graphdef, params = rt.restricted_early_exit(teacher, ids, cfg)
    tokens = ids[np.random.default_rng(2).integers(0, N, (2, 6))]
    table = rv.index_table(ids, V)
    mine = np.asarray(apply(graphdef, params, table[tokens]))
    ref = np.asarray(early_exit_draft(teacher, 1)(tokens))[..., ids]
    np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-5)
    # a target imported with stacked blocks (scan_layers) gives the same unstacked draft
    _, from_scanned = rt.restricted_early_exit(to_layout(teacher, True), ids, cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(from_scanned), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r'config.draft.d_model=8 must equal .* 16'):
        rt.restricted_early_exit(teacher, ids, TransformerConfig(**dict(cfg.to_dict(), d_model=8)))
    c, cache = _draft_config(1.0, 0.0, steps=2), _cache(setup, tmp_path)
    c.init = 'target'
    with pytest.raises(ValueError, match='needs the target model'):
        rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'd'))
    c.init = 'pretrained'
    with pytest.raises(ValueError, match="config.init must be 'random' or 'target'"):
        rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'd'))


def test_report_says_how_the_drafts_started():
    from specjax.quickstart.report import section_reduced_vocab

    cache = dict(reduced_vocab_size=N, coverage_train=0.9, train_rows=8, seq_len=T, top_k=K,
                 teacher_train_seconds=1.0, topk_mass_mean=0.8)  # fmt: skip
    for init, says in (('target', "the target's first 2 layer(s)"), ('random', 'random init')):
        draft = dict(init=init, draft_layers=2, num_params_draft=123)
        text = '\n'.join(section_reduced_vocab({'teacher_cache': cache, 'draft_distilled': draft}))
        assert says in text and '123 parameters' in text
    assert 'start from' not in '\n'.join(section_reduced_vocab({'teacher_cache': cache}))
    assert 'teacher-forced on 8 packed rows' in '\n'.join(
        section_reduced_vocab({'teacher_cache': cache})
    )
    gen = dict(cache, source='teacher', prompt_len=3, temperatures=[1.0, 0.0], generated_tokens=40,
               generated_in_set=0.75, teacher_generate_seconds=0.5)  # fmt: skip
    text = '\n'.join(section_reduced_vocab({'teacher_cache': gen}))
    assert 'continued the first (at most) 3 tokens of 8 corpus rows at T = 1 and 0' in text
    assert '40 generated, 0.75 of them in the set' in text


def test_teacher_continuations_are_its_samples_and_each_draft_trains_on_its_rows(setup, tmp_path):
    """teacher_continuations: each row is its first document's prompt then exactly what the
    autoregressive sampler gives with batch i's key (another seed: other tokens); a draft with
    rows='corpus' trains on the corpus rows, and bad rows settings are clear errors."""
    from specjax.sampling import SamplingConfig, autoregressive_sample

    teacher, ids = setup['teacher'], setup['ids']
    graphdef, params = split(teacher)
    rng = np.random.default_rng(3)
    seg = np.array([[1] * 5 + [2] * 5, [1] * 2 + [2] * 8] * 2, np.int32)
    batch = {
        'tokens': rng.integers(0, V, (4, T)).astype(np.int32),
        'segment_ids': seg,
        'positions': np.zeros((4, T), np.int32),
        'domain_ids': np.zeros((4, T), np.int32),
    }
    kw = dict(prompt_len=3, max_new_tokens=5, temperatures=(1.0, 0.0), eos_id=None)
    rows = rt.teacher_continuations(graphdef, params, [batch, batch], seed=7, **kw)
    lengths = np.array([3, 2, 3, 2], np.int32)
    for i, r in enumerate(rows):
        assert r['tokens'].shape == (4, 8)
        key = jax.random.fold_in(jax.random.key(7), i)
        ref = autoregressive_sample(
            teacher, np.where(np.arange(3) < lengths[:, None], batch['tokens'][:, :3], 0),
            lengths, max_new_tokens=5, sampling=SamplingConfig((1.0, 0.0)[i]), rng=key,
        )  # fmt: skip
        for b in range(4):
            p = lengths[b]
            np.testing.assert_array_equal(r['tokens'][b, :p], batch['tokens'][b, :p])
            np.testing.assert_array_equal(r['tokens'][b, p : p + 5], np.asarray(ref.tokens)[b])
            np.testing.assert_array_equal(r['segment_ids'][b], [1] * (p + 5) + [0] * (3 - p))
            np.testing.assert_array_equal(r['positions'][b], np.arange(8))
    assert not np.array_equal(rows[0]['tokens'], rows[1]['tokens'])  # T = 1, then greedy
    other = rt.teacher_continuations(graphdef, params, [batch], seed=8, **kw)
    assert not np.array_equal(other[0]['tokens'], rows[0]['tokens'])  # negative control

    arrays = rt.teacher_arrays(graphdef, params, rows, ids, K, 'train')
    arrays.update({f'corpus_{x}': np.concatenate([batch[x]] * 2) for x in rt.BATCH3})
    arrays['corpus_positions'] = np.tile(np.arange(T, dtype=np.int32), (8, 1))
    evals = [{x: batch[x] for x in rt.BATCH3}]
    arrays.update(rt.teacher_arrays(graphdef, params, evals, ids, K, 'eval'))
    cache = str(tmp_path / 'gen_cache')
    rt.save_cache(cache, {'ids': ids.tolist(), 'target_vocab_size': V}, arrays)
    c = _draft_config(0.0, 1.0, steps=3)
    c.rows = 'corpus'
    res = rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'ce'))
    assert res['rows'] == 'corpus' and res['tokens_seen'] == 3 * 4 * T  # corpus rows: T wide
    c = _draft_config(1.0, 0.0, steps=3)
    res = rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'kd'))
    assert res['rows'] == 'teacher' and res['tokens_seen'] == 3 * 4 * 8  # the teacher's rows
    c.rows = 'corpus'
    with pytest.raises(ValueError, match=r"kd_weight=1.0 needs the teacher's outputs"):
        rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'bad'))
    c.rows, c.loss.divergence = 'teacher', 'kl'
    with pytest.raises(ValueError, match=r"config.loss.divergence='kl' must be one of"):
        rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'bad'))
    c.rows, c.loss.divergence = 'generated', 'fkl'
    with pytest.raises(ValueError, match=r"config.rows must be one of \['corpus', 'teacher'\]"):
        rt.train_draft(c, cache, _StubTokenizer(), str(tmp_path / 'bad'))
    c = _draft_config(0.0, 1.0, steps=3)
    c.rows = 'corpus'
    with pytest.raises(ValueError, match=r'has no corpus_\* rows'):
        rt.train_draft(c, _cache(setup, tmp_path), _StubTokenizer(), str(tmp_path / 'bad'))
