"""A sweep's summary dict (specjax.sweeps.aggregate.collect) as summary.md: the table of means and
intervals per point, the verdicts, pivot tables for a two-field grid, points not complete, run
times and the source files. Numbers are printed with `fmt` (4 significant digits).
"""

from __future__ import annotations

import math

import numpy as np


def fmt(x: float) -> str:
    return 'nan' if not math.isfinite(x) else f'{x:.4g}'


def cell(s: dict, bold: bool = False) -> str:
    if s['n'] == 0:
        return '—'
    text = fmt(s['mean'])
    if math.isfinite(s['lo']):
        text += f' [{fmt(s["lo"])}, {fmt(s["hi"])}]'
    else:
        text += f' (n={s["n"]})'
    return f'**{text}**' if bold else text


def run_time(summary: dict) -> str:
    done = [p for p in summary['points'] if p['status'] == 'complete' and p['duration_s']]
    if not done:
        return ''
    wall = [p['duration_s'] for p in done]
    cpu = [p['cpu_s'] for p in done if p.get('cpu_s') is not None]
    text = f'; point wall time total {sum(wall):.0f} s, median {float(np.median(wall)):.0f} s'
    if cpu:
        text += f'; CPU time total {sum(cpu):.0f} s, median {float(np.median(cpu)):.0f} s'
    return text


def _row(cells) -> str:
    return '| ' + ' | '.join(str(c) for c in cells) + ' |'


def markdown(summary: dict) -> str:
    """The summary as a markdown report (tables, verdicts, failures, sources)."""
    iv = summary['interval']
    confs, fields = summary['configurations'], summary['grid_fields']
    names = [m['metric'] for m in summary['metrics']]
    best = {m['metric']: m['best'] for m in summary['metrics']}
    n_done = sum(p['status'] == 'complete' for p in summary['points'])
    lines = [
        '# Sweep summary',
        '',
        f'Base config `{summary["base"]}`, seeds {summary["seeds"]}, '
        f'{n_done}/{len(summary["points"])} points complete{run_time(summary)}.',
        '',
        f'Cells: mean over seeds [{iv["confidence"]:.0%} interval: {iv["method"]}, '
        f'{iv["resamples"]} resamples, RNG seed {iv["rng_seed"]}]. Bold: best mean per column.',
        '',
        _row(['point', *[f.rsplit('.', 1)[-1] for f in fields], 'seeds', *names]),
        _row(['---'] * (2 + len(fields) + len(names))),
    ]
    for c in confs:
        values = [c['fields'].get(f, '') for f in fields]
        metric_cells = [cell(c['metrics'][m], best[m] == c['label']) for m in names]
        lines.append(
            _row([c['label'], *values, f'{c["n_complete"]}/{c["n_points"]}', *metric_cells])
        )
    lines += [
        '',
        '## Verdicts',
        '',
        "Winner: the best mean's interval overlaps no other point's interval (runner-up "
        'included); otherwise "no clear winner".',
        '',
        _row(['metric', 'better', 'best mean', 'verdict']),
        _row(['---'] * 4),
    ]
    lines += [_row([m['metric'], m['better'], m['best'], m['text']]) for m in summary['metrics']]
    if len(fields) == 2:
        lines += pivot_tables(summary)
    bad = [p for p in summary['points'] if p['status'] not in ('complete',)]
    if bad:
        lines += ['', '## Points not complete', '']
        lines += [
            f'- {p["name"]}: {p["status"]}'
            + (f' ({p["error"]}; log `{p["log"]}`)' if 'error' in p else '')
            for p in bad
        ]
    warned = [p for p in summary['points'] if 'warning' in p]
    lines += [f'- WARNING {p["name"]}: {p["warning"]}' for p in warned]
    lines += run_time_table(summary)
    lines += [
        '',
        '## Sources',
        '',
        'Every number above is computed from these files, relative to the sweep workdir '
        '(sha256 in summary.json):',
        '',
    ]
    lines += [f'- {c["label"]}: ' + ', '.join(f'`{s}`' for s in c['sources']) for c in confs]
    return '\n'.join(lines) + '\n'


def _mean_s(values) -> str:
    values = [v for v in values if v is not None]
    return fmt(float(np.mean(values))) if values else '—'


def run_time_table(summary: dict) -> list[str]:
    """Mean wall and CPU seconds of each configuration's finished points, then each
    prerequisite with the summary metrics its results.json holds."""
    done = [p for p in summary['points'] if p['status'] == 'complete']
    lines = [
        '',
        '## Run time',
        '',
        'Seconds per point (mean over finished seeds; wall time on '
        'a possibly shared machine, CPU = user + system of the point process).',
        '',
    ]
    lines += [_row(['point', 'wall s', 'CPU s']), _row(['---'] * 3)]
    for c in summary['configurations']:
        mine = [p for p in done if p['label'] == c['label']]
        wall, cpu = [p['duration_s'] for p in mine], [p.get('cpu_s') for p in mine]
        lines.append(_row([c['label'], _mean_s(wall), _mean_s(cpu)]))
    for p in summary.get('prereqs', []):
        extra = ', '.join(f'{k} {fmt(v)}' for k, v in p['metrics'].items())
        lines.append(
            _row(
                [
                    f'prereq {p["name"]} ({p["status"]}{"; " + extra if extra else ""})',
                    _mean_s([p['duration_s']]),
                    _mean_s([p['cpu_s']]),
                ]
            )
        )
    return lines


def pivot_tables(summary: dict) -> list[str]:
    """One table per metric: first grid field down, second across; variants listed below."""
    f1, f2 = summary['grid_fields']
    confs = summary['configurations']
    grid = [c for c in confs if not c['variant']]
    rows = list(dict.fromkeys(c['fields'][f1] for c in grid))
    cols = list(dict.fromkeys(c['fields'][f2] for c in grid))
    by = {(c['fields'][f1], c['fields'][f2]): c for c in grid}
    extra = [c for c in confs if c not in grid]
    lines = ['', '## Tables per metric', '']
    for m in summary['metrics']:
        name = m['metric']
        lines += [
            f'### {name} ({m["better"]} is better; {m["text"]})',
            '',
            _row([f'{f1.rsplit(".", 1)[-1]} \\ {f2.rsplit(".", 1)[-1]}', *cols]),
            _row(['---'] * (1 + len(cols))),
        ]
        for r in rows:
            cells = []
            for col in cols:
                c = by.get((r, col))
                cells.append(cell(c['metrics'][name], m['best'] == c['label']) if c else '')
            lines.append(_row([r, *cells]))
        lines.append('')
        lines += [
            f'- {c["label"]}: {cell(c["metrics"][name], m["best"] == c["label"])}' for c in extra
        ]
        lines.append('')
    return lines
