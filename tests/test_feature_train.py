"""The feature_draft mode (specjax.distill.feature_ttt / feature_mode): the training-time-test
unroll equals a step-by-step rollout with the draft's cached decode (true-feature prefix, then
self-fed single steps), packed documents included, and (values and gradients) the unroll that
recomputes every earlier block instead of reusing its keys and values; a few steps against a
tiny target (its own continuations of data prompts, a reduced vocabulary) lower the loss and
leave a workdir that load_feature_draft reads back (embedding still the target's); a run stopped
by SIGTERM resumes bit-identically; a bad config is refused naming the field before anything
compiles."""

from __future__ import annotations

import json
import os
import signal

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from distill_data import Batches
from flax import nnx

from specjax.checkpoint import write_workdir
from specjax.distill import feature_mode as fm
from specjax.distill import feature_ttt as ttt
from specjax.distill.config import default_feature_config, default_feature_distill_config
from specjax.distill.sources import DistillData
from specjax.models import Transformer, TransformerConfig, init_cache
from specjax.models.feature_draft import FeatureDraftConfig, from_target
from specjax.parallel import default_mesh_config
from specjax.parallel.mesh import mesh_rules
from specjax.train.config import default_train_config
from specjax.train.optimizer import make_optimizer

V, T, B, BOS, EOS = 32, 16, 4, 1, 2
TOKENIZER = {'kind': 'stub', 'vocab_size': V}
IDS = list(range(20, 0, -1))  # a reduced map of 20 target ids (eos included)


class _Tok:
    vocab_size, eos_id = V, EOS

    def identity(self):
        return dict(TOKENIZER)

    def save(self, workdir):
        pass


def _target():
    cfg = TransformerConfig(
        vocab_size=V, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, max_len=64
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    model.embed[...] = model.embed[...] * 20.0  # peaked next-token distributions
    return model


def _rows(rng, b=B):
    """Packed rows: bos + random tokens, two documents a row (positions restart)."""
    tokens = rng.integers(3, V, (b, T)).astype(np.int32)
    tokens[:, 0] = tokens[:, 7] = BOS
    seg = np.repeat(np.array([[1] * 7 + [2] * (T - 7)], np.int32), b, 0)
    pos = np.concatenate([np.arange(7), np.arange(T - 7)])[None].repeat(b, 0).astype(np.int32)
    return {
        'tokens': tokens,
        'segment_ids': seg,
        'positions': pos,
        'domain_ids': np.zeros_like(seg),
    }


def _data():
    evals = [_rows(np.random.default_rng(99))]
    return DistillData(Batches(1, _rows), evals, dict(TOKENIZER), {'name': 'stub'}, V, ('a',), EOS)


@pytest.fixture(scope='module')
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp('feature')
    write_workdir(_target(), _Tok(), str(root / 'target'), source={})
    (root / 'vocab.json').write_text(json.dumps({'ids': IDS}))
    return root


def _config(root, steps=8, **feature):
    c = ml_collections.ConfigDict()
    c.mode, c.seed = 'feature_draft', 0
    c.data = ml_collections.ConfigDict({'seq_len': T})
    c.distill = default_feature_distill_config()
    c.distill.update(teacher_workdir=str(root / 'target'), prompt_len=4, max_new_tokens=T - 4)
    c.feature = default_feature_config()
    c.feature.update(vocab_file=str(root / 'vocab.json'), n_layers=2)
    c.feature.update(feature)
    c.sampling = ml_collections.ConfigDict({'temperature': 1.0, 'top_k': 0, 'top_p': 1.0})
    c.train = default_train_config()
    c.train.update(
        steps=steps, batch_size=B, lr=3e-2, warmup_steps=1, log_every=4, eval_every=4,
        eval_batches=1, checkpoint_every=4, async_checkpointing=False,
    )  # fmt: skip
    c.mesh = default_mesh_config()
    return c


# ------------------------------------------------------------------ the unroll


def _rollout(decode, tokens_T, fused_TE, anchor: int, j: int):
    """One document by cached decode: the prefix 0..anchor with true features (f_{-1} = 0),
    then j single steps each fed the previous output state -> (logits, state) at anchor + j.
    The prefix call writes the whole (zero-padded) document but advances by anchor + 1, so the
    entries past it are never read (one compiled shape for every anchor)."""
    pad = T - len(tokens_T)
    tokens = jnp.pad(tokens_T, (0, pad))[None]
    f_prev = jnp.pad(fused_TE, ((1, pad - 1 if pad else 0), (0, 0)))[:T][None]
    cache = init_cache(decode.draft_cfg.decoder, 1, T + 4)
    logits, state, cache = decode(tokens, f_prev, jnp.array([anchor + 1]), cache)
    logits, state = logits[:, anchor : anchor + 1], state[:, anchor : anchor + 1]
    for i in range(1, j + 1):
        tok = tokens[:, anchor + i : anchor + i + 1]
        logits, state, cache = decode(tok, state, jnp.ones(1, jnp.int32), cache)
    return logits[0, -1], state[0, -1]


class _Decode:
    """draft.decode jitted (params split off once)."""

    def __init__(self, draft):
        self.draft_cfg = draft.config
        graphdef, self.params = nnx.split(draft)
        self.fn = jax.jit(lambda p, *a: nnx.merge(graphdef, p).decode(*a))

    def __call__(self, *args):
        return self.fn(self.params, *args)


def test_ttt_unroll_equals_a_cached_rollout_with_self_fed_states(highest_precision):
    target = _target()
    cfg = FeatureDraftConfig.for_target(target.config, n_layers=2, draft_vocab_size=None)
    draft = from_target(target, cfg, rngs=nnx.Rngs(1))
    rows = _rows(np.random.default_rng(5), b=2)
    rows['segment_ids'][0] = 1  # row 0: one document, positions 0..T-1
    rows['positions'][0] = np.arange(T)
    tokens, seg, pos = (jnp.asarray(rows[k]) for k in ('tokens', 'segment_ids', 'positions'))
    _, feats = target(tokens, pos, seg, feature_layers=cfg.feature_layers)
    fused = draft.fuse_features(feats)
    graphdef, params = nnx.split(draft)
    unroll = jax.jit(lambda p, *a: ttt.unroll(nnx.merge(graphdef, p), *a, steps=4))
    outs = unroll(params, tokens, fused, pos, seg)
    decode = _Decode(draft)
    for b, j, t in (
        (0, 0, 5),
        (0, 1, 1),
        (0, 2, 9),
        (0, 3, T - 1),
        (1, 1, 3),
        (1, 2, 9),
        (1, 3, 10),
    ):
        start = 0 if b == 0 or t < 7 else 7  # the document of t
        logits, state = _rollout(decode, tokens[b, start:], fused[b, start:], t - j - start, j)
        np.testing.assert_allclose(outs[j][0][b, t], logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(outs[j][1][b, t], state, rtol=1e-5, atol=1e-5)
        if j:  # self-fed states are not the true features: step j differs from step 0
            assert np.abs(outs[j][0][b, t] - outs[0][0][b, t]).max() > 1e-3
    # scored positions: the anchor t - j in t's document
    mask = ttt.anchored(jnp.ones((2, T), bool), seg, 2)
    assert mask[0].tolist() == [False] * 2 + [True] * (T - 2)
    assert mask[1].tolist() == [False] * 2 + [True] * 5 + [False] * 2 + [True] * (T - 9)


def _concatenated_unroll(draft, tokens_BT, fused_BTE, positions_BT, segment_ids_BT, steps):
    """The unroll without K/V reuse (the reference): step j runs the draft over every block
    [e^0; ...; e^j] under ttt_mask(j) and keeps its last T outputs."""
    t = tokens_BT.shape[1]
    feats, outs = [ttt.previous_in_segment(fused_BTE, segment_ids_BT)], []
    for j in range(steps):
        if j:
            feats.append(ttt.previous_in_segment(outs[-1][1], segment_ids_BT))
        logits, state = draft(
            jnp.tile(tokens_BT, (1, j + 1)), jnp.concatenate(feats, 1),
            jnp.tile(positions_BT, (1, j + 1)), mask=ttt.ttt_mask(segment_ids_BT, j),
        )  # fmt: skip
        outs.append((logits[:, -t:], state[:, -t:]))
    return outs


def test_ttt_unroll_with_kv_reuse_equals_the_concatenated_unroll(highest_precision):
    """Step j on block j alone, the earlier blocks' keys and values from the cache, gives the
    logits, states and gradients of running the draft over all j + 1 blocks (2 draft layers,
    packed documents)."""
    target = _target()
    cfg = FeatureDraftConfig.for_target(target.config, n_layers=2, draft_vocab_size=None)
    draft = from_target(target, cfg, rngs=nnx.Rngs(1))
    rows = _rows(np.random.default_rng(6), b=2)
    tokens, seg, pos = (jnp.asarray(rows[k]) for k in ('tokens', 'segment_ids', 'positions'))
    fused = draft.fuse_features(target(tokens, pos, seg, feature_layers=cfg.feature_layers)[1])
    graphdef, params = nnx.split(draft)
    weights = jax.random.normal(jax.random.key(0), (3, 2, T, cfg.vocab_size))

    def loss(p, unroll):
        outs = unroll(nnx.merge(graphdef, p), tokens, fused, pos, seg, 3)
        return sum(jnp.sum(w * lg) for w, (lg, _) in zip(weights, outs)), outs

    grad = lambda fn: jax.jit(jax.grad(lambda p: loss(p, fn), has_aux=True))(params)
    (g_reuse, outs_reuse), (g_ref, outs_ref) = grad(ttt.unroll), grad(_concatenated_unroll)
    for (a_lg, a_st), (b_lg, b_st) in zip(outs_reuse, outs_ref, strict=True):
        np.testing.assert_allclose(a_lg, b_lg, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a_st, b_st, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_reuse), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert np.abs(outs_ref[2][0] - outs_ref[0][0]).max() > 1e-3  # the steps differ


# ------------------------------------------------------------------ the mode


def _sigterm_at(step):
    def on_step(s, state):
        if s == step:
            signal.raise_signal(signal.SIGTERM)

    return on_step


def _train_rows(workdir):
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f]
    return {(r['step'], r['split']): r for r in rows}


@pytest.fixture(scope='module')
def full_run(target_dir):
    workdir = str(target_dir / 'full')
    return workdir, fm.run_feature_draft(_config(target_dir), workdir, data=_data())


def test_training_lowers_the_loss_and_the_draft_loads_back(target_dir, full_run):
    workdir, res = full_run
    rows = _train_rows(workdir)
    first, last = rows[(4, 'train')], rows[(8, 'train')]
    # each step's loss is on a fresh batch, before its update: 5.85 -> 4.45 measured; held out
    # (the target's continuations of the eval prompts): 5.94 -> 5.44, alpha_step0 .166 -> .189
    assert last['loss'] < 0.85 * first['loss'], (first['loss'], last['loss'])
    before, after = rows[(4, 'eval')], rows[(8, 'eval')]
    assert after['val_loss'] < 0.95 * before['val_loss'] and res['val_loss'] == after['val_loss']
    assert after['alpha_step0'] > before['alpha_step0'] + 0.01
    assert res['step'] == 8 and not res['preempted'] and res['draft_vocab_size'] == len(IDS)
    assert all(0 < res[f'alpha_step{j}'] <= 1 for j in range(3))
    draft, ids = fm.load_feature_draft(workdir)
    assert ids.tolist() == IDS and draft.config.vocab_size == len(IDS)
    assert draft.config.feature_layers == (0, 1, 2) and draft.config.n_layers == 2
    vocab = json.loads((target_dir / 'full' / fm.DRAFT_VOCAB_FILE).read_text())
    assert vocab == {'ids': IDS, 'target_vocab_size': V}
    np.testing.assert_array_equal(draft.embed[...], _target().embed[...])  # frozen
    init = from_target(_target(), draft.config, rngs=nnx.Rngs(0))
    assert np.abs(np.asarray(draft.lm_head[...]) - np.asarray(init.lm_head[...])).max() > 1e-3


def test_sigterm_then_resume_is_bit_identical(target_dir, full_run):
    workdir, res = full_run
    work = str(target_dir / 'resumed')
    part = fm.run_feature_draft(_config(target_dir), work, data=_data(), on_step=_sigterm_at(5))
    assert part['preempted'] and part['step'] == 5 and part['checkpoint_step'] == 5
    assert not os.path.exists(os.path.join(work, fm.DRAFT_VOCAB_FILE))
    done = fm.run_feature_draft(_config(target_dir), work, data=_data())
    for key in ('step', 'val_loss', 'alpha_step0', 'alpha_step1', 'alpha_step2'):
        assert done[key] == res[key], key
    a, _ = fm.load_feature_draft(workdir)
    b, _ = fm.load_feature_draft(work)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    evals = [
        {k: v for k, v in _train_rows(w)[(8, 'eval')].items() if k != 'time'}
        for w in (work, workdir)
    ]
    assert evals[0] == evals[1]


@pytest.mark.parametrize(
    'section, field, value, match',
    [
        ('feature', 'ttt_steps', 0, r'config.feature.ttt_steps must be an int >= 1, got 0'),
        ('feature', 'ttt_steps', T, rf'config.feature.ttt_steps={T} must be below .* {T}'),
        ('feature', 'feature_layers', (0, 1, 3), r'feature_layers=\(0, 1, 3\).*\[0, 3\)'),
        ('feature', 'feature_layers', (0, 1), r'config.feature.feature_layers=\(0, 1\) must be'),
        ('feature', 'step_decay', 0.0, r'config.feature.step_decay must be in \(0, 1\], got 0.0'),
        ('feature', 'vocab_size', 21, r'config.feature.vocab_size=21 is above the 20 ids'),
        ('distill', 'divergence', 'expected_accepted_length', r'config.distill.divergence='),
        ('distill', 'source', 'on_policy', r"config.distill.source='on_policy' must be one of"),
    ],
)
def test_bad_config_is_refused_naming_the_field_before_compiling(
    target_dir, tmp_path, monkeypatch, section, field, value, match
):
    def compiled(*args, **kwargs):
        raise AssertionError('compiled before refusing the config')

    monkeypatch.setattr(ttt, 'jit_feature_step', compiled)
    c = _config(target_dir)
    c[section][field] = value
    with pytest.raises(ValueError, match=match):
        fm.run_feature_draft(c, str(tmp_path / 'bad'), data=_data())
    assert not (tmp_path / 'bad').exists()


def test_init_head_starts_the_head_at_the_targets_columns_and_nothing_else(target_dir):
    """config.feature.init_head: the initial state's final norm and head are the target's (its
    output columns of the draft vocabulary); every other parameter is the seeded one."""
    c = _config(target_dir, init_head=True)
    draft_cfg, ids = fm.prepare(c, data_config=False)
    teacher, mesh, _ = fm.load_target(c)
    rules = mesh_rules(c.mesh)[1]
    tx = make_optimizer(c.train)
    seeded = fm.plan_state(draft_cfg, teacher, tx, 0, mesh, rules)[3]().params
    headed = fm.plan_state(draft_cfg, teacher, tx, 0, mesh, rules, ids)[3]().params
    target = nnx.merge(teacher.graphdef, teacher.params)
    np.testing.assert_array_equal(headed['lm_head'][...], np.asarray(target.embed[...]).T[:, IDS])
    np.testing.assert_array_equal(headed['final_norm']['scale'][...], target.final_norm.scale[...])
    flat = dict(nnx.to_flat_state(headed))
    for path, a in nnx.to_flat_state(seeded):
        if path[0] not in ('lm_head', 'final_norm'):
            np.testing.assert_array_equal(a[...], flat[path][...])
    assert fm.loss_identity(c)['init_head'] is True
    assert 'init_head' not in fm.loss_identity(_config(target_dir))  # older workdirs resume


def test_smollm2_feature_stage_trains_on_the_teacher_cache_rows(target_dir, tmp_path):
    """The SmolLM2 preset's draft_feature stage (specjax.quickstart.smollm2_feature): its rows
    are the teacher cache's train rows in the distilled draft's order (RowOrder, same seed), its
    vocabulary the cache's ids, and it leaves a feature-draft workdir; bad settings are refused
    naming the field."""
    from specjax.distill.reduced_task import RowOrder
    from specjax.distill.reduced_train import save_cache
    from specjax.quickstart import smollm2_feature as sf

    rng, arrays = np.random.default_rng(5), {}
    for prefix, n in (('train', 6), ('corpus', 4), ('eval', 4)):
        rows = _rows(rng, n)
        arrays.update({f'{prefix}_{x}': rows[x] for x in ('tokens', 'positions', 'segment_ids')})
    os.symlink(target_dir / 'target', tmp_path / 'target')
    save_cache(str(tmp_path / 'teacher_cache'), {'ids': IDS, 'target_vocab_size': V}, arrays)
    data = sf.cache_data(str(tmp_path / 'teacher_cache'), _Tok(), B, 0, 1)
    order = RowOrder(lambda rows: rows, 6, B, 0)
    for _ in range(3):  # past the first permutation
        np.testing.assert_array_equal(
            next(data.train)['tokens'], arrays['train_tokens'][next(order)]
        )
    assert [b['tokens'].shape for b in data.eval_batches] == [(B, T)]
    # rows='teacher+corpus': the continuations then the corpus rows, one RowOrder over all 10
    both = sf.cache_data(str(tmp_path / 'teacher_cache'), _Tok(), B, 0, 1, rows='teacher+corpus')
    rows_both = np.concatenate([arrays['train_tokens'], arrays['corpus_tokens']])
    order = RowOrder(lambda rows: rows, 10, B, 0)
    for _ in range(4):  # past the first permutation
        np.testing.assert_array_equal(next(both.train)['tokens'], rows_both[next(order)])
    assert both.corpus != data.corpus  # a resume on other rows is refused

    c = _config(tmp_path, steps=2, n_layers=1, ttt_steps=2)
    c.distill.source = 'dataset'
    res = sf.train_on_cache(c, str(tmp_path / 'draft_feature'), str(tmp_path), _Tok())
    assert res['step'] == 2 and 0 < res['alpha_step0'] <= 1
    draft, ids = fm.load_feature_draft(str(tmp_path / 'draft_feature'))
    assert ids.tolist() == IDS and draft.config.feature_layers == (0, 1, 2)
    with pytest.raises(ValueError, match=r'data.seq_len=16 must equal the cached rows \(8 tokens'):
        sf.check_config(c, 8)
    c.distill.source = 'teacher'
    with pytest.raises(ValueError, match=r"config.draft_feature.distill.source='teacher' must"):
        sf.check_config(c, T)
    c.distill.source, c.rows = 'dataset', 'teacher+eval'
    with pytest.raises(ValueError, match=r"config.draft_feature.rows='teacher\+eval' must be"):
        sf.check_config(c, T)
    c.rows = 'corpus'
    c.lock()  # as the pipeline hands a stage its section
    assert sf.take_rows(c) == 'corpus' and 'rows' not in c and sf.take_rows(c) == 'teacher'
