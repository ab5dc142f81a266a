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

The spec_eval mode runs end to end the same way (specjax.main on two tiny checkpoint workdirs,
restored sharded over the processes, calibrated and timed): 2 processes x 2 devices measure
what 1 process x 4 devices measures, and only process 0 writes its files.
"""

from __future__ import annotations

import json
import os
import re
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


def _launch_two(tmp_path, args, module='specjax.preflight.selfcheck', timeout=420):
    """`module` on two processes via the launcher, alone on the machine, in its own process
    group (killed whole on a hang, so no worker outlives the test): (returncode, output)."""
    launcher = subprocess.Popen(
        ['bash', str(REPO / 'launch/local_multiprocess.sh'), '2', '2', '--', *args],
        env=_env(
            SPECJAX_PYTHON=sys.executable,
            SPECJAX_MODULE=module,
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
        out, _ = launcher.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return launcher.returncode, out


def _logs(tmp_path) -> str:
    """The tails of the two processes' logs (for a failure's message)."""
    return '\n'.join(
        (tmp_path / 'logs' / f'proc_{i}.log').read_text()[-3000:]
        for i in range(2)
        if (tmp_path / 'logs' / f'proc_{i}.log').exists()
    )


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
    returncode, launcher_out = _launch_two(tmp_path, [f'--workdir={multi}'])
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert returncode == 0, launcher_out[-2000:] + _logs(tmp_path)

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


# spec_eval.json run fields that are timings, or computed from this machine's calibration (c,
# v(k)) or compile: they differ between any two runs. Everything else must be identical.
TIMED_FIELDS = {
    'compile_s',
    'warmup_s',
    'memory',
    'wall_s',
    'wall_s_repeats',
    'time_per_token_s',
    'tokens_per_s',
    'timing',
    'measured_speedup',
    'speedup',
    'speedup_ratio',
    'speedup_ratio_batch',
    'round_cost',
    'predicted_speedup',
    'predicted_speedup_batch',
    'predicted_speedup_from_alpha',
}


def _tiny_pair(root: Path) -> tuple[str, str]:
    """Target and draft checkpoint workdirs of tiny random byte-level models (vocab 259)."""
    from flax import nnx

    from specjax.checkpoint import write_workdir
    from specjax.data import ByteTokenizer
    from specjax.models import Transformer, TransformerConfig

    class Tokenizer(ByteTokenizer):
        def save(self, workdir):  # the byte tokenizer has no files; config.data rebuilds it
            pass

    out = []
    for name, width, seed in (('target', 32, 0), ('draft', 16, 1)):
        cfg = TransformerConfig(
            vocab_size=259, d_model=width, n_layers=1, n_heads=2, n_kv_heads=2,
            d_ff=2 * width, max_len=64,
        )  # fmt: skip
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
        out.append(write_workdir(model, Tokenizer(), str(root / name), source={'test': name}))
    return out[0], out[1]


def _spec_eval_args(target: str, draft: str, data_dir: str) -> list[str]:
    """specjax.main flags: spec_eval of the pair on the toy dataset's prompts, one T = 1 point
    at k = 2, 6 prompts in batches of 4 over a (4, 1, 1) mesh (the last batch padded)."""
    flags = dict(
        target_workdir=target,
        draft_workdir=draft,
        **{'data.name': 'specjax_toy_text', 'data.data_dir': data_dir},
        **{'data.text_feature': 'content', 'data.domain_feature': 'topic'},
        **{'data.tokenizer': 'byte', 'data.vocab_size': 259, 'data.seq_len': 64},
        **{'eval.prompts_per_domain': 2, 'eval.prompt_len_min': 4, 'eval.prompt_len_max': 12},
        **{'eval.max_new_tokens': 8, 'eval.batch_size': 4, 'eval.ks': '(2,)'},
        **{'eval.samplings': '((1.0,0,1.0),)', 'eval.prompt_len_edges': '(8,)'},
        **{'eval.gen_len_edges': '(8,)', 'eval.calibration_iters': 2},
        **{'eval.calibration_repeats': 1, 'eval.timing_repeats': 2},
        **{'mesh.shape': '(-1,1,1)'},
    )  # timing_floor_s stays 0.2: each process finds its own passes, and they must agree
    config = f'--config={REPO / "configs/spec_eval.py"}:checkpoints'
    return [config, *(f'--config.{k}={v}' for k, v in flags.items())]


def _assert_same(got, want, where: str) -> None:
    """Equal, floats within 1e-6 (the same programs on the same 4 devices)."""
    if isinstance(got, dict):
        assert sorted(got) == sorted(want), where
        for k in got:
            _assert_same(got[k], want[k], f'{where}.{k}')
    elif isinstance(got, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f'{where}[{i}]')
    elif isinstance(got, float):
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=where)
    else:
        assert got == want, where


def test_spec_eval_mode_on_two_processes_matches_one(tmp_path, toy_data_dir):
    target, draft = _tiny_pair(tmp_path)
    args = _spec_eval_args(target, draft, toy_data_dir)
    multi, single = tmp_path / 'multi', tmp_path / 'single'
    ref = subprocess.run(
        [sys.executable, '-m', 'specjax.main', *args, f'--workdir={single}'],
        env=_env(JAX_NUM_CPU_DEVICES='4', JAX_COMPILATION_CACHE_DIR=_single_process_cache()),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    returncode, launcher_out = _launch_two(
        tmp_path, [*args, f'--workdir={multi}'], module='specjax.main', timeout=300
    )
    assert returncode == 0, launcher_out[-2000:] + _logs(tmp_path)

    # Written once, by process 0: a second writer would have kept the first file beside it
    # (results.prev.json); process 1 printed no table.
    files = lambda workdir: sorted(p.name for p in workdir.iterdir())
    assert (
        files(multi) == files(single) == ['.lock', 'invocations', 'results.json', 'spec_eval.json']
    )
    assert len(list((multi / 'invocations').iterdir())) == 1
    logs = [(tmp_path / 'logs' / f'proc_{i}.log').read_text() for i in range(2)]
    assert '| sampling |' in logs[0] and '| sampling |' not in logs[1]
    # Each process found its own passes per timed region; they ran the agreed (same) numbers.
    passes = [re.findall(r'timing passes per region: (.*)', log) for log in logs]
    assert len(passes[0]) == 1 and passes[0] == passes[1], passes

    got = json.loads((multi / 'spec_eval.json').read_text())
    want = json.loads((single / 'spec_eval.json').read_text())
    assert len(got['environment']['devices']) == len(want['environment']['devices']) == 4
    for name in ('models', 'tokenizer', 'prompts', 'buckets', 'config_hash'):
        _assert_same(got[name], want[name], name)
    assert [r['method'] for r in got['runs']] == ['autoregressive', 'speculative']
    for i, (a, b) in enumerate(zip(got['runs'], want['runs'], strict=True)):
        assert a.keys() == b.keys()
        untimed = lambda r: {k: v for k, v in r.items() if k not in TIMED_FIELDS}
        _assert_same(untimed(a), untimed(b), f'runs[{i}]')
    spec = got['runs'][1]
    assert spec['generated_tokens'] == sum(spec['per_row']['emitted']) > 0
    assert spec['accepted'] <= spec['examined'] <= spec['drafted']
    # Each process timed its own regions, the same number of passes per region (agreed).
    assert spec['timing']['passes'] >= 1 and spec['timing']['repeats'] == 2

    got, want = (json.loads((d / 'results.json').read_text()) for d in (multi, single))
    point, point_want = got['point'], want['point']
    for name in ('acceptance_rate', 'accepted_fraction', 'block_efficiency', 'alpha'):
        np.testing.assert_allclose(point[name], point_want[name], rtol=1e-6, err_msg=name)
