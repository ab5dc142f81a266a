"""results.json of the distill and cotrain modes: the last evaluation plus the measured
speculative run (keys: specjax.distill.evaluation), written by process 0 with a headline print."""

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
        keys = [k for k in HEADLINE_METRICS if k in results]
        print('  '.join(f'{k} {results[k]:.4f}' for k in keys), flush=True)
        print(f'results: {path}', flush=True)
    return results
