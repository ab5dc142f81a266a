"""The quickstart report's answer, first: speculate, distill, or both, on the measured hardware.

`section_verdict(d)` opens the report (and `verdict_text` is what the command prints when it
finishes): one row per option with its latency against the target alone (serve stage, batch 1,
greedy, median over interleaved repeats and the range of the per-repeat ratios where spec_eval
measured it), output quality against the target, training cost in CPU seconds, and a sentence
on where it pays. Then whether the target beats the count-bigram baseline, and every flag the
spec_eval stages raised (specjax.evaluation.intervals.flags). Numbers only from the stages'
JSON (specjax.quickstart.report_data).
"""

from __future__ import annotations

from specjax.evaluation import intervals
from specjax.evaluation.tables import fmt, markdown_table
from specjax.quickstart.report_data import accelerator_model, cost_ratios, pairs, serve_row
from specjax.quickstart.report_route import route_row
from specjax.quickstart.report_tasks import tasks_sentence

ACCELERATOR_KS = (1, 2, 3, 4, 5, 6, 7, 8)  # k the accelerator model may choose (v = 1)
BIGRAM_MARGIN = 0.3  # nats: the target "beats the bigram" by at least this much


def _best(spec: dict, label: str) -> dict:
    runs = [
        r for r in spec['runs'] if r['method'] == 'speculative' and r['sampling_label'] == label
    ]
    return max(runs, key=lambda r: r['measured_speedup'])


def _speedup_words(r: dict) -> str:
    s = r.get('speedup') or {}
    lo, hi = s.get('range', [None, None])
    value = r['measured_speedup']
    verdict = s.get('verdict', 'indistinguishable')
    ci = s.get('interval')
    ci = f'95 % interval {fmt(ci[0])}-{fmt(ci[1])}; ' if ci else ''
    rng = f' ({ci}range over repeats {fmt(lo)}-{fmt(hi)})' if lo is not None else ''
    if verdict == 'faster':
        return f'{fmt(value)}x the target alone, faster{rng}'
    if verdict == 'slower':
        return f'{fmt(1 / value)}x slower than the target alone{rng}'
    return f'{fmt(value)}x, indistinguishable from the target alone at 95 %{rng}'


def _cpu_s(d: dict, stage: str):
    return d['run'].get('stage_cpu_seconds', {}).get(stage)


def _spec_row(d: dict, stage: str, option: str, train_stage: str, label: str = 'T=0') -> list:
    """The verdict row of a speculative pair: its best measured k at `label` in spec_eval."""
    r = _best(d[stage], label)
    return [
        option,
        f'best k = {r["k"]} (spec_eval, batch {d[stage]["prompts"]["batch_size"]}): '
        f'{_speedup_words(r)}',
        "exactly the target's (greedy: every token equal)",
        _cpu_s(d, train_stage),
        _pays(d, stage, r, label),
    ]


def _bigram_clause(d: dict, bigram) -> str:
    """The bigram's loss, named on its own positions where those differ from the student's.

    A reduced-vocabulary student's loss covers the positions whose next token is in its
    vocabulary (`loss`); the count baselines cover every position (`loss_all`, the target's)."""
    loss_all = d['target']['eval'].get('loss_all')
    if loss_all is None:
        return f" and the bigram's {fmt(bigram)}"
    return (
        f" on the same positions (the student's vocabulary); on every position the target's "
        f"{fmt(loss_all)} and the bigram's {fmt(bigram)}"
    )


def _student_row(d: dict) -> list:
    """The verdict row of the distilled draft served alone (serve stage, batch 1)."""
    student = d['draft_distilled']
    bigram = d['target'].get('baselines', {}).get('bigram')
    speed = (
        serve_row(d['serve'], 'target', 1)['tpot_s']
        / serve_row(d['serve'], 'draft_distilled', 1)['tpot_s']
    )
    alone = serve_row(d['serve'], 'draft_distilled', 1)
    ratios = cost_ratios(d['spec_distilled'])
    c = (ratios['parameter ratio'], ratios['layer ratio'])
    faster = 'faster' if speed > 1 else 'not faster'
    return [
        'distill (the distilled draft served alone)',
        f"{fmt(speed)}x the target's speed per token (batch 1, serve)",
        f"held-out loss {fmt(student.get('draft_val_loss'))} nats vs the target's "
        f'{fmt(d["target"]["eval"]["loss"])}{_bigram_clause(d, bigram)}; free-running '
        f"greedy tokens equal to the target's: {fmt(alone['same_tokens_as_target'])}; "
        f'mean TV {fmt(1 - (student.get("alpha_T1") or float("nan")))}',
        _cpu_s(d, 'draft_distilled'),
        f'{faster} here, not the same output: pays only where its quality loss is acceptable; '
        f"accelerator model: {fmt(1 / max(c))}-{fmt(1 / min(c))}x the target's speed (1 / c, c "
        'from the parameter and layer ratios)',
    ]


def _ngram_label(spec: dict) -> str:
    """The n-gram option's name, with its proposals per match length where it has them."""
    by_n = spec.get('models', {}).get('draft', {}).get('proposals_by_n') or ()
    policy = (
        f', proposing {"/".join(map(str, by_n))} tokens after a '
        f'{"/".join(str(n) for n in range(1, len(by_n) + 1))}-token match'
        if by_n
        else ''
    )
    return f'speculate with no training (n-gram prompt lookup{policy})'


def _ngram_why(r: dict) -> str:
    """What bounds a prompt-lookup draft, from its best run's counts: how often the context
    offered a match to copy (proposals per round) and how much of what it copied the target
    kept; where it is not faster, the reason in words."""
    rounds, drafted, accepted = r.get('rounds'), r.get('drafted'), r.get('accepted')
    if not rounds or drafted is None or accepted is None:
        return ''
    counts = (
        f'; it proposed {drafted} tokens in {rounds} rounds ({fmt(drafted / rounds)} a round, '
        f'{fmt(r["k"])} at most) and the target kept {accepted}'
    )
    if (r.get('speedup') or {}).get('verdict') == 'faster':
        return counts
    few = drafted / rounds < r['k'] / 2
    reason = (
        'the text repeats its context too little for prompt lookup to find runs to copy'
        if few
        else 'the runs it copies diverge from what the target writes'
    )
    return (
        f'{counts}: {reason} (it pays where the output copies its context, e.g. rewriting '
        'code it was shown)'
    )


def verdict_rows(d: dict) -> list[list]:
    """[option, latency vs target, output quality, training CPU s, where it pays]."""
    rows = []
    if 'spec_ce' in d:
        rows.append(_spec_row(d, 'spec_ce', 'speculate (target + cross-entropy draft)', 'draft_ce'))
    rows.append(_student_row(d))
    if 'spec_distilled' in d:
        rows.append(
            _spec_row(d, 'spec_distilled', 'both (target + distilled draft)', 'draft_distilled')
        )
    if 'spec_feature' in d:
        rows.append(
            _spec_row(
                d, 'spec_feature', 'speculate with a feature draft (EAGLE-3)', 'draft_feature'
            )
        )
    if 'spec_ngram' in d:
        row = _spec_row(d, 'spec_ngram', _ngram_label(d['spec_ngram']), '')
        row[3] = 0.0  # nothing trained
        row[4] += _ngram_why(_best(d['spec_ngram'], 'T=0'))
        rows.append(row)
    if d.get('route', {}).get('best_signal'):  # the fourth answer: student, else target tier
        rows.append(route_row(d))
    return rows


def _pays(d: dict, stage: str, r: dict, label: str) -> str:
    verdict = (r.get('speedup') or {}).get('verdict')
    here = {
        'faster': 'pays on this machine',
        'slower': 'does not pay on this machine',
    }.get(verdict, 'indistinguishable from the target alone on this machine (95 %)')
    lo, hi = accelerator_model(d[stage], label, d.get('config_ks', ACCELERATOR_KS))['range']
    return (
        f'{here} (tau {fmt(r["block_efficiency"])} at k = {r["k"]}); accelerator model: '
        f'{fmt(lo)}-{fmt(hi)}x the target alone (c and v ranged, report section "The same alpha '
        'on an accelerator")'
    )


def measured_on(d: dict) -> str:
    """One line: what every figure below rests on (prompts, tokens, seeds, repeats, hardware)."""
    spec, sv = d['spec_distilled'], d['serve']
    p, ev = spec['prompts'], spec['config'].get('eval', {})
    env = sv['environment']
    domains = ', '.join(f'{n} {name}' for name, n in p['per_domain'].items())
    kind = env.get('device_kind', '')
    hardware = env.get('backend', 'cpu').upper() + (f' ({kind})' if kind.lower() != 'cpu' else '')
    return (
        f'Measured on: {p["count"]} held-out prompts ({domains}), {p["max_new_tokens"]} new '
        f'tokens each, batch {p["batch_size"]} (spec_eval); serving {sv["prompts"]["count"]} '
        f'prompts, {sv["max_new_tokens"]} tokens, batch 1 one prompt per call; seed '
        f'{spec["config"].get("seed")}; {ev.get("timing_repeats")} interleaved timing repeats '
        f'(spec_eval), {sv.get("repeats", "-")} (serve); {hardware}, '
        f'{env.get("cpu_count")} CPU cores, jax {env.get("jax_version")}. Intervals: 95% '
        'bootstrap over prompts; speedup ranges: min-max of per-repeat ratios.'
    )


def section_verdict(d: dict) -> list[str]:
    backend = d['serve']['environment'].get('backend', 'cpu')
    out = [
        f'## Verdict (greedy, on this {backend.upper()})',
        '',
        target_line(d) + ' ' + ' '.join(target_vs_bigram(d)),
        '',
        measured_on(d),
        '',
        markdown_table(
            ['option', 'latency against the target', 'output quality', 'training CPU s', 'pays?'],
            verdict_rows(d),
        ),
        '',
    ]
    out += tasks_sentence(d)
    out += flags_section(d)
    return out


def target_line(d: dict) -> str:
    """One line naming the target: what it is, its parameters and dtype (spec_eval's record)."""
    spec = d['spec_distilled']['models']['target']
    source = d['target'].get('source')
    if isinstance(source, dict):  # an imported model: the file it came from
        files = list(source.get('sha256') or {}) or [source.get('name')]
        name = f'{files[0]} (imported from {source.get("kind")} source {source.get("name")!r})'
    else:
        name = 'a Transformer pretrained here on the embedded corpus'
    return (
        f'Target: {name}, {spec["num_params"]:,} parameters, {spec.get("n_layers")} layers, '
        f'{spec.get("dtype", "float32")}.'
    )


def target_vs_bigram(d: dict) -> list[str]:
    loss = d['target']['eval'].get('loss_all', d['target']['eval']['loss'])
    bigram = d['target'].get('baselines', {}).get('bigram')
    if bigram is None:
        return []
    margin = bigram - loss
    if margin >= BIGRAM_MARGIN:
        return [
            f'The target is a language model: held-out loss {fmt(loss)} nats, '
            f'{fmt(margin)} nats below the count-bigram baseline ({fmt(bigram)}).'
        ]
    return [
        f'**The target does not beat the count-bigram baseline**: held-out loss {fmt(loss)} '
        f"nats against the bigram's {fmt(bigram)} (needs {BIGRAM_MARGIN} nats below it). "
        'Acceptance figures below measure drafts against this weak target; read them as a '
        'property of the method on this budget, not of a real language model '
        '(docs/quickstart.md: what it takes).'
    ]


C_SPREAD_FLAG = 1.1  # measured c of equal-sized drafts differing by more than this: flagged


def c_disagreement(d: dict) -> list[str]:
    """A flag when drafts of one size measured c apart by more than C_SPREAD_FLAG (max / min):
    the cost of a draft step depends on its shape, not its weights, so the spread is noise."""
    by_size = {}
    for stage, (name, _) in pairs(d).items():
        size = d[stage]['models']['draft']['num_params']
        by_size.setdefault(size, []).append((name, d[stage]['calibration']['c']))
    out = []
    for size, items in by_size.items():
        cs = [c for _, c in items]
        if len(cs) > 1 and max(cs) / min(cs) > C_SPREAD_FLAG:
            each = ', '.join(f'{name} {fmt(c)}' for name, c in items)
            out.append(
                f'measured c of drafts of the same size ({size} parameters) differs by '
                f'{fmt(max(cs) / min(cs))}x ({each}): the same shape costs the same, so that '
                'spread is timing noise; predictions built on c carry it'
            )
    return out


def flags_section(d: dict) -> list[str]:
    items = [f'- all pairs: {f}' for f in c_disagreement(d)]
    for stage, (name, _) in pairs(d).items():
        spec = d[stage]  # recomputed from the runs: the wording of this report's version
        items += [f'- {name}: {f}' for f in intervals.flags(spec['calibration'], spec['runs'])]
    if not items:
        return []
    return ['### Flags: figures not to take at face value', ''] + items + ['']


def verdict_text(d: dict) -> str:
    """The verdict table as plain text lines, for the console."""
    lines = []
    for option, latency, quality, cpu, pays in verdict_rows(d):
        lines.append(f'- {option}: {latency}; output {quality}; training {fmt(cpu)} CPU s; {pays}')
    return '\n'.join(lines + target_vs_bigram(d))
