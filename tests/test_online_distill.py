"""Mode online_distill (issue 41): exactness across an update, the buffer's bound, the frozen arm
against plain serving, and resume after kill -9 against an uninterrupted run.

The mode's tests share one tiny run on the stdlib corpus (a 6-step target, 4-step drafts, a
48-request stream); the interrupted run reuses its three models and is killed with SIGKILL in a
child process right after its first checkpoint (which follows an update).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sampling_models import make_model, ragged_prompts, tiny_config
from test_exactness import PROMPTS, holm_rejects, max_tv, pvalues, truth

from specjax.checkpoint import load_model
from specjax.config_files import load_config
from specjax.distill import online_mode
from specjax.distill import online_report as report
from specjax.distill.online_buffer import OnlineBuffer, entry_bytes, select
from specjax.distill.online_stream import make_stream
from specjax.distill.online_update import (
    STEP_KEYS,
    online_step,
    online_steps,
    rescore_program,
    rows_batch,
    served_entries,
    update_batches,
)
from specjax.distill.steps import LossSettings, draft_update
from specjax.models import merge, split
from specjax.parallel import make_mesh
from specjax.parallel.mesh import default_mesh_config
from specjax.sampling import (
    SamplingConfig,
    make_autoregressive_fn,
    make_speculative_fn,
    speculative_sample,
)
from specjax.train.state import TrainState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, 'configs', 'online_distill.py') + ':size=tiny'

# ---------------------------------------------------------------- the buffer alone


def test_buffer_is_bounded_fifo_and_sampled_rows_hold_every_entry():
    width, vocab, cap = 6, 5, 7
    buf = OnlineBuffer.empty(cap, width, vocab)
    nbytes = buf.nbytes
    assert nbytes == cap * entry_bytes(width, vocab) + 8  # + the int64 counter
    rng = np.random.default_rng(0)
    for r in range(5):
        seq = rng.integers(1, vocab, (3, width)).astype(np.int32)
        rows = np.array([0, 0, 1, 2], np.int32)
        cols = np.array([1, 3, 0, 4], np.int32)
        logp = np.log(rng.dirichlet(np.ones(vocab), 4)).astype(np.float32)
        buf.add(seq, rows, cols, logp, np.array([1, 0, 1, 0], bool), 10 * r + rows)
        assert buf.filled == min(4 * (r + 1), cap) and buf.nbytes == nbytes
    assert buf.written == 20 and buf.counts()['entries'] == cap
    # FIFO: the last 7 entries written are held (requests of rounds 3 and 4)
    assert sorted(buf.arrays['request'].tolist()) == [30, 31, 32, 40, 40, 41, 42]
    held = buf.arrays['tokens'][buf.arrays['request'] == 40]
    assert (held[:, 2:] == 0).all() or (held[:, 4:] == 0).all()  # prefixes only
    batch = buf.sample(3, per_row=4, seed=0, update=1, step=0)
    assert batch['tokens'].shape == (3, width) and batch['teacher'].shape == (3, 4, vocab)
    assert batch['mask'].sum() >= 3  # request 40 brings its two entries in one row
    a = buf.arrays
    for i in range(3):  # every entry of the row's request, in position order, at its position
        m = int(batch['mask'][i].sum())
        assert not batch['mask'][i, m:].any() and (batch['teacher'][i, m:] == 0).all()

        def holds(r, i=i, m=m):
            idx = np.flatnonzero(a['request'] == r)
            idx = idx[np.argsort(a['length'][idx])]
            return (
                len(idx) == m
                and (a['tokens'][idx[-1]] == batch['tokens'][i]).all()
                and (batch['at'][i, :m] == a['length'][idx] - 1).all()
                and (batch['teacher'][i, :m] == a['logp'][idx]).all()
            )

        assert any(holds(r) for r in np.unique(a['request'][a['request'] >= 0]))
    with pytest.raises(ValueError, match='per_row=1'):
        buf.sample(3, per_row=1, seed=0, update=1, step=0)
    sel = select(
        np.array([[0.2, 0.9, 0.7]]), np.array([[True, True, False]]), wrong_below=0.5,
        right_fraction=1.0, seed=0, round_=0,
    )  # fmt: skip
    assert sel[0].tolist() == [0, 0] and sel[1].tolist() == [0, 1] and sel[2].tolist() == [1, 0]
    with pytest.raises(ValueError, match='wide'):
        buf.add(np.zeros((1, width + 1), np.int32), [0], [0], np.zeros((1, vocab)), [1], [0])


def _filled_buffer(width, vocab):
    """A buffer of 3 rounds of 4 random rows, ~30 % of their positions entered."""
    buf = OnlineBuffer.empty(64, width, vocab)
    rng = np.random.default_rng(1)
    for r in range(3):
        seq = rng.integers(1, vocab, (4, width)).astype(np.int32)
        rows, cols = np.nonzero(rng.random((4, width - 1)) < 0.3)
        logp = np.log(rng.dirichlet(np.ones(vocab), len(rows))).astype(np.float32)
        buf.add(seq, rows, cols, logp, np.ones(len(rows), bool), 4 * r + rows)
    return buf


@pytest.mark.parametrize('divergence', ['fkl', 'tvd'])
def test_the_step_on_entries_equals_the_step_on_whole_rows(divergence, highest_precision):
    """online_step runs the draft's output head and the divergence at the buffered entries only
    ([N, E, V]); it makes the same update as draft_update over every position of the rows with
    the entries' log-probs placed at their positions and the loss mask selecting them."""
    width, vocab, n, e = 12, 7, 4, 5
    dgd, dparams = split(make_model(tiny_config(vocab), seed=3, scale=3.0))
    b = _filled_buffer(width, vocab).sample(n, per_row=e, seed=0, update=0, step=0)
    dense = np.zeros((n, width, vocab), np.float32)
    dense_mask = np.zeros((n, width - 1), bool)
    for i, j in zip(*np.nonzero(b['mask']), strict=True):
        dense[i, b['at'][i, j]] = b['teacher'][i, j]
        dense_mask[i, b['at'][i, j]] = True
    assert dense_mask.sum() == b['mask'].sum() > n
    tx, loss = optax.adam(0.05), LossSettings(divergence=divergence)
    state = TrainState(jnp.int32(0), dparams, tx.init(dparams), jax.random.PRNGKey(0))
    step = jax.jit(functools.partial(online_step, dgd, tx=tx, loss=loss))
    new, metrics = step(state, b['tokens'], b['length'], b['at'], b['mask'], b['teacher'])
    whole = rows_batch(b['tokens'], b['length'], None, dense_mask)
    whole.pop('logits_at')
    update = jax.jit(functools.partial(draft_update, dgd, tx=tx, loss=loss))
    params, _, want = update(dparams, tx.init(dparams), dense, whole)
    np.testing.assert_allclose(metrics['loss'], want['loss'], rtol=1e-5)
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, atol=1e-6), new.params, params)


def test_an_updates_steps_in_one_program_equal_the_steps_one_by_one():
    """online_steps (a scan over update_batches' stacked batches) makes the same S updates, in
    the same order, as S calls of online_step on the buffer's samples for steps 0 .. S - 1."""
    width, vocab, n, e, steps = 12, 7, 4, 5, 3
    dgd, dparams = split(make_model(tiny_config(vocab), seed=3, scale=3.0))
    buf = _filled_buffer(width, vocab)
    # eps: logit_offset's gradient is 0 up to rounding, which Adam's default eps would turn
    # into +-lr steps; the comparison is of the program, not of rounding noise
    tx, loss = optax.adam(0.05, eps=1e-4), LossSettings(divergence='fkl')
    fresh = lambda: TrainState(jnp.int32(0), dparams, tx.init(dparams), jax.random.PRNGKey(0))
    one = jax.jit(functools.partial(online_step, dgd, tx=tx, loss=loss))
    state, want = fresh(), []
    for step in range(steps):
        b = buf.sample(n, per_row=e, seed=0, update=2, step=step)
        state, metrics = one(state, *(b[k] for k in STEP_KEYS))
        want.append(float(metrics['loss']))
    stacked = update_batches(buf, steps, n, per_row=e, seed=0, update=2)
    assert stacked['teacher'].shape == (steps, n, e, vocab)
    run = jax.jit(functools.partial(online_steps, dgd, tx=tx, loss=loss))
    got, losses = run(fresh(), *(stacked[k] for k in STEP_KEYS))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert int(got.step) == steps
    close = lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-5, atol=2e-5)  # steps: ~5e-2
    jax.tree.map(close, got.params, state.params)


def test_summary_reads_recovery_both_ways_and_the_update_fraction():
    """summarize: recovered_from is the first post-shift window from which every later one keeps
    >= 50 % of the frozen-to-retrained gap, reached_at the first that reaches it; a window that
    falls back (seed 1 of the tiny preset: 0.62 then 0.41) meets the one in the first half and
    not the other. update_fraction is update CPU over serving CPU of the online arm."""
    online = [0.50, 0.50, 0.31, 0.38, 0.32, 0.39, 0.39, 0.39]  # recovery 0.1 0.8 0.2 0.9 0.9 0.9
    rows = []
    for w, a in enumerate(online):
        domain = 'code' if w < 2 else 'prose'
        for arm, alpha in (('online', a), ('frozen', 0.30), ('retrained', 0.40)):
            rows.append(dict(
                window=w, arm=arm, domain=domain, alpha=alpha, tau=1.5, requests=10,
                tokens=100, tokens_per_s=100.0, serve_cpu_s=1.0, update_wall_s=0.1,
                update_cpu_s=0.15 if arm == 'online' else 0.0,
            ))  # fmt: skip
    s = report.summarize(rows, ('code', 'prose'))
    np.testing.assert_allclose(
        [w['recovery'] for w in s['recovery']], [0.1, 0.8, 0.2, 0.9, 0.9, 0.9]
    )
    assert s['first_half_windows'] == [2, 3, 4]
    assert (s['reached_at'], s['reached_in_first_half']) == (3, True)
    assert (s['recovered_from'], s['recovery_target_met']) == (5, False)
    assert s['update_fraction'] == pytest.approx(0.15) and s['update_fraction_target_met']


# ---------------------------------------------------------------- exactness across an update

V = 5
NUM_SAMPLES = 40_000
SAMPLING = SamplingConfig(1.0)
K, NEW = 2, 4  # the first NEW tokens are tested (k + 2: bonus and residual positions)
TARGET = make_model(tiny_config(V), seed=0, scale=8.0)
DRAFT = make_model(tiny_config(V), seed=1, scale=8.0)


def _serve(draft, seed, logprobs=False):
    fn = make_speculative_fn(
        split(TARGET)[0], split(draft)[0], num_draft_tokens=K, max_new_tokens=NEW,
        sampling=SAMPLING, target_logprobs=logprobs,
    )  # fmt: skip
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    return fn(split(TARGET)[1], split(draft)[1], prompts, lengths, seed)


def _online_update(out, steps=12):
    """The mode's learning path on 64 served rows: the draft scores them (the sampler returned
    the target's log-probs), select, buffer, online steps."""
    tgd, tparams = split(TARGET)
    dgd, dparams = split(DRAFT)
    prompts, lengths = ragged_prompts(PROMPTS, 64)
    mesh = make_mesh(default_mesh_config())
    program = rescore_program(tgd, dgd, SAMPLING, mesh, True, served=True)
    served = (out.tokens[:64], out.lengths[:64], out.target_logprobs[:64])
    rescore = lambda params: jax.device_get(program(tparams, params, prompts, lengths, *served))
    seq, mask, alpha, _ = rescore(dparams)
    rows, cols, wrong = select(alpha, mask, wrong_below=0.5, right_fraction=0.2, seed=0, round_=0)
    buf = OnlineBuffer.empty(256, seq.shape[1], V)
    logp = served_entries(out.target_logprobs[:64], lengths, rows, cols)
    buf.add(seq, rows, cols, np.asarray(logp), wrong, rows)
    tx = optax.adam(0.03)
    state = TrainState(jnp.int32(0), dparams, tx.init(dparams), jax.random.PRNGKey(0))
    step = jax.jit(functools.partial(online_step, dgd, tx=tx, loss=LossSettings()))
    for s in range(steps):
        b = buf.sample(8, per_row=NEW, seed=0, update=0, step=s)
        state, _ = step(state, b['tokens'], b['length'], b['at'], b['mask'], b['teacher'])
    new_alpha = rescore(state.params)[2]
    return merge(dgd, state.params), float(alpha[mask].mean()), float(new_alpha[mask].mean())


def test_served_law_is_the_targets_across_an_update():
    """Rows served before and after an online update follow the enumerated target law
    (chi-square per position and adjacent pair, Holm over both phases); the updated draft's
    own samples (the negative control) are rejected by the same test."""
    before = _serve(DRAFT, seed=1, logprobs=True)  # the learning rounds' sampler
    updated, alpha0, alpha1 = _online_update(before)
    assert alpha1 > alpha0 + 0.05, (alpha0, alpha1)  # the update moved the draft
    after = _serve(updated, seed=2)
    pvals, tv = {}, 0.0
    for phase, out in (('before', before), ('after', after)):
        tokens = np.asarray(out.tokens)[:, :NEW]
        assert (np.asarray(out.lengths) >= NEW).all()
        for j, prompt in enumerate(PROMPTS):
            joint = truth(TARGET, prompt, SAMPLING, NEW)
            rows = tokens[j :: len(PROMPTS)]
            pvals.update({f'{phase}.{j}.{n}': p for n, p in pvalues(rows, joint).items()})
            tv = max(tv, max_tv(rows, joint))
    assert holm_rejects(pvals) == [], (sorted(pvals.items(), key=lambda kv: kv[1])[:3], tv)
    assert tv < 0.02
    alone = make_autoregressive_fn(split(updated)[0], max_new_tokens=NEW, sampling=SAMPLING)
    prompts, lengths = ragged_prompts(PROMPTS, NUM_SAMPLES)
    control = alone(split(updated)[1], prompts, lengths, 3)
    tokens = np.asarray(control.tokens)[:, :NEW]
    cpvals = {}
    for j, prompt in enumerate(PROMPTS):
        rows = tokens[j :: len(PROMPTS)]
        joint = truth(TARGET, prompt, SAMPLING, NEW)
        cpvals.update({f'{j}.{n}': p for n, p in pvalues(rows, joint).items()})
    assert holm_rejects(cpvals), 'the updated draft alone passed as the target'


# ---------------------------------------------------------------- the mode


def _overrides(data_dir: str, **workdirs) -> list[tuple[str, str]]:
    """A seconds-long run: a 6-step target, 4-step drafts, 48 requests of 8 tokens."""
    out = [('data.data_dir', data_dir), ('data.seq_len', '32'), ('target.model.max_len', '32')]
    out += [('target.train.steps', '6'), ('target.train.batch_size', '4')]
    out += [('target.train.eval_batches', '1'), ('compilation_cache', '')]
    for stage in ('draft', 'retrained'):
        out += [(f'{stage}.draft.max_len', '32'), (f'{stage}.train.steps', '4')]
        out += [(f'{stage}.train.batch_size', '4'), (f'{stage}.train.eval_batches', '1')]
        out += [(f'{stage}.distill.prompt_len', '8'), (f'{stage}.distill.max_new_tokens', '8')]
    stream = dict(requests=48, batch_size=4, window=8, prompt_len_min=4, prompt_len_max=8)
    stream.update(max_new_tokens=8, k=2)
    out += [(f'stream.{k}', str(v)) for k, v in stream.items()]
    online = dict(update_every=8, steps=2, batch_size=4, buffer_size=64, wrong_below=0.95)
    online.update(right_fraction=0.5, learn_every=2)  # untrained models agree: alpha ~0.9
    out += [(f'online.{k}', str(v)) for k, v in online.items()]
    out += [(f'{k}_workdir', v) for k, v in workdirs.items()]
    return out


@pytest.fixture(scope='module')
def finished(stdlib_data_dir, tmp_path_factory):
    """(config, workdir, results) of one uninterrupted run that trains its own models."""
    workdir = str(tmp_path_factory.mktemp('online') / 'run')
    config = load_config(CONFIG, _overrides(stdlib_data_dir))
    results = online_mode.run(config, workdir)
    return config, workdir, results


def _rows(workdir):
    with open(os.path.join(workdir, online_mode.ONLINE_FILE)) as f:
        return json.load(f)['rows']


def test_run_writes_rows_plot_and_keeps_the_buffer_bounded(finished):
    config, workdir, results = finished
    rows = _rows(workdir)
    windows = config.stream.requests // config.stream.window
    assert len(rows) == 3 * windows and {r['arm'] for r in rows} == set(report.ARMS)
    for r in rows:
        assert {'window', 'domain', 'alpha', 'tau', 'tokens_per_s', 'update_cpu_s'} <= set(r)
        assert 0 <= r['alpha'] <= 1 and r['tau'] >= 1
        assert (r['update_cpu_s'] > 0) == (r['arm'] == 'online')  # re-scoring, steps
    assert [r['domain'] for r in rows if r['arm'] == 'online'] == ['code'] * 3 + ['prose'] * 3
    online = [r for r in rows if r['arm'] == 'online']
    assert max(r['buffer_entries'] for r in online) == config.online.buffer_size  # it filled
    assert results['buffer']['capacity'] == config.online.buffer_size
    assert results['buffer']['entries'] <= config.online.buffer_size
    assert results['buffer']['written'] > config.online.buffer_size  # ... and wrapped
    assert results['updates'] == config.stream.requests // config.online.update_every
    assert os.path.getsize(os.path.join(workdir, 'plots', 'online_alpha.png')) > 1000
    again = online_mode.run(config, workdir)  # finished: returned as it is, nothing rewritten
    assert again['summary'] == results['summary']


def test_frozen_arm_is_plain_serving(finished):
    """The frozen arm's served tokens equal speculative_sample's with the draft as trained, the
    same prompts and the same key per round (compared through the per-window digests)."""
    config, workdir, _ = finished
    from specjax.data import build_tokenizer

    tok = build_tokenizer(config.data)
    stream = make_stream(config.data, tok, config.stream, int(config.seed))
    target = load_model(os.path.join(workdir, 'target'))[0]
    draft = load_model(os.path.join(workdir, 'draft'))[0]
    b, per_window = config.stream.batch_size, config.stream.window // config.stream.batch_size
    digests = []
    for r in range(config.stream.requests // b):
        prompts, lengths = stream.batch(r * b, b)
        out = speculative_sample(
            target, draft, prompts, lengths, num_draft_tokens=config.stream.k,
            max_new_tokens=config.stream.max_new_tokens, sampling=SamplingConfig(1.0),
            rng=jax.random.fold_in(jax.random.key(config.seed), r), eos_id=tok.eos_id,
        )  # fmt: skip
        digests.append(report.tokens_digest(out.tokens, out.lengths))
    frozen = [r['tokens_sha256'] for r in _rows(workdir) if r['arm'] == 'frozen']
    plain = [
        report.window_digest(digests[i : i + per_window])
        for i in range(0, len(digests), per_window)
    ]
    assert frozen == plain
    online = [r['tokens_sha256'] for r in _rows(workdir) if r['arm'] == 'online']
    assert online[0] == frozen[0] and online[-1] != frozen[-1]  # same until the first update


def _committed(workdir):
    folder = os.path.join(workdir, 'checkpoints')
    if not os.path.isdir(folder):
        return []
    return sorted(
        int(d) for d in os.listdir(folder)
        if d.isdigit() and os.path.exists(os.path.join(folder, d, 'specjax_digest.json'))
    )  # fmt: skip


def test_resume_after_kill_equals_uninterrupted(finished, tmp_path):
    config0, workdir0, _ = finished
    given = {s: os.path.join(workdir0, s) for s in ('target', 'draft', 'retrained')}
    overrides = _overrides(config0.data.data_dir, **given)
    workdir = str(tmp_path / 'killed')
    cmd = [sys.executable, '-m', 'specjax.main', f'--config={CONFIG}', f'--workdir={workdir}']
    cmd += [f'--config.{k}={v}' for k, v in overrides]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or '')
    child = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 300
    while not _committed(workdir) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    log = child.communicate()[0].decode()
    steps = _committed(workdir)
    assert steps and steps[-1] < config0.stream.requests, (steps, log[-2000:])
    assert not os.path.exists(os.path.join(workdir, 'results.json'))
    config = load_config(CONFIG, overrides)
    online_mode.run(config, workdir)  # resumes after the update that checkpoint follows
    strip = lambda rows: [
        {k: v for k, v in r.items() if k not in report.TIMING_FIELDS} for r in rows
    ]
    assert strip(_rows(workdir)) == strip(_rows(workdir0))
    a, b = load_model(workdir)[0], load_model(workdir0)[0]
    for x, y in zip(jax.tree.leaves(split(a)[1]), jax.tree.leaves(split(b)[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
