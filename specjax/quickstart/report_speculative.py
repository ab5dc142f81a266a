"""The quickstart report's speculative-decoding sections: each draft's k sweep, acceptance by
position / sampling / bucket, the accelerator model, the 1.25 x tau target and the alpha a k needs.

Every number comes from the spec_eval (and serve) JSON loaded by specjax.quickstart.report_data,
printed with specjax.evaluation.tables.fmt.
"""

from __future__ import annotations

from specjax.evaluation import intervals
from specjax.evaluation.tables import fmt, fmt_count, fmt_interval, human_label, markdown_table
from specjax.quickstart.report_data import (
    accelerator_model,
    ar_run,
    cost_ratios,
    has_run,
    interval,
    labels,
    pairs,
    position_counts,
    ref_k,
    run_at,
    serve_row,
    spec_runs,
    to_ms,
)
from specjax.sampling import stats as st


def section_speculative(d: dict) -> list[str]:
    out = ['## Speculative decoding with each draft', '']
    first = d['spec_distilled']
    cal = first['calibration']
    k = ref_k(first)
    out += [
        f'**On this {first["environment"]["backend"].upper()} verification is not free**: '
        f'scoring k + 1 tokens in one target call costs v(k) single decode steps, measured '
        f'v({k}) = {fmt(cal["v"].get(str(k)))} (accelerators: v close to 1), and '
        f'one draft step costs c = {fmt(cal["c"])} target steps (distilled pair, batch '
        f'{cal["batch_size"]}). Measured speedups below include both costs.',
        '',
    ]
    for stage, (name, _) in pairs(d).items():
        spec = d[stage]
        cal = spec['calibration']
        out += [f'### {name} (`{stage}`)', '']
        out += [
            f'c = {fmt(cal["c"])}; v(k) = '
            + ', '.join(f'{k}: {fmt(x)}' for k, x in cal['v'].items())
            + '. `*` = best measured k, `+` = predicted optimal k (tau / (k c + v(k))).',
            '',
        ]
        rows = []
        for label in labels(spec):
            ar = ar_run(spec, label)
            opt = spec['optimal_k'][label]
            rows.append(
                [
                    human_label(label),
                    'AR',
                    '-',
                    fmt_interval(ar['alpha'], ar.get('alpha_interval')),
                    '-',
                    '-',
                    to_ms(ar['time_per_token_s']),
                    1.0,
                    '-',
                ]
            )
            for r in spec_runs(spec, label):
                several = len(spec_runs(spec, label)) > 1  # no star where one k ran
                mark = ('*' if several and r['k'] == opt['best_measured_k'] else '') + (
                    '+' if several and r['k'] == opt['predicted_optimal_k'] else ''
                )
                rows.append(
                    [
                        human_label(label),
                        f'{r["k"]}{mark}',
                        fmt_interval(r['acceptance_rate'], interval(r, 'acceptance_rate')),
                        fmt_interval(r['alpha'], interval(r, 'alpha')),
                        fmt_interval(r['block_efficiency'], interval(r, 'block_efficiency')),
                        r['expected_block_efficiency'],
                        to_ms(r['time_per_token_s']),
                        fmt_interval(r['measured_speedup'], (r.get('speedup') or {}).get('range')),
                        r['predicted_speedup'],
                    ]
                )
        out += [
            markdown_table(
                [
                    'sampling',
                    'k',
                    'acceptance',
                    'alpha',
                    'tau',
                    'E[tau](alpha)',
                    'ms/token (B=8)',
                    'measured speedup',
                    'predicted speedup',
                ],
                rows,
            ),
            '',
        ]
    out += section_buckets(d)
    out += section_accelerator(d)
    return out


def section_buckets(d: dict) -> list[str]:
    out = []
    k = ref_k(d['spec_distilled'])
    rows = []
    for stage, (name, _) in pairs(d).items():
        spec = d[stage]
        for label in labels(spec):
            r = run_at(spec, label, max(x['k'] for x in spec_runs(spec, label)))
            cells = [
                fmt_count(p, a, e)
                for p, (a, e) in zip(
                    r['acceptance_per_position_conditional'], position_counts(r), strict=True
                )
            ]
            rows.append([name, human_label(label), r['k']] + cells)
    width = max(len(r) for r in rows) - 3
    out += [
        '### Acceptance per position (conditional: accepted at i given i was examined)',
        '',
        markdown_table(
            ['draft', 'sampling', 'k'] + [f'pos {i + 1}' for i in range(width)],
            [r + ['-'] * (width + 3 - len(r)) for r in rows],
        ),
        '',
        f'### Acceptance by temperature and top-p (k = {k})',
        '',
    ]
    rows = []
    for stage, (name, _) in pairs(d).items():
        for label in labels(d[stage]):
            if not has_run(d[stage], label, k):  # a pair evaluated at its own ks
                continue
            r = run_at(d[stage], label, k)
            rows.append(
                [name, human_label(label), r['acceptance_rate'], r['alpha'], r['block_efficiency']]
            )
    out += [markdown_table(['draft', 'sampling', 'acceptance', 'alpha', 'tau'], rows), '']
    for bucket, title in (
        ('domain', 'domain'),
        ('prompt_len', 'prompt length (tokens)'),
        ('gen_len', 'generated length (tokens)'),
    ):
        rows = []
        for stage, (name, _) in pairs(d).items():
            for b in d[stage]['buckets'][bucket]:
                if b['k'] == k:
                    rows.append(
                        [
                            name,
                            human_label(b['sampling_label']),
                            b[bucket],
                            b['rows'],
                            b['acceptance_rate'],
                            b['block_efficiency'],
                        ]
                    )
        out += [f'### Acceptance by {title} (k = {k})', '']
        if len({row[2] for row in rows}) == 1:  # one bucket: a sentence, not a table
            out += [f'All prompts fall in one bucket ({rows[0][2]}): see the k = {k} rows above.']
        else:
            header = ['draft', 'sampling', bucket, 'prompts', 'acceptance', 'tau']
            out.append(markdown_table(header, rows))
        out.append('')
    return out


def section_accelerator(d: dict) -> list[str]:
    ks = d['config_ks']
    out = [
        '### The same alpha on an accelerator (a model, not a measurement)',
        '',
        'Predicted speedup = E[tau](alpha) / (k c + v(k)) at the best k, from the alpha measured '
        'above, under three costs of a draft step c (the parameter ratio: compute-bound; the '
        'layer ratio: latency-bound, batch 1 on an accelerator; the value measured here) and two '
        'costs of verification v (1: scoring k + 1 tokens costs one step, as on an accelerator '
        f'at small batch, any k in {min(ks)}..{max(ks)}; v(k) measured here, measured k only). '
        'Each cell: speedup (best k).',
        '',
    ]
    rows, header = [], None
    for stage, (name, _) in pairs(d).items():
        spec = d[stage]
        for label in labels(spec):
            m = accelerator_model(spec, label, ks)
            header = header or [f'c {x["c_source"]}, {x["v_source"]}' for x in m['scenarios']]
            cells = [f'{fmt(x["speedup"])} (k = {x["k"]})' for x in m['scenarios']]
            rows.append([name, human_label(label), m['alpha']] + cells)
    c_rows = [
        [name] + list(cost_ratios(d[stage]).values()) for stage, (name, _) in pairs(d).items()
    ]
    out += [
        markdown_table(['draft', 'c parameter ratio', 'c layer ratio', 'c measured'], c_rows),
        '',
        markdown_table(['draft', 'sampling', 'alpha'] + header, rows),
        '',
    ]
    return out


def section_targets(d: dict) -> list[str]:
    """Per sampling at the reference k: both drafts' tau, their ratio, and the alpha the
    distilled draft would need for a ratio of 1.25 (E[tau](alpha, k) = 1.25 x the CE draft's
    measured tau; a model, beside its measured alpha)."""
    rows = []
    k = ref_k(d['spec_distilled'])
    for label in ('T=1,top_k=0,top_p=1', 'T=0'):
        if not (has_run(d['spec_ce'], label, k) and has_run(d['spec_distilled'], label, k)):
            continue
        ce, di = run_at(d['spec_ce'], label, k), run_at(d['spec_distilled'], label, k)
        ratio = di['block_efficiency'] / ce['block_efficiency']
        paired = intervals.paired_ratio_interval(ce['per_row'], di['per_row'], 'block_efficiency')
        needed = st.alpha_for_tau(1.25 * ce['block_efficiency'], k)
        rows.append(
            [
                human_label(label),
                k,
                ce['block_efficiency'],
                di['block_efficiency'],
                ratio,
                _met(ratio, paired['interval']),
                di['alpha'],
                'unreachable' if needed is None else needed,
                fmt_interval(paired['value'], paired['interval']),
            ]
        )
    header = [
        'sampling',
        'k',
        'tau CE draft',
        'tau distilled draft',
        'ratio',
        'target 1.25',
        'alpha distilled',
        'alpha for 1.25 (E[tau] model)',
        'ratio [95% interval]',
    ]
    return [
        '## Target: distilled tau >= 1.25 x cross-entropy tau',
        '',
        markdown_table(header, rows),
        '',
        'alpha for 1.25: the alpha at which the i.i.d. model E[tau] = (1 - alpha^(k+1)) / '
        "(1 - alpha) reaches 1.25 x the cross-entropy draft's measured tau. The ratio's "
        'interval is a paired bootstrap over prompts (both drafts on the same prompts, the same '
        'draws for both); the target is met only when the interval lies above 1.25.',
        '',
    ]


def _met(ratio: float, interval) -> str:
    """'met' / 'not met' for tau ratio >= 1.25, 'unresolved' when the interval straddles it."""
    lo, hi = interval if interval and None not in interval else (ratio, ratio)
    return 'met' if lo >= 1.25 else 'not met' if hi < 1.25 else 'unresolved'


def needed_alpha_rows(spec: dict, label: str = 'T=0') -> list[dict]:
    """Per k: measured alpha and speedup, round cost k c + v(k) from the measured calibration,
    and the alpha at which the predicted speedup reaches 1 (None: not even at alpha = 1)."""
    if label not in labels(spec):
        return []
    cal, out = spec['calibration'], []
    for r in spec_runs(spec, label):
        v_k = cal['v'][str(r['k'])]
        out.append(
            {
                'k': r['k'],
                'alpha': r['alpha'],
                'measured_speedup': r['measured_speedup'],
                'cost': st.round_cost(r['k'], cal['c'], v_k),
                'needed_alpha': st.required_alpha(r['k'], cal['c'], v_k),
            }
        )
    return out


def _serve_speedups(d: dict) -> str:
    """' Serving (serve stage) ...': each speculative pair's tokens/s and time per output token
    against the target's at the serve stage's smallest batch, when it decoded greedily."""
    sv = d.get('serve')
    if not sv or sv.get('sampling', {}).get('temperature') != 0.0:
        return ''
    b = min(r['batch_size'] for r in sv['rows'])
    target = serve_row(sv, 'target', b)
    parts = []
    for method, name in (('spec_ce', 'cross-entropy draft'), ('spec_distilled', 'distilled draft')):
        r = serve_row(sv, method, b)
        parts.append(
            f'{name} {fmt(r["tokens_per_s"] / target["tokens_per_s"])}x the tokens/s '
            f'({fmt(target["tpot_s"] / r["tpot_s"])}x after the first token)'
        )
    return (
        f' Serving (stage serve: batch {b}, {sv["max_new_tokens"]} greedy tokens, k = '
        f'{sv["k"]}, prefill included): ' + '; '.join(parts) + " against the target's."
    )


def section_break_even_alpha(d: dict) -> list[str]:
    """A draft and k with measured speedup > 1 at T = 0, or the alpha each k would need."""
    rows, best = [], None
    for stage, (name, _) in pairs(d).items():
        for r in needed_alpha_rows(d[stage]):
            need = r['needed_alpha']
            rows.append(
                [name, r['k'], r['alpha'], r['measured_speedup'], r['cost'],
                 need if need is not None else 'unreachable (k c + v(k) > k + 1)']
            )  # fmt: skip
            if best is None or r['measured_speedup'] > best[2]:
                best = (name, r['k'], r['measured_speedup'])
    if not rows:
        return []
    if best[2] > 1.0:
        verdict = (
            f'**Speedup > 1 at T = 0 on this CPU**: {best[0]}, k = {best[1]}, measured '
            f'{fmt(best[2])}x.'
        )
    else:
        verdict = (
            f'**No draft and k reaches speedup 1 at T = 0 on this CPU** (best: {best[0]}, k = '
            f'{best[1]}, {fmt(best[2])}x). The last column is the alpha each k needs, from the '
            'measured c and v(k): E[tau](alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) = k c + v(k).'
        )
    return [
        '## Speedup at T = 0, or the alpha needed',
        '',
        verdict + _serve_speedups(d),
        '',
        markdown_table(
            [
                'draft',
                'k',
                'measured alpha',
                'measured speedup',
                'k c + v(k)',
                'alpha needed for speedup 1',
            ],
            rows,
        ),  # fmt: skip
        '',
    ]
