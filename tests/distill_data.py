"""Synthetic two-domain bigram data, configs and a pretrained tiny teacher, shared by the
distillation and co-training tests (tests/test_distill.py, tests/test_cotrain.py).

Rows are documents: bos, a bigram chain of the row's domain, maybe eos, padding; every batch is
a pure function of (seed, index), with a JSON iterator state like the grain pipeline's.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
import pytest

from specjax.checkpoint import load_model
from specjax.distill.config import default_distill_config, model_config
from specjax.distill.sources import DistillData
from specjax.models import split
from specjax.parallel import default_mesh_config
from specjax.train.config import default_train_config
from specjax.train.pretrain import PretrainData, pretrain

V, PAD, BOS, EOS = 32, 0, 1, 2
T, B = 32, 16
DOMAINS = ('a', 'b')
TOKENIZER = {'kind': 'synthetic-bigram', 'vocab_size': V, 'hash': 'bigram-v1'}
CORPUS = {'name': 'synthetic-bigram', 'manifest_hash': 'v1'}


# ------------------------------------------------------------------ synthetic data


def _transitions():
    rng = np.random.default_rng(0)
    mats = []
    for _ in DOMAINS:
        m = np.zeros((V, V))
        m[:, 3:] = rng.dirichlet(np.full(V - 3, 0.3), size=V) * 0.97
        m[:, EOS] = 0.03
        mats.append(m)
    return mats


_MATS = _transitions()


def bigram_batch(rng, b=B, t=T):
    """One row per document: bos, a bigram chain of its row's domain, eos (maybe), padding."""
    tokens = np.zeros((b, t), np.int32)
    seg = np.zeros((b, t), np.int32)
    dom = np.full((b, t), -1, np.int32)
    for i in range(b):
        d, n = i % len(DOMAINS), t
        tokens[i, 0] = BOS
        for j in range(1, t):
            tokens[i, j] = rng.choice(V, p=_MATS[d][tokens[i, j - 1]])
            if tokens[i, j] == EOS:
                n = j + 1
                break
        tokens[i, n:] = PAD
        seg[i, :n], dom[i, :n] = 1, d
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    return {'tokens': tokens, 'segment_ids': seg, 'positions': pos, 'domain_ids': dom}


class Batches:
    """Deterministic infinite batches with a JSON state, like the grain iterator: batch i is
    rows(np.random.default_rng([seed, i])) (bigram_batch unless given)."""

    def __init__(self, seed, rows=None):
        self.seed, self.index, self.rows = seed, 0, rows or bigram_batch

    def get_state(self):
        return {'index': self.index}

    def set_state(self, state):
        self.index = int(state['index'])

    def __iter__(self):
        return self

    def __next__(self):
        self.index += 1
        return self.rows(np.random.default_rng([self.seed, self.index - 1]))


def eval_batches(n=2):
    rng = np.random.default_rng(12345)
    return [bigram_batch(rng) for _ in range(n)]


def distill_data(seed=1, tokenizer=TOKENIZER):
    return DistillData(Batches(seed), eval_batches(), dict(tokenizer), CORPUS, V, DOMAINS, EOS)


def train_cfg(steps, lr=1e-2, **kw):
    c = default_train_config()
    c.update(
        steps=steps,
        batch_size=B,
        lr=lr,
        warmup_steps=2,
        log_every=10,
        eval_every=1000,
        eval_batches=2,
        checkpoint_every=1000,
        async_checkpointing=False,
    )
    c.update(kw)
    return c


def teacher_model_cfg():
    c = model_config('test', V, 64)
    c.d_model, c.d_ff = 64, 128
    return c


def distill_config(teacher_workdir, steps=30, train=None, **distill):
    c = ml_collections.ConfigDict()
    c.mode, c.seed = 'distill', 0
    c.draft = model_config('test', V, 64)
    c.data = ml_collections.ConfigDict({'seq_len': T})
    c.distill = default_distill_config()
    c.distill.update(
        teacher_workdir=teacher_workdir,
        prompt_len=8,
        max_new_tokens=T - 8,
        calibrate=False,
        final_spec_k=0,
        eval_generate_batches=0,
        eval_temperatures=(1.0,),
    )
    c.distill.update(distill)
    c.sampling = ml_collections.ConfigDict({'temperature': 1.0, 'top_k': 0, 'top_p': 1.0})
    c.train = train_cfg(steps, **(train or {}))
    c.mesh = default_mesh_config()
    return c


@pytest.fixture(scope='session')
def teacher_workdir(tmp_path_factory):
    """A tiny target pretrained for 80 steps on the synthetic bigram data."""
    workdir = str(tmp_path_factory.mktemp('teacher'))
    c = ml_collections.ConfigDict()
    c.mode, c.seed = 'pretrain', 0
    c.model = teacher_model_cfg()
    c.data = ml_collections.ConfigDict({'seq_len': T})
    c.train = train_cfg(80)
    c.mesh = default_mesh_config()
    data = PretrainData(Batches(0), eval_batches(), TOKENIZER, CORPUS, V, DOMAINS)
    pretrain(c, workdir, data=data)
    return workdir


def params_bytes(workdir, **kw):
    model, _ = load_model(workdir, **kw)
    return [np.asarray(x) for x in jax.tree.leaves(split(model)[1])]


def cotrain_config(steps=2):
    c = distill_config(
        '',
        steps=steps,
        eval_generate_batches=1,
        final_spec_k=4,
        divergence='jsd',
        beta=0.4,
        loss_temperature=2.0,
        scale_by_t2=True,
        ce_weight=0.3,
    )
    c.mode = 'cotrain'
    c.model = teacher_model_cfg()
    return c
