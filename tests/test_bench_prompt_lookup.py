"""benchmarks.prompt_lookup's summaries on made-up timings (no model): speedups over plain and
the decoding cost without the prefill, from the difference of a long and a short run."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import prompt_lookup as pl

NEW, SHORT = 64, 16


def _run(seconds, calls):
    return dict(tokens=np.zeros(NEW, np.int32), target_calls=calls, seconds=seconds)


@pytest.fixture
def made_up():
    items = [('code', 'a'), ('code', 'b')]
    # plain: 0.1 s of prefill + 0.05 s a token; the chain: the same prefill + 0.08 s a round,
    # 40 rounds for 64 tokens and 10 for 16.
    results = {}
    for i in range(2):
        results[('specjax', 'plain', 'greedy', i)] = _run(0.1 + 0.05 * NEW, NEW)
        results[('specjax', 'plain', 'greedy', i, 'short')] = _run(0.1 + 0.05 * SHORT, SHORT)
        results[('specjax', 'ngram', 'greedy', i)] = _run(0.1 + 0.08 * 40, 40)
        results[('specjax', 'ngram', 'greedy', i, 'short')] = _run(0.1 + 0.08 * 10, 10)
    return items, results


def test_decode_costs_leave_the_prefill_out(made_up):
    items, results = made_up
    rows = pl.summarise(results, items, NEW)
    pl.add_decode_costs(rows, results, items, NEW, SHORT)
    by = {r['method']: r for r in rows}
    assert by['plain']['decode_ms_per_token'] == pytest.approx(50.0)
    assert by['plain']['round_in_plain_steps'] == pytest.approx(1.0)
    assert by['ngram']['decode_ms_per_round'] == pytest.approx(80.0)
    assert by['ngram']['decode_ms_per_token'] == pytest.approx(80.0 * 30 / 48)
    assert by['ngram']['round_in_plain_steps'] == pytest.approx(1.6)
    assert by['ngram']['tau'] == pytest.approx(NEW / 40)
    assert by['ngram']['speedup'] == pytest.approx((0.1 + 0.05 * NEW) / (0.1 + 0.08 * 40))
    assert '| ngram | greedy | code | 50.0 | 80.0 | 1.60 |' in pl.decode_table(rows)


def test_short_new_is_checked_before_any_work():
    with pytest.raises(SystemExit, match='--short_new=96'):
        pl.main(['--short_new=96', '--max_new_tokens=96'])
