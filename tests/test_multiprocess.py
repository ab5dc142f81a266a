"""Two local processes x 2 CPU devices (jax.distributed, gloo) agree with one process x 4 devices.

launch/local_multiprocess.sh starts specjax.preflight.selfcheck on 2 processes after the same
module has run alone on 4 simulated devices (one after the other). Each run
takes sharded LM train steps, a distill step on teacher-generated data from host-local prompts,
a T = 1 speculative sampling call on host-local prompts (draft replicated by draft rules) and
an orbax save + restore; process 0 alone writes results.json and the arrays. The two runs must
agree: losses within float tolerance, generated and sampled tokens exactly. spec_eval's
per-sampling evaluation (host-global prompts, each process feeding its own rows) and
distillation's Evaluator (host-local eval rows) give the same acceptance counts, tau, alpha
and losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        JAX_PLATFORMS='cpu',
        JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or '',
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
        # XLA:CPU without LLVM's optimisation passes: these programs run for milliseconds, and
        # their compiles are most of this test's time (a quarter less, measured on the selfcheck).
        XLA_FLAGS='--xla_backend_optimization_level=0',
    )
    env.update(extra)
    return env


def _single_process_cache() -> str:
    """The one-process reference run's persistent cache ('' when the suite has none)."""
    cache = jax.config.jax_compilation_cache_dir
    return f'{cache}-single-process' if cache else ''


def spec_eval_tokens():
    """The tokens spec_eval's check generates: every prompt row (11) decodes NEW = 6 tokens."""
    from specjax.preflight import selfcheck

    return (selfcheck.B + 3) * selfcheck.NEW


def _launch_two(tmp_path, multi):
    """The two-process selfcheck via the launcher, alone on the machine, in its own process
    group (killed whole on a hang, so no worker outlives the test): (returncode, output)."""
    launcher = subprocess.Popen(
        ['bash', str(REPO / 'launch/local_multiprocess.sh'), '2', '2', '--', f'--workdir={multi}'],
        env=_env(
            SPECJAX_PYTHON=sys.executable,
            SPECJAX_MODULE='specjax.preflight.selfcheck',
            SPECJAX_LOG_DIR=str(tmp_path / 'logs'),
            SPECJAX_MAX_RESTARTS='0',
            # No persistent cache for the two processes: a program the one-process run cached
            # must never be loaded here (same computation, other topology).
            JAX_COMPILATION_CACHE_DIR='',
        ),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = launcher.communicate(timeout=420)
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return launcher.returncode, out


def test_two_processes_agree_with_one_and_write_results_once(tmp_path):
    multi, single = tmp_path / 'multi', tmp_path / 'single'
    # One after the other: run side by side on 2 cores, the gloo collectives of the two
    # processes were seen to stall for minutes.
    ref = subprocess.run(
        [sys.executable, '-m', 'specjax.preflight.selfcheck', f'--workdir={single}'],
        env=_env(JAX_NUM_CPU_DEVICES='4', JAX_COMPILATION_CACHE_DIR=_single_process_cache()),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    returncode, launcher_out = _launch_two(tmp_path, multi)
    assert ref.returncode == 0, ref.stderr[-3000:]
    logs = '\n'.join(
        (tmp_path / 'logs' / f'proc_{i}.log').read_text()[-3000:]
        for i in range(2)
        if (tmp_path / 'logs' / f'proc_{i}.log').exists()
    )
    assert returncode == 0, launcher_out[-2000:] + logs

    got = json.loads((multi / 'results.json').read_text())
    want = json.loads((single / 'results.json').read_text())
    assert (got['process_count'], got['device_count']) == (2, 4)
    assert (want['process_count'], want['device_count']) == (1, 4)
    assert got['written_by'] == 0
    # Written once: a second writer would have moved the first file aside (results.step*.json).
    assert sorted(p.name for p in multi.glob('results*')) == ['results.json']
    assert got['restore_equal'] and got['restored_sharding_equal'] and got['restored_step'] == 3
    np.testing.assert_allclose(got['train_loss'], want['train_loss'], rtol=1e-5)
    assert got['train_loss'][2] < got['train_loss'][0]  # the steps really trained
    np.testing.assert_allclose(got['distill_loss'], want['distill_loss'], rtol=1e-4)
    assert got['spec_lengths'] == want['spec_lengths']
    assert got['spec_accepted'] == want['spec_accepted']

    # spec_eval's evaluation of host-global prompts (each process feeds its rows, a padded last
    # batch) and distillation's Evaluator: counts exactly, ratios within float tolerance.
    spec, spec_want = got['spec_eval'], want['spec_eval']
    assert spec['tokens'] == spec_eval_tokens() == spec['ar_tokens']
    for name in ('drafted', 'examined', 'accepted', 'rounds', 'accepted_per_position', 'buckets'):
        assert spec[name] == spec_want[name], name
    assert spec['accepted'] <= spec['examined'] <= spec['drafted']
    assert spec['block_efficiency'] == spec['tokens'] / spec['rounds']  # tau = emitted / rounds
    for name in ('acceptance_rate', 'alpha', 'ar_alpha', 'predicted_speedup'):
        np.testing.assert_allclose(spec[name], spec_want[name], rtol=1e-5, err_msg=name)
    dist, dist_want = got['distill_eval'], want['distill_eval']
    assert sorted(dist) == sorted(dist_want)
    assert {'alpha_T1/a', 'alpha_target_generated_T1/b', 'tau_k3_T1', 'draft_loss'} <= set(dist)
    for name in dist:  # predicted_speedup is NaN in both (no calibration)
        np.testing.assert_allclose(dist[name], dist_want[name], rtol=1e-4, err_msg=name)

    a, b = np.load(multi / 'arrays.npz'), np.load(single / 'arrays.npz')
    assert sorted(a.files) == sorted(b.files)
    np.testing.assert_array_equal(a['generated'], b['generated'])  # teacher data, T = 1
    np.testing.assert_array_equal(a['sampled'], b['sampled'])  # speculative, T = 1, same key
    for name in a.files:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-6, err_msg=name)
