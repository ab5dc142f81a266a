"""spec_eval's summaries of its spec_eval.json dict: results.json's numbers (`headline`) and the
printed table (`table_markdown`)."""

from __future__ import annotations

from specjax.evaluation.tables import fmt, key_safe, markdown_table


def headline(result: dict) -> dict:
    """results.json: numbers only, keys without dots (for sweep summaries)."""
    out = {'c': result['calibration']['c'], 'v': result['calibration']['v']}
    for r in result['runs']:
        node = out.setdefault(key_safe(r['sampling_label']), {})
        if r['method'] == 'autoregressive':
            node['autoregressive'] = {
                'time_per_token_s': r['time_per_token_s'],
                'alpha': r['alpha'],
            }
            continue
        node[f'k{r["k"]}'] = {
            name: r[name]
            for name in (
                'acceptance_rate',
                'accepted_fraction',
                'block_efficiency',
                'alpha',
                'expected_block_efficiency',
                'time_per_token_s',
                'measured_speedup',
                'predicted_speedup',
                'speedup_ratio',
            )
        }
    for label, o in result['optimal_k'].items():
        out[key_safe(label)]['optimal_k'] = {
            'predicted': o['predicted_optimal_k'],
            'best_measured': o['best_measured_k'],
        }
    spec = [r for r in result['runs'] if r['method'] == 'speculative']
    if len(spec) == 1:  # one (k, sampling): the same keys at every sweep point (k_temperature)
        r, v = spec[0], result['calibration']['v']
        node = out[key_safe(r['sampling_label'])]
        out['point'] = dict(
            node[f'k{r["k"]}'],
            k=r['k'],
            temperature=r['sampling']['temperature'],
            v_k=v.get(r['k'], v.get(str(r['k']))),
            autoregressive_time_per_token_s=node['autoregressive']['time_per_token_s'],
        )
    return out


def table_markdown(result: dict) -> str:
    """The printed summary: one row per (sampling, method, k)."""
    headers = [
        'sampling',
        'k',
        'acc. rate',
        'alpha',
        'tau',
        'E[tau](alpha)',
        'tau batch',
        'ms/token',
        'speedup',
        'predicted',
        'ratio',
        'ratio (tau batch)',
        'compile s',
    ]
    rows = []
    for r in result['runs']:
        spec = r['method'] == 'speculative'
        rows.append(
            [
                r['sampling_label'],
                r['k'] if spec else 'AR',
                r.get('acceptance_rate'),
                r.get('alpha'),
                r.get('block_efficiency'),
                r.get('expected_block_efficiency'),
                r.get('batch_block_efficiency'),
                1e3 * r['time_per_token_s'],
                r.get('measured_speedup'),
                r.get('predicted_speedup'),
                r.get('speedup_ratio'),
                r.get('speedup_ratio_batch'),
                r['compile_s'],
            ]
        )
    cal = result['calibration']
    v = ', '.join(f'{k}: {x:.2f}' for k, x in cal['v'].items())
    lines = [
        markdown_table(headers, rows),
        '',
        f'c = {cal["c"]:.3f}; v(k) = {{{v}}} (batch {cal["batch_size"]})',
    ]
    for label, o in result['optimal_k'].items():
        lines.append(
            f'{label}: optimal k predicted {o["predicted_optimal_k"]} '
            f'(alpha {fmt(o["alpha"])}, {o.get("acceptance", "probabilistic")}), '
            f'best measured {o["best_measured_k"]}'
        )
    return '\n'.join(lines)
