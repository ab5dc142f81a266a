"""Smoke test of benchmarks.weight_layout on one layer: both layouts compute the same products
(the benchmark checks it before timing) and every layout and row count has a row."""

from __future__ import annotations

import json

from benchmarks import weight_layout


def test_every_layout_and_row_count_is_timed(tmp_path):
    out = tmp_path / 'layout.json'
    argv = ['--layers=1', '--rows=1,5', '--iters=2', '--repeats=1', f'--out={out}']
    result = weight_layout.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    got = {(r['layout'], r['rows']) for r in result['rows']}
    assert got == {(layout, w) for layout in weight_layout.LAYOUTS for w in (1, 5)}
    assert all(r['ms'] > 0 for r in result['rows'])
    assert [r['v'] for r in result['rows'] if r['rows'] == 1] == [1.0, 1.0]
