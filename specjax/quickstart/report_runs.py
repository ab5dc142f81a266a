"""The quickstart report's run sections: the models and stage run times, alpha over training
steps (with what the co-training comparison holds equal), and the SmolLM2 preset's reduced
vocabulary and teacher cache.

Every number comes from the stages' JSON loaded by specjax.quickstart.report_data, printed with
specjax.evaluation.tables.fmt.
"""

from __future__ import annotations

from specjax.evaluation.tables import fmt, markdown_table
from specjax.quickstart.report_data import PAIRS, has_run, input_digests, pairs, ref_k, run_at

COTRAIN_SKIPPED = (
    'Co-training: not run in this preset (it updates the 135M target, which this CPU cannot '
    "train within the quickstart's budget)."
)


def compile_seconds(d: dict) -> dict:
    """Per timing stage, the seconds its samplers took to compile (spec_eval.json's runs and
    serve.json's rows, compile_s each)."""
    out = {s: sum(r['compile_s'] for r in d[s]['runs']) for s in pairs(d)}
    out['serve'] = sum(r['compile_s'] for r in d['serve']['rows'])
    return out


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
    if 'draft_feature' in d:  # alpha_step0: teacher-forced on the target's true features
        f = d['draft_feature']
        rows.append(['feature draft (EAGLE-3)', f['num_params_draft'], '-', f['alpha_step0']])
    secs = d['run']['stage_seconds']
    cpu = d['run'].get('stage_cpu_seconds', {})
    beside = d['run'].get('stage_beside', {})
    compiles = compile_seconds(d)
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
            ['stage', 'wall seconds', 'process CPU seconds', 'compiling samplers', 'ran beside'],
            [
                [k, v, cpu.get(k), compiles.get(k), ', '.join(beside.get(k, ())) or '-']
                for k, v in secs.items()
            ]
            + [
                [
                    'sum over stages',
                    sum(secs.values()),
                    sum(cpu.values()) if cpu else None,
                    sum(compiles.values()),
                    'stages beside each other overlap: the sum exceeds the elapsed time',
                ]
            ],
        ),
        '',
        'Training stages run side by side in their own processes when config.parallel_stages '
        'allows (their wall seconds then include sharing the CPU); timing stages always run '
        'alone. Elapsed from start to report: '
        f'{fmt(d["run"].get("total_seconds"))} s. Costs elsewhere in this report are process '
        'CPU seconds, which sharing the CPU inflates less than wall seconds. "Compiling '
        'samplers": wall seconds the timing stages spent compiling their samplers ahead of '
        'time (per program: compile_s in spec_eval.json and serve.json).',
        '',
        f'Load average at the end of the last stage: {load} on {d["run"].get("cpu_count")} '
        'cores (above the core count the machine was shared and wall times are inflated; CPU '
        'seconds are inflated less).',
        '',
        f'Hardware: {env["backend"].upper()}'
        + (f' ({env["device_kind"]})' if env['device_kind'].lower() != env['backend'] else '')
        + f', {env["cpu_count"]} CPU cores, jax '
        f'{env["jax_version"]}. Timings on a shared machine swing; compare ratios within a table.',
        '',
        *inputs_lines(d),
    ]


def inputs_lines(d: dict) -> list[str]:
    """What the stages read, by digest (results.json 'digests', docs/usage.md): with the same
    digests, config and seed, two runs read the same token streams."""
    found = input_digests(d)
    parts = [
        f'{what} `{key}` ({", ".join(stages)})'
        for what, seen in found.items()
        for key, stages in seen.items()
    ]
    if not parts:
        return ['Inputs: no stage recorded corpus or tokenizer digests.', '']
    return [
        'Inputs (sha256, first 16 hex digits): '
        + '; '.join(parts)
        + '. Runs whose results.json `digests` agree read the same token streams.',
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
    cpu = d['run'].get('stage_cpu_seconds') or secs
    sep = cpu.get('target', 0.0) + cpu.get('draft_distilled', 0.0)
    k = ref_k(d['spec_distilled'])
    label = 'T=1,top_k=0,top_p=1'  # spec_eval's sampling label (human_label: 'T = 1')
    tau = {
        s: run_at(d[s], label, k)['block_efficiency']
        if s in d and has_run(d[s], label, k)
        else None
        for s in PAIRS
    }
    return [
        '## Alpha over training steps',
        '',
        markdown_table(['draft', 'step', 'alpha_T0', 'alpha_T1'], rows),
        '',
        (matched_compute(d, sep, cpu) if 'cotrain' in d else COTRAIN_SKIPPED)
        + f' Measured tau at k = {k}, T = 1 (spec_eval): '
        + ', '.join(f'{PAIRS[s][0]} {fmt(v)}' for s, v in tau.items() if s in d)
        + '.',
        '',
    ]


def matched_compute(d: dict, separate_s: float, secs: dict) -> str:
    """What the co-training comparison holds equal, read from the stages' configs; `secs` the
    stages' CPU seconds, each step counted once."""
    co, di = d['cotrain']['config'], d['draft_distilled']['config']
    total, start = co['train']['steps'], co.get('init', {}).get('target_step', -1)
    draft = di['train']['steps']
    if not co.get('init', {}).get('target_workdir'):
        return (
            f'The co-trained pair trained from scratch for {total} steps (target + draft); the '
            f'distilled draft for {draft} steps after the target. CPU seconds: target + '
            f'distilled draft {fmt(separate_s)} s, co-training {fmt(secs.get("cotrain"))} s.'
        )
    # co-training re-runs the target's steps start..total: count only the target's first
    # `start` steps (its share of the target stage) plus the co-training stage
    together_s = secs.get('target', 0.0) * start / total + secs.get('cotrain', 0.0)
    return (
        f"Matched compute: co-training continues the target's pretraining from its step {start} "
        f'to {total} with a fresh draft, so the co-trained target takes the same {total} steps '
        f'on the same batches as the pretrained one (validation loss '
        f'{fmt(d["cotrain"]["target_val_loss"])} vs {fmt(d["target"]["eval"].get("loss"))}) and '
        f'its draft {total - start} steps, distilled online from the target while it trains; the '
        f'distilled draft takes {draft} steps from the finished target (co-training against '
        f'distillation after pretraining). CPU seconds: target + distilled draft '
        f"{fmt(separate_s)} s; the co-trained pair {fmt(together_s)} s (the target stage's "
        f'first {start} of {total} steps, pro rata, + the co-training stage, which runs the '
        f"target's steps {start}..{total} itself: counted once)."
    )


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
