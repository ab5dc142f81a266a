"""The quickstart report's serving sections: latency / throughput / memory per method, the
distilled draft served alone (replacement), and speculative decoding vs distillation vs both.

Every number comes from the serve, spec_eval and training-stage JSON loaded by
specjax.quickstart.report_data, printed with specjax.evaluation.tables.fmt.
"""

from __future__ import annotations

from specjax.evaluation.tables import fmt, markdown_table
from specjax.quickstart.report_data import (
    SERVE_NAMES,
    peak_bytes,
    serve_row,
    spec_runs,
    to_mib,
    to_ms,
)


def break_even(train_s: float, saved_s_per_token: float) -> str:
    """Tokens to serve before training pays: train seconds / seconds saved per token."""
    if not saved_s_per_token or saved_s_per_token <= 0:
        return 'never (no time saved per token)'
    return f'{fmt(train_s / saved_s_per_token)} tokens'


def speed_words(reference_s: float, s: float, reference: str = 'the target') -> str:
    """'2.33x faster than the target (0.28 ms)' / '2.33x slower than ...': the ratio > 1 worded
    the way it goes."""
    ratio = reference_s / s
    way = 'faster' if ratio >= 1 else 'slower'
    return f'{fmt(max(ratio, 1 / ratio))}x {way} than {reference} ({fmt(to_ms(reference_s))} ms)'


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
                to_ms(r['ttft_s']),
                to_ms(r['tpot_s']),
                r['tokens_per_s'],
                to_mib(peak_bytes(r)),
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
        + ', '.join(f'{n} {fmt(to_mib(b))} MiB' for n, b in sv['param_bytes'].items())
        + f'. Process peak RSS {fmt(to_mib(sv["process_memory"]["peak_rss_bytes"]))} MiB.',
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
        speed = [to_ms(s1['tpot_s']), sn['tokens_per_s'], to_mib(peak_bytes(s1))]
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
            to_ms(t1['tpot_s']),
            tn['tokens_per_s'],
            to_mib(peak_bytes(t1)),
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
    cpu = d['run'].get('stage_cpu_seconds', {})
    wall = secs.get('draft_distilled', float('nan'))
    train = cpu.get('draft_distilled', wall)  # CPU seconds: not inflated by stages beside it
    # the SmolLM2 preset's distilled draft also needed the teacher's outputs (the CE draft only
    # the vocabulary): the cache's teacher seconds count as its training cost
    teacher_s = d.get('teacher_cache', {}).get('teacher_train_seconds', 0.0)
    train += teacher_s
    what = 'draft_distilled training, process CPU seconds' + (
        f" + the teacher cache's {fmt(teacher_s)} teacher seconds" if teacher_s else ''
    )
    cost = f'training {fmt(train)} CPU s ({fmt(wall)} s wall{_shared(d, "draft_distilled")})'

    def latency(r):
        return f'{fmt(to_ms(r["tpot_s"]))} ms/token, ' + speed_words(target['tpot_s'], r['tpot_s'])

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
            f'teacher-forced agreement {fmt(dd["alpha_T0"])}; served alone, greedy tokens equal '
            f"to the target's: {fmt(alone['same_tokens_as_target'])}; validation loss "
            f'{fmt(dd["draft_val_loss"])}',
            _spec_cell(d['spec_distilled'], k),
        ],
        [
            'main cost',
            f'two models + verification: v({k}) = {fmt(cal["v"].get(str(k)))}, c = {fmt(cal["c"])}',
            f'data + {cost}',
            f'{cost} + two models + verification',
        ],
        [f'measured latency (B={b1}, greedy)', latency(spec_ce), latency(alone), latency(both)],
        [f'memory (B={b1}, XLA estimate)']
        + [f'{fmt(to_mib(peak_bytes(r)))} MiB' for r in (spec_ce, alone, both)],
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
        f'Break-even ({what}: {fmt(train)} s ÷ serving seconds saved per token at batch '
        f'{b1}): as a replacement of the target, '
        f'{break_even(train, target["tpot_s"] - alone["tpot_s"])}, and it trades quality for '
        f"that: its output is not the target's (mean TV {fmt(1 - dd['alpha_T1'])}, greedy "
        f'tokens equal {fmt(alone["same_tokens_as_target"])}); as the draft of speculative '
        f"decoding, {break_even(train, target['tpot_s'] - both['tpot_s'])}, with the target's "
        'output exactly.',
        '',
    ]
