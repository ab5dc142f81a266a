"""Smoke test of benchmarks.round_profile (the figure of record for measured ÷ predicted speedup)
on a tiny random pair whose draft has a reduced vocabulary: every piece is timed (at T = 1, the
path that samples and expands q; greedy's pieces are a subset of its operations) and the derived
figures follow from the timed ones."""

from __future__ import annotations

import numpy as np
from sampling_models import make_model, tiny_config

from benchmarks import round_profile
from specjax.sampling import SamplingConfig

K, MAX_NEW = 2, 6


def test_every_piece_is_timed_on_a_reduced_vocabulary_draft():
    target = make_model(tiny_config(vocab_size=23, max_len=32), seed=0)
    ids = np.array([4, 0, 9, 17, 2, 11, 22, 5], np.int32)  # the draft's 8 target ids
    draft = make_model(tiny_config(vocab_size=len(ids), max_len=32), seed=1)
    p = round_profile.profile(
        target, draft, batch=2, k=K, width=4, max_new=MAX_NEW,
        sampling=SamplingConfig(1.0), iters=2, repeats=1, draft_vocab_ids=ids,
    )  # fmt: skip
    assert set(round_profile.ROWS) <= set(p['ms']), set(round_profile.ROWS) - set(p['ms'])
    assert all(t > 0 for t in p['ms'].values()), p['ms']
    assert p['draft_vocab_size'] == len(ids) and p['rounds'] >= 1
    ms = p['ms']
    np.testing.assert_allclose(p['c'], ms['draft step'] / ms['target step'])
    np.testing.assert_allclose(p['predicted_round_ms'], K * ms['draft step'] + ms['verify call'])
    np.testing.assert_allclose(
        p['measured_over_predicted'], p['measured_speedup'] / p['predicted_speedup']
    )
    assert 1 <= p['tau_per_batch'] <= K + 1
    assert '| round |' in round_profile.table([p])
