"""The quickstart report's data: the JSON its stages wrote, loaded, and the lookups over it.

`load(root)` reads <root>/<stage>/{results,spec_eval,serve}.json, the distill/cotrain metrics.jsonl
(alpha over training steps) and <root>/quickstart.json (seconds per stage) into one dict by stage
name; the rest finds runs, sampling labels and serve rows in it and converts units. The report's
sections (specjax.quickstart.report_*) and its plots (specjax.quickstart.plots) read through this.
"""

from __future__ import annotations

import json
import os

import numpy as np

from specjax.sampling import stats as st

PAIRS = {  # spec_eval stage -> (label, training stage of the draft)
    'spec_ce': ('cross-entropy draft', 'draft_ce'),
    'spec_distilled': ('distilled draft', 'draft_distilled'),
    'spec_cotrain': ('co-trained pair', 'cotrain'),
    'spec_feature': ('feature draft (EAGLE-3)', 'draft_feature'),
    'spec_ngram': ('n-gram draft (training-free)', None),
}
REF_K = 4  # k of the bucket tables (or the largest evaluated k below it)
SERVE_NAMES = {
    'target': 'target alone (autoregressive)',
    'draft_distilled': 'distilled draft alone (replacement)',
    'draft_ce': 'cross-entropy draft alone',
    'spec_ce': 'target + CE draft (speculative)',
    'spec_distilled': 'target + distilled draft (both)',
    'spec_feature': 'target + feature draft (EAGLE-3, speculative)',
    'spec_ngram': 'target + n-gram draft (training-free, speculative)',
}
MIB = 2.0**20


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def load(root: str) -> dict:
    """Every JSON the report reads, by stage name (cotrain / spec_cotrain / teacher_cache /
    draft_feature / spec_feature / spec_ngram only where the preset has them: SmolLM2's has a
    teacher cache, a feature draft and the n-gram draft, and no co-training)."""
    d = {'run': _json(os.path.join(root, 'quickstart.json'))}
    optional = {'cotrain', 'spec_cotrain', 'draft_feature', 'spec_feature', 'spec_ngram'}
    for stage in ('target', 'draft_ce', 'draft_distilled', 'cotrain', 'draft_feature'):
        path = os.path.join(root, stage, 'results.json')
        if stage not in optional or os.path.exists(path):
            d[stage] = _json(path)
    for stage in PAIRS:
        path = os.path.join(root, stage, 'spec_eval.json')
        if stage not in optional or os.path.exists(path):
            d[stage] = _json(path)
    cache = os.path.join(root, 'teacher_cache', 'cache.json')
    if os.path.exists(cache):  # SmolLM2: the imported target's loss is measured on the cache
        tc = d['teacher_cache'] = _json(cache)
        d['target']['eval'] = dict(d['target']['eval'], loss=tc['target_val_loss'])
        if 'target_val_loss_all' in tc:  # every eval target, the baselines' positions
            d['target']['eval']['loss_all'] = tc['target_val_loss_all']
            d['target']['baselines'] = tc.get('baselines', {})
    d['serve'] = _json(os.path.join(root, 'serve', 'serve.json'))
    route = os.path.join(root, 'route', 'route.json')  # the SmolLM2 preset's router and cascade
    if os.path.exists(route):
        d['route'] = _json(route)
    tasks = os.path.join(root, 'tasks', 'tasks.json')  # the SmolLM2 preset's task bucket
    if os.path.exists(tasks):
        d['tasks'] = _json(tasks)
    d['curves'] = {s: alpha_curve(root, s) for s in ('draft_ce', 'draft_distilled', 'cotrain')}
    return d


# Stages whose results the report reads 'digests' from (training stages and the teacher cache).
DIGEST_STAGES = (
    'target',
    'teacher_cache',
    'draft_ce',
    'draft_distilled',
    'cotrain',
    'draft_feature',
)


def input_digests(d: dict) -> dict[str, dict[str, list[str]]]:
    """{'corpus' | 'tokenizer': {'<name or kind> <sha256[:16]>': [stages]}} from the 'digests'
    the stages' results recorded (specjax.data.digests; a stage without them is left out)."""
    out: dict[str, dict[str, list[str]]] = {'corpus': {}, 'tokenizer': {}}
    for stage in DIGEST_STAGES:
        for what, rec in ((d.get(stage) or {}).get('digests') or {}).items():
            if what in out and rec:
                key = f'{rec.get("name") or rec.get("kind")} {str(rec.get("sha256"))[:16]}'
                out[what].setdefault(key, []).append(stage)
    return out


def pairs(d: dict) -> dict:
    """The PAIRS this run has (no spec_cotrain in the SmolLM2 preset, no spec_feature in the
    embedded one)."""
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


def has_run(spec: dict, label: str, k: int) -> bool:
    """Whether spec_eval evaluated k at this sampling label (pairs may have their own ks)."""
    return any(r['k'] == k for r in spec_runs(spec, label))


def run_at(spec: dict, label: str, k: int) -> dict:
    return next(r for r in spec_runs(spec, label) if r['k'] == k)


def flop_ratio(spec: dict) -> float:
    """Draft / target forward FLOPs per token ~ parameter ratio (tied head counted once)."""
    return spec['models']['draft']['num_params'] / spec['models']['target']['num_params']


def cost_ratios(spec: dict) -> dict[str, float]:
    """c, one draft step in target steps, three ways: the parameter ratio (FLOPs, compute-bound),
    the layer ratio (sequential layers, latency-bound at batch 1 on an accelerator) and the value
    measured on this machine (spec_eval's calibration)."""
    models = spec['models']
    return {
        'parameter ratio': flop_ratio(spec),
        'layer ratio': models['draft'].get('n_layers', 0) / models['target']['n_layers'],
        'measured': spec['calibration']['c'],
    }


def accelerator_model(spec: dict, label: str, ks) -> dict:
    """Predicted speedup from the measured alpha under every (c, v) pair: c from cost_ratios,
    v = 1 (verification as cheap as a step) at every k in `ks` or v(k) as measured here at the
    measured k only. A model, not a measurement: {'alpha', 'c', 'scenarios': [{'c_source',
    'v_source', 'c', 'k', 'speedup'}], 'range': (min, max) over the scenarios' best k}."""
    alpha = spec['optimal_k'][label]['alpha'] or 0.0
    measured_v = {int(k): float(v) for k, v in spec['calibration']['v'].items()}
    measured_ks = {r['k'] for r in spec_runs(spec, label)}
    vs = {
        'v = 1': {int(k): 1.0 for k in ks},
        'v measured': {k: v for k, v in measured_v.items() if k in measured_ks},
    }
    scenarios = []
    for c_source, c in cost_ratios(spec).items():
        for v_source, v in vs.items():
            if not v:
                continue
            k = st.optimal_k(alpha, c, v)
            speedup = st.predicted_speedups(alpha, c, v)[k]
            scenarios.append(
                {'c_source': c_source, 'v_source': v_source, 'c': c, 'k': k, 'speedup': speedup}
            )
    speeds = [x['speedup'] for x in scenarios]
    return {
        'alpha': alpha,
        'c': cost_ratios(spec),
        'scenarios': scenarios,
        'range': (min(speeds), max(speeds)),
    }


def position_counts(run: dict) -> list[tuple[int, int]]:
    """(accepted, examined) per draft position, summed over the run's prompts (per_row)."""
    acc = np.asarray(run['per_row']['accepted_per_position'], np.int64).sum(axis=0)
    exa = np.asarray(run['per_row']['examined_per_position'], np.int64).sum(axis=0)
    return [(int(a), int(e)) for a, e in zip(acc, exa)]


def interval(run: dict, name: str):
    """The run's bootstrap interval [lo, hi] of statistic `name` over prompts, or None."""
    return (run.get('intervals') or {}).get(name)


def serve_row(serve: dict, method: str, batch: int) -> dict:
    return next(r for r in serve['rows'] if r['method'] == method and r['batch_size'] == batch)


def to_ms(x):
    return None if x is None else 1e3 * x


def to_mib(x):
    return None if x is None else x / MIB


def peak_bytes(row: dict):
    return row['memory'].get('peak_estimate_bytes')
