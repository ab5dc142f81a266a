"""report.md for the quickstart, generated only from the JSON its stages wrote (no typed numbers).

Reads <root>/<stage>/{results,spec_eval,serve}.json, the distill/cotrain metrics.jsonl (alpha over
training steps) and <root>/quickstart.json (seconds per stage); writes <root>/report.md and
<root>/plots/*.png (specjax.quickstart.plots). Numbers are printed with
specjax.evaluation.tables.fmt (3 significant digits), so they can be traced back to the JSON.
"""

from __future__ import annotations

import json
import os

from specjax import jsonio
from specjax.evaluation.tables import fmt, markdown_table
from specjax.sampling import stats as st

PAIRS = {  # spec_eval stage -> (label, training stage of the draft)
    'spec_ce': ('cross-entropy draft', 'draft_ce'),
    'spec_distilled': ('distilled draft', 'draft_distilled'),
    'spec_cotrain': ('co-trained pair', 'cotrain'),
}
REF_K = 4  # k of the bucket tables (or the largest evaluated k below it)
SERVE_NAMES = {
    'target': 'target alone (autoregressive)',
    'draft_distilled': 'distilled draft alone (replacement)',
    'draft_ce': 'cross-entropy draft alone',
    'spec_ce': 'target + CE draft (speculative)',
    'spec_distilled': 'target + distilled draft (both)',
}
MIB = 2.0**20
COTRAIN_SKIPPED = (
    'Co-training: not run in this preset (it updates the 135M target, which this CPU cannot '
    "train within the quickstart's budget)."
)


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def load(root: str) -> dict:
    """Every JSON the report reads, by stage name (cotrain / spec_cotrain / teacher_cache only
    where the preset has them: SmolLM2's has a teacher cache and no co-training)."""
    d = {'run': _json(os.path.join(root, 'quickstart.json'))}
    optional = {'cotrain', 'spec_cotrain'}
    for stage in ('target', 'draft_ce', 'draft_distilled', 'cotrain'):
        path = os.path.join(root, stage, 'results.json')
        if stage not in optional or os.path.exists(path):
            d[stage] = _json(path)
    for stage in PAIRS:
        path = os.path.join(root, stage, 'spec_eval.json')
        if stage not in optional or os.path.exists(path):
            d[stage] = _json(path)
    cache = os.path.join(root, 'teacher_cache', 'cache.json')
    if os.path.exists(cache):  # SmolLM2: the imported target's loss is measured on the cache
        d['teacher_cache'] = _json(cache)
        d['target']['eval'] = dict(d['target']['eval'], loss=d['teacher_cache']['target_val_loss'])
    d['serve'] = _json(os.path.join(root, 'serve', 'serve.json'))
    d['curves'] = {s: alpha_curve(root, s) for s in ('draft_ce', 'draft_distilled', 'cotrain')}
    return d


def pairs(d: dict) -> dict:
    """The PAIRS this run has (no spec_cotrain in the SmolLM2 preset)."""
    return {stage: v for stage, v in PAIRS.items() if stage in d}


def alpha_curve(root: str, stage: str) -> list[dict]:
    """Eval rows of <root>/<stage>/metrics.jsonl: [{'step', 'alpha_T0', 'alpha_T1'}]."""
    rows = []
    path = os.path.join(root, stage, 'metrics.jsonl')
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row.get('split') == 'eval' and 'alpha_T1' in row:
                    rows.append({k: row.get(k) for k in ('step', 'alpha_T0', 'alpha_T1')})
    return sorted({r['step']: r for r in rows}.values(), key=lambda r: r['step'])


def spec_runs(spec: dict, label: str) -> list[dict]:
    return sorted(
        (r for r in spec['runs'] if r['sampling_label'] == label and r['method'] == 'speculative'),
        key=lambda r: r['k'],
    )


def ar_run(spec: dict, label: str) -> dict:
    return next(
        r for r in spec['runs'] if r['sampling_label'] == label and r['method'] != 'speculative'
    )


def labels(spec: dict) -> list[str]:
    return list(dict.fromkeys(r['sampling_label'] for r in spec['runs']))


def ref_k(spec: dict) -> int:
    ks = sorted({r['k'] for r in spec['runs'] if r['k']})
    return max([k for k in ks if k <= REF_K] or ks[:1])


def run_at(spec: dict, label: str, k: int) -> dict:
    return next(r for r in spec_runs(spec, label) if r['k'] == k)


def flop_ratio(spec: dict) -> float:
    """Draft / target forward FLOPs per token ~ parameter ratio (tied head counted once)."""
    return spec['models']['draft']['num_params'] / spec['models']['target']['num_params']


def accelerator_model(spec: dict, label: str, ks) -> dict:
    """Predicted speedup with v(k) = 1 and c = FLOP ratio, from the measured alpha: a model."""
    alpha = spec['optimal_k'][label]['alpha'] or 0.0
    c = flop_ratio(spec)
    speedups = st.predicted_speedups(alpha, c, {int(k): 1.0 for k in ks})
    return {
        'alpha': alpha,
        'c': c,
        'speedups': speedups,
        'optimal_k': st.optimal_k(alpha, c, {int(k): 1.0 for k in ks}),
    }


def serve_row(serve: dict, method: str, batch: int) -> dict:
    return next(r for r in serve['rows'] if r['method'] == method and r['batch_size'] == batch)


def _ms(x):
    return None if x is None else 1e3 * x


def _mib(x):
    return None if x is None else x / MIB


def _peak(row: dict):
    return row['memory'].get('peak_estimate_bytes')


def break_even(train_s: float, saved_s_per_token: float) -> str:
    """Tokens to serve before training pays: train seconds / seconds saved per token."""
    if not saved_s_per_token or saved_s_per_token <= 0:
        return 'never (no time saved per token)'
    return f'{fmt(train_s / saved_s_per_token)} tokens'


def section_setup(d: dict) -> list[str]:
    t, sv = d['target'], d['serve']
    rows = [
        ['target', sv['num_params']['target'], t['eval'].get('loss'), '-'],
        [
            'cross-entropy draft',
            sv['num_params']['draft_ce'],
            d['draft_ce']['draft_val_loss'],
            d['draft_ce']['alpha_T1'],
        ],
        [
            'distilled draft',
            sv['num_params']['draft_distilled'],
            d['draft_distilled']['draft_val_loss'],
            d['draft_distilled']['alpha_T1'],
        ],
    ]
    if 'cotrain' in d:
        rows += [
            [
                'co-trained target',
                d['cotrain']['num_params_target'],
                d['cotrain']['target_val_loss'],
                '-',
            ],
            [
                'co-trained draft',
                d['cotrain']['num_params_draft'],
                d['cotrain']['draft_val_loss'],
                d['cotrain']['alpha_T1'],
            ],
        ]
    secs = d['run']['stage_seconds']
    cpu = d['run'].get('stage_cpu_seconds', {})
    beside = d['run'].get('stage_beside', {})
    load = ', '.join(fmt(x) for x in d['run'].get('load_average', ()))
    env = d['spec_distilled']['environment']
    return [
        '## Models and run times',
        '',
        markdown_table(
            ['model', 'params', 'validation loss (nats)', 'alpha_T1 vs its target'], rows
        ),
        '',
        f'Count-bigram baseline {fmt(t["baselines"].get("bigram"))} nats, unigram '
        f'{fmt(t["baselines"].get("unigram"))} nats (same validation tokens as the target).',
        '',
        markdown_table(
            ['stage', 'wall seconds', 'process CPU seconds', 'ran beside'],
            [[k, v, cpu.get(k), ', '.join(beside.get(k, ())) or '-'] for k, v in secs.items()]
            + [['total', sum(secs.values()), sum(cpu.values()) if cpu else None, '']],
        ),
        '',
        'Training stages run side by side in their own processes when config.parallel_stages '
        'allows (their wall seconds then include sharing the CPU); timing stages always run '
        'alone. The quickstart took '
        f'{fmt(d["run"].get("total_seconds"))} s from start to report.',
        '',
        f'Load average at the end of the last stage: {load} on {d["run"].get("cpu_count")} '
        'cores (above the core count the machine was shared and wall times are inflated; CPU '
        'seconds are inflated less).',
        '',
        f'Hardware: {env["backend"]} ({env["device_kind"]}), {env["cpu_count"]} CPU cores, jax '
        f'{env["jax_version"]}. Timings on a shared machine swing; compare ratios within a table.',
    ]


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
                [label, 'AR', '-', ar['alpha'], '-', '-', _ms(ar['time_per_token_s']), 1.0, '-']
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
                        _ms(r['time_per_token_s']),
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


def section_serving(d: dict) -> list[str]:
    sv = d['serve']
    mode = 'greedy' if sv['sampling']['temperature'] == 0 else 'sampled'
    rows = []
    for r in sv['rows']:
        rows.append(
            [
                SERVE_NAMES[r['method']],
                r['batch_size'],
                r['k'] or '-',
                _ms(r['ttft_s']),
                _ms(r['tpot_s']),
                r['tokens_per_s'],
                _mib(_peak(r)),
                r['same_tokens_as_target'],
            ]
        )
    return [
        f'## Serving: latency, throughput, memory ({mode}, {sv["max_new_tokens"]} output '
        f'tokens, k = {sv["k"]})',
        '',
        markdown_table(
            [
                'method',
                'batch',
                'k',
                'TTFT ms',
                'TPOT ms',
                'tokens/s',
                'peak memory MiB (params + caches + temps)',
                'tokens equal to target',
            ],
            rows,
        ),
        '',
        'Parameters: '
        + ', '.join(f'{n} {fmt(_mib(b))} MiB' for n, b in sv['param_bytes'].items())
        + f'. Process peak RSS {fmt(_mib(sv["process_memory"]["peak_rss_bytes"]))} MiB.',
        '',
    ]


def section_replacement(d: dict) -> list[str]:
    sv = d['serve']
    b1 = min(r['batch_size'] for r in sv['rows'])
    bn = max(r['batch_size'] for r in sv['rows'])
    rows = []
    s1, sn = serve_row(sv, 'draft_distilled', b1), serve_row(sv, 'draft_distilled', bn)
    for name, stage in (
        ('distilled draft', 'draft_distilled'),
        ('cross-entropy draft', 'draft_ce'),
    ):
        r = d[stage]
        speed = [_ms(s1['tpot_s']), sn['tokens_per_s'], _mib(_peak(s1))]
        rows.append(
            [name, r['draft_val_loss'], r['target_val_loss'], r['alpha_T0'], 1 - r['alpha_T1']]
            + (speed if stage == 'draft_distilled' else ['same as distilled'] * 3)
        )
    t1, tn = serve_row(sv, 'target', b1), serve_row(sv, 'target', bn)
    rows.append(
        [
            'target (reference)',
            d['target']['eval'].get('loss'),
            '-',
            1.0,
            0.0,
            _ms(t1['tpot_s']),
            tn['tokens_per_s'],
            _mib(_peak(t1)),
        ]
    )
    out = [
        '## Distillation as replacement: the draft served alone',
        '',
        'Token agreement = argmax agreement with the target on held-out text (alpha_T0); mean TV '
        '= 1 - alpha_T1.',
        '',
        markdown_table(
            [
                'model',
                'validation loss',
                "target's loss (same tokens)",
                'token agreement',
                'mean TV',
                f'TPOT ms (B={b1})',
                f'tokens/s (B={bn})',
                f'peak memory MiB (B={b1})',
            ],
            rows,
        ),
        '',
        '### Samples side by side (greedy)',
        '',
    ]
    for i, s in enumerate(sv['samples']):
        out += [f'**Prompt {i + 1}** ({s["domain"]}):', '', '```', s['prompt'], '```']
        for method in ('target', 'draft_distilled', 'draft_ce', 'spec_distilled'):
            out += [f'- {SERVE_NAMES[method]}:', '', '```', s[method], '```']
        out.append('')
    return out


def _spec_cell(spec: dict, k: int) -> str:
    runs = {r['k']: r for r in spec_runs(spec, 'T=0')}
    r = runs.get(k)
    if r is None:
        return '-'
    return f'acceptance {fmt(r["acceptance_rate"])}, tau {fmt(r["block_efficiency"])} (T=0, k={k})'


def _shared(d: dict, stage: str) -> str:
    beside = d['run'].get('stage_beside', {}).get(stage)
    return f', run beside {" and ".join(beside)}' if beside else ''


def section_side_by_side(d: dict) -> list[str]:
    sv = d['serve']
    b1 = min(r['batch_size'] for r in sv['rows'])
    secs = d['run']['stage_seconds']
    target, spec_ce, alone, both = (
        serve_row(sv, m, b1) for m in ('target', 'spec_ce', 'draft_distilled', 'spec_distilled')
    )
    k = sv['k']
    dd = d['draft_distilled']
    cal = d['spec_ce']['calibration']
    train = secs.get('draft_distilled', float('nan'))
    # the SmolLM2 preset's distilled draft also needed the teacher's outputs (the CE draft only
    # the vocabulary): the cache's teacher seconds count as its training cost
    teacher_s = d.get('teacher_cache', {}).get('teacher_train_seconds', 0.0)
    train += teacher_s
    what = 'draft_distilled training' + (
        f" + the teacher cache's {fmt(teacher_s)} teacher seconds" if teacher_s else ''
    )

    def latency(r):
        return (
            f'{fmt(_ms(r["tpot_s"]))} ms/token ({fmt(target["tpot_s"] / r["tpot_s"])}x the '
            f"target's {fmt(_ms(target['tpot_s']))})"
        )

    def exact(r):
        same = fmt(r['same_tokens_as_target'])
        return f"the target's, exactly (greedy: fraction of tokens equal {same})"

    rows = [
        ['stage', 'inference', 'training', 'training (the draft) + inference'],
        ['target online', 'yes', 'no', 'yes'],
        [
            'output distribution',
            exact(spec_ce),
            f'approximates the target: mean TV {fmt(1 - dd["alpha_T1"])}, validation loss '
            f'{fmt(dd["draft_val_loss"])} vs {fmt(dd["target_val_loss"])}',
            exact(both),
        ],
        [
            'main metric',
            _spec_cell(d['spec_ce'], k),
            f'agreement {fmt(dd["alpha_T0"])}, validation loss {fmt(dd["draft_val_loss"])}',
            _spec_cell(d['spec_distilled'], k),
        ],
        [
            'main cost',
            f'two models + verification: v({k}) = {fmt(cal["v"].get(str(k)))}, c = {fmt(cal["c"])}',
            f'data + training: {fmt(train)} s',
            f'training {fmt(train)} s + two models + verification',
        ],
        [f'measured latency (B={b1}, greedy)', latency(spec_ce), latency(alone), latency(both)],
        [f'memory (B={b1}, XLA estimate)']
        + [f'{fmt(_mib(_peak(r)))} MiB' for r in (spec_ce, alone, both)],
    ]
    headers = [
        'dimension',
        'speculative decoding (CE draft)',
        'distillation (draft alone)',
        'both (distilled draft, speculative)',
    ]
    return [
        '## Speculative decoding vs distillation vs both',
        '',
        markdown_table(headers, rows),
        '',
        f'Break-even ({what}: {fmt(train)} s{_shared(d, "draft_distilled")} '
        f'÷ serving seconds saved per token at batch {b1}): as a replacement of the target, '
        f'{break_even(train, target["tpot_s"] - alone["tpot_s"])}; as the draft of speculative '
        f'decoding, {break_even(train, target["tpot_s"] - both["tpot_s"])}.',
        '',
    ]


def section_training(d: dict) -> list[str]:
    secs = d['run']['stage_seconds']
    rows = []
    for stage, name in (
        ('draft_ce', 'cross-entropy draft'),
        ('draft_distilled', 'distilled draft'),
        ('cotrain', 'co-trained draft'),
    ):
        for row in d['curves'].get(stage) or []:
            rows.append([name, row['step'], row['alpha_T0'], row['alpha_T1']])
    sep = secs.get('target', 0.0) + secs.get('draft_distilled', 0.0)
    k = ref_k(d['spec_distilled'])
    label = 'T=1,top_k=0,top_p=1'
    k_ce, k_di, k_co = (
        run_at(d[s], label, k)['block_efficiency'] if s in d and label in labels(d[s]) else None
        for s in PAIRS
    )
    return [
        '## Alpha over training steps',
        '',
        markdown_table(['draft', 'step', 'alpha_T0', 'alpha_T1'], rows),
        '',
        (matched_compute(d, sep, secs) if 'cotrain' in d else COTRAIN_SKIPPED)
        + f' Measured tau at k = {k}, T = 1 (spec_eval): cross-entropy {fmt(k_ce)}, distilled '
        f'{fmt(k_di)}, co-trained {fmt(k_co)}.',
        '',
    ]


def matched_compute(d: dict, separate_s: float, secs: dict) -> str:
    """What the co-training comparison holds equal, read from the stages' configs."""
    co, di = d['cotrain']['config'], d['draft_distilled']['config']
    total, start = co['train']['steps'], co.get('init', {}).get('target_step', -1)
    draft = di['train']['steps']
    if not co.get('init', {}).get('target_workdir'):
        return (
            f'The co-trained pair trained from scratch for {total} steps (target + draft); the '
            f'distilled draft for {draft} steps after the target. Seconds: target + distilled '
            f'draft {fmt(separate_s)} s, co-training {fmt(secs.get("cotrain"))} s.'
        )
    together_s = secs.get('target', 0.0) + secs.get('cotrain', 0.0)
    return (
        f"Matched compute: co-training continues the target's pretraining from its step {start} "
        f'to {total} with a fresh draft, so the co-trained target takes the same {total} steps '
        f'on the same batches as the pretrained one (validation loss '
        f'{fmt(d["cotrain"]["target_val_loss"])} vs {fmt(d["target"]["eval"].get("loss"))}) and '
        f'its draft {total - start} steps, distilled online from the target while it trains; the '
        f'distilled draft takes {draft} steps from the finished target (co-training against '
        f'distillation after pretraining). Seconds: target + distilled draft {fmt(separate_s)} '
        f's, target + co-training {fmt(together_s)} s.'
    )


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
                'cost': r['k'] * cal['c'] + v_k,
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


def _draft_init(d: dict) -> str:
    """' Both drafts start from ...' as the draft stages recorded it ('' before they did)."""
    dd = d.get('draft_distilled', {})
    if dd.get('init') == 'target':
        return (
            f" Both drafts ({dd['num_params_draft']} parameters) start from the target's first "
            f'{dd["draft_layers"]} layer(s), its embedding rows of the N ids (tied head) and its '
            'final norm, then train on the cache alike.'
        )
    if dd.get('init') == 'random':
        return f' Both drafts ({dd["num_params_draft"]} parameters) start from one random init.'
    return ''


def _cache_rows(c: dict) -> str:
    """What the teacher ran on, for the reduced-vocabulary section."""
    if c.get('source', 'dataset') == 'teacher':
        in_set = c.get('generated_in_set')
        return (
            f'The teacher ran once: it continued the first (at most) {c["prompt_len"]} tokens '
            f'of {c["train_rows"]} corpus rows at T = '
            f'{" and ".join(fmt(t) for t in c["temperatures"])}'
            f'{" (batches in turn)" if len(c["temperatures"]) > 1 else ""} to '
            f'{c["seq_len"]} tokens ({c["generated_tokens"]} generated'
            + (f', {fmt(in_set)} of them in the set' if in_set is not None else '')
            + f'; {fmt(c["teacher_generate_seconds"])} s) and was scored on prompt and '
            f'continuation ({fmt(c["teacher_train_seconds"])} s together), '
        )
    return (
        f'The teacher ran once, teacher-forced on {c["train_rows"]} packed rows of '
        f'{c["seq_len"]} tokens ({fmt(c["teacher_train_seconds"])} s), '
    )


def section_reduced_vocab(d: dict) -> list[str]:
    """The SmolLM2 preset's reduced vocabulary and teacher cache (absent elsewhere)."""
    if 'teacher_cache' not in d:
        return []
    c = d['teacher_cache']
    return [
        '## Reduced draft vocabulary and teacher cache',
        '',
        f'Drafts cover the N = {c["reduced_vocab_size"]} most frequent target tokens of the '
        f'corpus (train split): {fmt(c["coverage_train"])} of its tokens. '
        + _cache_rows(c)
        + f'keeping its top {c["top_k"]} of the N tokens per position '
        f'({fmt(c["topk_mass_mean"])} of its probability mass on average). The cross-entropy '
        'draft trains on the packed corpus rows, the distilled draft on the rows the teacher '
        'scored, for the same steps and tokens per step. KD renormalises over those K, CE skips '
        "targets outside the set, and alpha is measured against the target's full distribution "
        '(the draft has q = 0 off the set). Validation losses are over held-out corpus '
        'positions whose next token is in the set.' + _draft_init(d),
        '',
        COTRAIN_SKIPPED,
        '',
    ]


def render(d: dict, plots: list[str]) -> str:
    lines = [
        '# specjax quickstart: speculate, distill, or both?',
        '',
        'Generated by `specjax.quickstart.report` from the JSON files the stages '
        'wrote under this workdir; no number in it is typed by hand.',
        '',
    ]
    lines += section_targets(d)
    lines += section_break_even_alpha(d)
    lines += section_reduced_vocab(d)
    lines += section_side_by_side(d)
    lines += section_setup(d)
    lines += section_speculative(d)
    lines += section_serving(d)
    lines += section_replacement(d)
    lines += section_training(d)
    lines += (
        ['## Plots', '']
        + [f'![{os.path.basename(p)}](plots/{os.path.basename(p)})' for p in plots]
        + ['']
    )
    return '\n'.join(lines)


def write(root: str, accelerator_ks=(1, 2, 3, 4, 5, 6, 7, 8)) -> str:
    """Writes <root>/report.md and <root>/plots/*.png; returns the report's path."""
    from specjax.quickstart import plots as quickstart_plots

    d = load(root)
    d['config_ks'] = tuple(int(k) for k in accelerator_ks)
    plots = quickstart_plots.write_all(d, os.path.join(root, 'plots'))
    path = os.path.join(root, 'report.md')
    jsonio.write_text(path, render(d, plots))
    return path
