"""The quickstart report's speculative-decoding sections: each draft's k sweep, acceptance by
position / sampling / bucket, the accelerator model, the 1.25 x tau target and the alpha a k needs.

Every number comes from the spec_eval (and serve) JSON loaded by specjax.quickstart.report_data,
printed with specjax.evaluation.tables.fmt.
"""

from __future__ import annotations

from specjax.evaluation.tables import fmt, markdown_table
from specjax.quickstart.report_data import (
    accelerator_model,
    ar_run,
    labels,
    pairs,
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
                [label, 'AR', '-', ar['alpha'], '-', '-', to_ms(ar['time_per_token_s']), 1.0, '-']
            )
            for r in spec_runs(spec, label):
                mark = ('*' if r['k'] == opt['best_measured_k'] else '') + (
                    '+' if r['k'] == opt['predicted_optimal_k'] else ''
                )
                rows.append(
                    [
                        label,
                        f'{r["k"]}{mark}',
                        r['acceptance_rate'],
                        r['alpha'],
                        r['block_efficiency'],
                        r['expected_block_efficiency'],
                        to_ms(r['time_per_token_s']),
                        r['measured_speedup'],
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
            rows.append([name, label, r['k']] + r['acceptance_per_position_conditional'])
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
            r = run_at(d[stage], label, k)
            rows.append([name, label, r['acceptance_rate'], r['alpha'], r['block_efficiency']])
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
                            b['sampling_label'],
                            b[bucket],
                            b['rows'],
                            b['acceptance_rate'],
                            b['block_efficiency'],
                        ]
                    )
        out += [
            f'### Acceptance by {title} (k = {k})',
            '',
            markdown_table(['draft', 'sampling', bucket, 'prompts', 'acceptance', 'tau'], rows),
            '',
        ]
    return out


def section_accelerator(d: dict) -> list[str]:
    ks = d['config_ks']
    out = [
        '### The same alpha on an accelerator (a model, not a measurement)',
        '',
        'Predicted speedup = E[tau](alpha) / (k c + v) with v = 1 (verification as cheap as one '
        'step) and c = draft / target forward FLOPs per token (parameter ratio, tied head '
        'counted once), alpha as measured above.',
        '',
    ]
    rows = []
    for stage, (name, _) in pairs(d).items():
        spec = d[stage]
        for label in labels(spec):
            m = accelerator_model(spec, label, ks)
            rows.append(
                [name, label, m['alpha'], m['c'], m['optimal_k']] + [m['speedups'][k] for k in ks]
            )
    out += [
        markdown_table(
            ['draft', 'sampling', 'alpha', 'c (FLOPs)', 'optimal k'] + [f'k={k}' for k in ks], rows
        ),
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
        if label not in labels(d['spec_ce']) or label not in labels(d['spec_distilled']):
            continue
        ce, di = run_at(d['spec_ce'], label, k), run_at(d['spec_distilled'], label, k)
        ratio = di['block_efficiency'] / ce['block_efficiency']
        needed = st.alpha_for_tau(1.25 * ce['block_efficiency'], k)
        rows.append(
            [
                label,
                k,
                ce['block_efficiency'],
                di['block_efficiency'],
                ratio,
                'met' if ratio >= 1.25 else 'not met',
                di['alpha'],
                'unreachable' if needed is None else needed,
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
    ]
    return [
        '## Target: distilled tau >= 1.25 x cross-entropy tau',
        '',
        markdown_table(header, rows),
        '',
        'alpha for 1.25: the alpha at which the i.i.d. model E[tau] = (1 - alpha^(k+1)) / '
        "(1 - alpha) reaches 1.25 x the cross-entropy draft's measured tau.",
        '',
    ]


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
