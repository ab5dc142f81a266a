"""Target pretraining: loss convention, optimizer, config validation, and learning a known entropy.

The convergence test trains on an order-2 Markov corpus whose per-token entropy is computed exactly
from the transition table and stationary distribution. Rows pack short independent documents
(segment ids, positions restarting per document) plus trailing padding. Checked by patching the
code (300 steps, optimum 1.071 nats): correct code ends +0.004 above the optimum; attention across
documents +0.31; a non-causal mask -1.07; a loss mask counting boundary targets +0.32, pad->pad
targets -0.20, or everything +0.16 -- all outside the 0.1-nat tolerance."""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from specjax.parallel import default_mesh_config
from specjax.train import losses
from specjax.train.config import default_train_config
from specjax.train.optimizer import decay_mask, learning_rate_schedule
from specjax.train.pretrain import PretrainData, pretrain, validate_config

V = 8  # Markov alphabet; token id = symbol + 1 (0 is padding)


def transition_table() -> np.ndarray:
    """P[a, b, c] = P(x_t = c | x_{t-2} = a, x_{t-1} = b).

    Mostly c = perm(a) (two back), sometimes c = b + 1, else uniform: order-2 context is worth
    much more than order-1, which is what makes a cross-document attention leak visible.
    """
    a, b, c = np.meshgrid(np.arange(V), np.arange(V), np.arange(V), indexing='ij')
    perm = np.array([3, 7, 0, 5, 1, 6, 2, 4])
    return 0.7 * (c == perm[a]) + 0.2 * (c == (b + 1) % V) + 0.1 / V


def stationary_pairs(table: np.ndarray) -> np.ndarray:
    """Stationary distribution pi[a, b] of the pair chain (a, b) -> (b, c)."""
    pi = np.full((V, V), 1.0 / V**2)
    for _ in range(500):
        pi = np.einsum('ab,abc->bc', pi, table)
    return pi / pi.sum()


def entropies(table: np.ndarray) -> tuple[float, float]:
    """(H(X_t | X_{t-2}, X_{t-1}), H(X_1 | X_0)) in nats under the stationary distribution."""
    pi = stationary_pairs(table)
    h2 = float(-np.sum(pi[..., None] * table * np.log(table)))
    cond1 = np.einsum('ab,abc->bc', pi, table) / pi.sum(0)[:, None]  # P(c | b)
    h1 = float(-np.sum(pi.sum(0)[:, None] * cond1 * np.log(cond1)))
    return h2, h1


class MarkovBatches:
    """Deterministic packed batches of the chain; batch i depends only on (seed, i)."""

    def __init__(self, batch: int, seq_len: int, seed: int, table=None, doc_len=(3, 8), max_pad=20):
        self.batch, self.seq_len, self.seed = batch, seq_len, seed
        self.min_len, self.max_len = doc_len
        self.max_pad = max_pad
        self.table = transition_table() if table is None else table
        self.cum = np.cumsum(self.table, axis=-1)
        self.pi = stationary_pairs(self.table).ravel()
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        out = self.make(self.index)
        self.index += 1
        return out

    def get_state(self) -> dict:
        return {'index': self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state['index'])

    def make(self, i: int) -> dict:
        rng = np.random.default_rng([self.seed, i])
        b, t = self.batch, self.seq_len
        segs = np.zeros((b, t), np.int32)
        pos = np.zeros((b, t), np.int32)
        for r in range(b):
            used = t - int(rng.integers(0, self.max_pad + 1))
            start, seg = 0, 1
            while start < used:
                end = min(used, start + int(rng.integers(self.min_len, self.max_len + 1)))
                segs[r, start:end] = seg
                pos[r, start:end] = np.arange(end - start)
                start, seg = end, seg + 1
        # Each document starts from a stationary pair, then follows the chain (column by column).
        pairs = rng.choice(V * V, size=(b, t), p=self.pi)
        u = rng.random((b, t, 1))
        x = np.zeros((b, t), np.int64)
        for j in range(t):
            x[:, j] = pairs[:, j] // V
            if j >= 1:
                x[:, j] = np.where(pos[:, j] == 1, pairs[:, j - 1] % V, x[:, j])
            if j >= 2:
                step = np.minimum((self.cum[x[:, j - 2], x[:, j - 1]] < u[:, j]).sum(-1), V - 1)
                x[:, j] = np.where(pos[:, j] >= 2, step, x[:, j])
        real = segs != 0
        return {
            'tokens': np.where(real, x + 1, 0).astype(np.int32),
            'segment_ids': segs,
            'positions': pos,
            'domain_ids': np.where(real, segs % 2, -1).astype(np.int32),
        }


def optimal_loss(batches: list[dict], h2: float, h1: float) -> float:
    """Best achievable mean loss on these batches' targets: H1 at a document's 2nd token, else H2.

    Targets are counted here in numpy, independently of the code under test.
    """
    n1 = n = 0
    for b in batches:
        segs = np.asarray(b['segment_ids'])
        targets = (segs[:, 1:] == segs[:, :-1]) & (segs[:, :-1] != 0)
        n1 += int((targets & (b['positions'][:, 1:] == 1)).sum())
        n += int(targets.sum())
    return (n1 * h1 + (n - n1) * h2) / n


def tiny_config(**train) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = 'pretrain'
    c.seed = 0
    c.model = ml_collections.ConfigDict(
        dict(
            vocab_size=V + 1, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_len=64
        )
    )
    c.data = ml_collections.ConfigDict(dict(seq_len=64))
    c.train = default_train_config()
    c.train.update(
        dict(
            steps=300,
            batch_size=16,
            lr=1e-2,
            warmup_steps=30,
            weight_decay=0.0,
            log_every=50,
            eval_every=0,
            eval_batches=4,
            checkpoint_every=300,
        )
    )
    c.train.update(train)
    c.mesh = default_mesh_config()
    return c


def markov_data(config, *, train_seed=1, eval_seed=2) -> PretrainData:
    b, t = config.train.batch_size, config.data.seq_len
    evals = MarkovBatches(b, t, eval_seed)
    return PretrainData(
        train=MarkovBatches(b, t, train_seed),
        eval_batches=[evals.make(i) for i in range(config.train.eval_batches)],
        tokenizer={'name': 'markov-symbols', 'vocab_size': V + 1},
        corpus={'name': 'markov2', 'seed': train_seed},
        vocab_size=V + 1,
        domains=('even', 'odd'),
    )


def test_loss_mask_follows_segments():
    tokens = jnp.array([[5, 6, 7, 8, 9, 0]])
    segs = jnp.array([[1, 1, 2, 2, 2, 0]])
    targets, mask = losses.next_token_targets(tokens, segs)
    np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(mask, [[True, False, True, True, False]])


def test_loss_is_masked_mean_and_domain_sums_add_up():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, 11)), jnp.float32)
    tokens = jnp.asarray(rng.integers(1, 11, (2, 6)), jnp.int32)
    segs = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    doms = jnp.array([[0, 0, 0, 1, 1, -1], [1, 1, 1, 1, 1, 1]])

    @jax.jit
    def run(logits, tokens, segs, doms):
        loss_bt, mask = losses.next_token_loss(logits, tokens, segs)
        return (
            loss_bt,
            mask,
            *losses.mean_loss(loss_bt, mask),
            *losses.domain_sums(loss_bt, mask, doms[:, 1:], 2),
        )

    loss_bt, mask, mean, count, sums, counts = run(logits, tokens, segs, doms)
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), -1)
    want = [-logp[b, t, tokens[b, t + 1]] for b in range(2) for t in range(5) if mask[b, t]]
    assert count == len(want) == 8
    np.testing.assert_allclose(mean, np.mean(want), rtol=1e-5)
    np.testing.assert_allclose(sums.sum(), np.sum(want), rtol=1e-5)
    np.testing.assert_array_equal(counts, [2, 6])


def test_schedule_and_decay_mask():
    cfg = default_train_config()
    cfg.update(dict(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1))
    sched = learning_rate_schedule(cfg)
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
    assert float(sched(100)) == pytest.approx(0.1)
    mask = decay_mask({'w': jnp.ones((2, 3)), 'scale': jnp.ones(3)})
    assert mask == {'w': True, 'scale': False}


def test_unknown_config_fields_raise():
    c = tiny_config()
    c.train.stepz = 3
    with pytest.raises(ValueError, match=r'config\.train\.stepz'):
        validate_config(c)
    c = tiny_config()
    c.model.d_modle = 3
    with pytest.raises(ValueError, match='d_modle'):
        validate_config(c)
    c = tiny_config()
    c.extra = 1
    with pytest.raises(ValueError, match=r'config\.extra'):
        validate_config(c)


def test_seq_len_above_max_len_raises_before_compiling(tmp_path, monkeypatch):
    c = tiny_config()
    c.data.seq_len = 128
    monkeypatch.setattr(jax, 'jit', lambda *a, **k: pytest.fail('compiled'))
    with pytest.raises(ValueError, match=r'config\.data\.seq_len=128 .*max_len=64'):
        pretrain(c, str(tmp_path), data=markov_data(tiny_config()))
    assert not (tmp_path / 'checkpoints').exists()


def test_learns_markov_entropy(tmp_path):
    """Validation loss ends within 0.1 nats of the exact optimum (entropy of the chain)."""
    h2, h1 = entropies(transition_table())
    config = tiny_config()
    data = markov_data(config)
    target = optimal_loss(data.eval_batches, h2, h1)
    assert h1 - h2 > 0.5 and math.isfinite(target)
    results = pretrain(config, str(tmp_path), data=data)
    loss = results['eval']['loss']
    assert abs(loss - target) < 0.1, (loss, target, h2, h1)
    assert set(results['eval']) >= {'loss/even', 'loss/odd', 'perplexity'}
    assert (tmp_path / 'results.json').exists() and (tmp_path / 'metrics.jsonl').exists()


def test_main_rejects_unknown_mode_and_override(capsys):
    from specjax import main

    with pytest.raises(ValueError, match=r"config\.mode='nope'.*known"):
        main.resolve_mode('nope')
    assert main.resolve_mode('pretrain') is pretrain
    config_file = pathlib.Path(__file__).parents[1] / 'configs' / 'target.py'
    argv = [
        'prog',
        f'--config={config_file}:size=tiny',
        '--workdir=/tmp/x',
        '--config.train.stepz=1',
    ]
    with pytest.raises(SystemExit) as exit_:  # in-process: unknown flag; CLI: unknown field
        main.parse_flags(argv)
    assert exit_.value.code == 2  # a refusal: one FATAL line naming the field, no traceback
    err = capsys.readouterr().err
    assert err.startswith('FATAL ') and 'stepz' in err and 'Traceback' not in err
