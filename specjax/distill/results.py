"""results.json of the distill, cotrain and feature_draft modes, written by process 0 with a
headline print (`headline_keys`).

distill / cotrain: the last evaluation plus the measured speculative run (keys:
specjax.distill.evaluation); headline HEADLINE_METRICS.
feature_draft (specjax.distill.feature_mode): the last evaluation only: val_loss, and per
unrolled step j val_kd_step{j} and alpha_step{j} (held-out mean sum min(p, q) at temperature 1;
for a reduced vocabulary against the target renormalised on the draft's ids). The mode runs no
speculative decoding, so it reports no measured acceptance or tau (spec_eval on its workdir
measures them). Headline FEATURE_DRAFT_HEADLINE_METRICS, plus alpha_step{j} of every further
step of a longer unroll.
"""

from __future__ import annotations

import jax

from specjax import workdir as workdir_lib
from specjax.distill.evaluation import Evaluator
from specjax.train.loop import LoopResult

# results.json keys printed at the end of a run and reported by sweeps (configs/ablations/).
HEADLINE_METRICS = (
    'alpha_T0',
    'alpha_T1',
    'acceptance_k4_T0',
    'tau_k4_T0',
    'acceptance_k4_T1',
    'tau_k4_T1',
    'predicted_speedup_k4_T1',
    'draft_val_loss',
)
# feature_draft's (the default config.feature.ttt_steps = 3 unrolled steps)
FEATURE_DRAFT_HEADLINE_METRICS = ('val_loss', 'alpha_step0', 'alpha_step1', 'alpha_step2')
HEADLINE_METRICS_BY_MODE = {
    'distill': HEADLINE_METRICS,
    'cotrain': HEADLINE_METRICS,
    'feature_draft': FEATURE_DRAFT_HEADLINE_METRICS,
}


def headline_keys(results: dict) -> list[str]:
    """The headline keys `results` holds, in order: its mode's tuple (HEADLINE_METRICS for a
    mode not listed), then for feature_draft alpha_step{j} of the steps past the tuple's."""
    mode = results.get('mode')
    keys = [k for k in HEADLINE_METRICS_BY_MODE.get(mode, HEADLINE_METRICS) if k in results]
    if mode == 'feature_draft':
        j = len([k for k in FEATURE_DRAFT_HEADLINE_METRICS if k.startswith('alpha_step')])
        while f'alpha_step{j}' in results:
            keys.append(f'alpha_step{j}')
            j += 1
    return keys


def collect_results(
    config, result: LoopResult, evaluator: Evaluator, draft_params, target_params, extra: dict
) -> dict:
    """results.json: the last eval (renamed *_loss -> *_val_loss) + the measured speculative run."""
    out = {
        'mode': config.mode,
        'step': result.step,
        'preempted': result.preempted,
        'checkpoint_dir': result.checkpoint_dir,
        'checkpoint_step': result.checkpoint_step,
    }
    out.update(extra)
    for key, value in result.eval.items():
        key = key.replace('draft_loss', 'draft_val_loss').replace('target_loss', 'target_val_loss')
        out[key] = value
    if not result.preempted:
        out.update(evaluator.speculative(draft_params, target_params))
    return out


def finish_results(workdir, results, config) -> dict:
    """Writes results.json (process 0; not when preempted) and prints the headline metrics."""
    if results['preempted']:
        return results
    if jax.process_index() == 0:
        path = workdir_lib.write_results(workdir, config.mode, results, config)
        print('  '.join(f'{k} {results[k]:.4f}' for k in headline_keys(results)), flush=True)
        print(f'results: {path}', flush=True)
    return results
