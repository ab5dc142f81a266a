"""The README's three-step pipeline (pretrain -> distill -> spec_eval) with the real config files
and their default lengths, on the toy dataset with few steps; SIGTERM's exit status; early
errors for a mismatched draft vocabulary."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import jax
import pytest
from data_fixtures import toy_data_config

from specjax import config_files
from specjax.checkpoint import Checkpoints
from specjax.data import ByteTokenizer, default_data_config
from specjax.workdir import PREEMPTED_EXIT_CODE

CONFIGS = pathlib.Path(__file__).parents[1] / 'configs'


def load_config(name: str, arg: str | None):
    return config_files.load_config(config_files.join_spec(CONFIGS / f'{name}.py', arg))


def toy_overrides(data_dir: str) -> dict:
    """config.data fields that point a README config at the toy dataset (byte tokenizer)."""
    toy = toy_data_config(data_dir, seq_len=128, vocab_size=ByteTokenizer.vocab_size)
    default = default_data_config()
    return {f'data.{k}': v for k, v in toy.items() if v != default.get(k)}


def configured(name, arg, data_dir, **fields):
    config = load_config(name, arg)
    config.update_from_flattened_dict({**toy_overrides(data_dir), **fields})
    return config


def test_readme_pipeline_with_sigterm_exit_status(toy_data_dir, tmp_path, monkeypatch):
    from specjax.distill import distill_mode
    from specjax.evaluation import spec_eval

    target_wd, draft_wd = str(tmp_path / 'target_tiny'), str(tmp_path / 'distill_test')
    # 1. pretrain, as the README's command, stopped by SIGTERM: exit 42 after the checkpoint.
    flags = [f'--config.{k}={v}' for k, v in toy_overrides(toy_data_dir).items()]
    proc = subprocess.Popen(
        [sys.executable, '-m', 'specjax.main', f'--config={CONFIGS / "pretrain.py"}:size=tiny']
        + [f'--workdir={target_wd}', '--config.train.steps=100000', *flags],
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(sys.path),
            JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,  # conftest's cache
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0.2',
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if 'first step (compile + run)' in line:
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=120) == PREEMPTED_EXIT_CODE, ''.join(lines[-30:])
    ckpts = Checkpoints(target_wd, read_only=True)
    stopped = ckpts.latest_step()
    ckpts.close()
    assert stopped is not None and stopped >= 1
    # (its checkpoint is the teacher: distill loads the latest step)

    # 2. distill (a mismatched draft vocabulary fails before any data work).
    distill_fields = {
        'distill.teacher_workdir': target_wd,
        'train.steps': 2,
        'train.batch_size': 4,
        'train.eval_batches': 1,
        'distill.calibrate': False,  # timing loops: not what this test is about
        'distill.eval_temperatures': (1.0,),
        'distill.eval_generate_batches': 0,
    }
    bad = configured('distill', 'size=test', toy_data_dir, **distill_fields)
    bad.draft.vocab_size = 300
    with monkeypatch.context() as m:
        m.setattr(distill_mode, 'load_data', lambda config: pytest.fail('data loaded first'))
        with pytest.raises(ValueError, match=r"config\.draft\.vocab_size=300 .* teacher's"):
            distill_mode.run_distill(bad, draft_wd)
    distill = configured('distill', 'size=test', toy_data_dir, **distill_fields)
    assert distill_mode.run_distill(distill, draft_wd)['step'] == 2

    # 3. spec_eval on both checkpoints with the preset's default lengths (cache fits max_len).
    ev = configured(
        'spec_eval',
        'checkpoints',
        toy_data_dir,
        target_workdir=target_wd,
        draft_workdir=draft_wd,
        **{
            'eval.prompts_per_domain': 1,
            'eval.batch_size': 4,
            'eval.ks': (8,),  # the largest default k: what the cache must fit
            'eval.samplings': ((0.0, 0, 1.0),),
            'eval.timing_repeats': 1,
            'eval.calibration_iters': 2,
            'eval.calibration_repeats': 1,
        },
    )
    result = spec_eval.run(ev, str(tmp_path / 'spec_eval'))
    assert [r['k'] for r in result['runs']] == [None, 8]
