"""launch/tpu_vm.sh against a fake gcloud: arguments arrive intact, only the checkout is copied."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Records each call (args as JSON, one line); `scp` copies its local files into $FAKE_WORKER.
FAKE_GCLOUD = r"""#!/usr/bin/env python3
import json, os, shutil, sys
with open(os.environ['FAKE_LOG'], 'a') as f:
    f.write(json.dumps(sys.argv[1:]) + '\n')
if sys.argv[1:5] == ['compute', 'tpus', 'tpu-vm', 'scp']:
    files = [a for a in sys.argv[5:] if not a.startswith('--')][:-1]
    for name in files:
        shutil.copy(name, os.environ['FAKE_WORKER'])
"""

# Stands in for the worker's python: records its argv and exits as FAKE_EXIT says (42 once).
FAKE_PYTHON = r"""#!/usr/bin/env python3
import json, os, sys
log = os.environ['FAKE_ARGV']
runs = open(log).read().count('\n') if os.path.exists(log) else 0
with open(log, 'a') as f:
    f.write(json.dumps(sys.argv[1:]) + '\n')
sys.exit(42 if runs == 0 else 0)
"""


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.mark.skipif(shutil.which('git') is None, reason='needs git')
def test_tpu_vm_script_passes_arguments_intact_and_copies_only_the_checkout(tmp_path):
    checkout, worker, bin_dir = tmp_path / 'checkout', tmp_path / 'worker', tmp_path / 'bin'
    for d in (checkout, worker, bin_dir, worker / '.venv' / 'bin'):
        d.mkdir(parents=True)
    (checkout / '.gitignore').write_text('.venv/\n/workdirs/\n')
    (checkout / 'tracked.py').write_text('x = 1\n')
    (checkout / '.venv').mkdir()
    (checkout / '.venv' / 'big.bin').write_text('venv')
    (checkout / 'workdirs').mkdir()
    (checkout / 'workdirs' / 'ckpt').write_text('local run')
    git = dict(cwd=checkout, check=True, capture_output=True)
    subprocess.run(['git', 'init', '-q'], **git)
    subprocess.run(['git', 'add', 'tracked.py', '.gitignore'], **git)
    (checkout / 'new_file.py').write_text('y = 2\n')  # untracked, not ignored: copied too
    _script(bin_dir / 'gcloud', FAKE_GCLOUD)
    _script(bin_dir / 'python', FAKE_PYTHON)
    (worker / '.venv' / 'bin' / 'activate').write_text('')
    env = dict(
        os.environ,
        PATH=f'{bin_dir}:{os.environ["PATH"]}',
        FAKE_LOG=str(tmp_path / 'gcloud.log'),
        FAKE_WORKER=str(worker),
        FAKE_ARGV=str(tmp_path / 'argv.log'),
    )
    args = [
        '--config=configs/distill.py:size=tiny',
        '--config.mesh.shape=(1,-1,1)',
        "--config.distill.teacher_workdir=gs://b/it's here",
        '--config.name=two words',
    ]
    cmd = [str(REPO / 'launch/tpu_vm.sh'), 'my-tpu', 'us-east5-a', 'gs://b/run 1', '--', *args]
    subprocess.run(['bash', *cmd], cwd=checkout, env=env, check=True, capture_output=True)

    calls = [json.loads(line) for line in (tmp_path / 'gcloud.log').read_text().splitlines()]
    assert [c[3] for c in calls] == ['ssh', 'scp', 'ssh']
    assert all('--worker=all' in c and '--zone=us-east5-a' in c for c in calls)
    with tarfile.open(worker / 'specjax.tgz') as tar:
        assert sorted(tar.getnames()) == ['.gitignore', 'new_file.py', 'tracked.py']
    assert 'pip install' in calls[2][-1] and 'run_specjax.sh' in calls[2][-1]

    # The worker's run script: python gets every argument unchanged; exit 42 reruns it.
    subprocess.run(['bash', str(worker / 'run_specjax.sh')], env=env, check=True)
    runs = [json.loads(line) for line in (tmp_path / 'argv.log').read_text().splitlines()]
    assert runs == [['-m', 'specjax.main', '--workdir=gs://b/run 1', *args]] * 2


# Slurm stand-ins: scontrol expands the node list / records a requeue; srun runs its command once
# per task (SLURM_PROCID 0..SLURM_NTASKS-1) and exits with the highest status, as srun does.
FAKE_SCONTROL = r"""#!/usr/bin/env python3
import os, sys
if sys.argv[1:3] == ['show', 'hostnames']:
    print('\n'.join('gpu' + n for n in sys.argv[3][4:-1].split(',')))  # gpu[07,08] only
else:
    with open(os.environ['FAKE_LOG'], 'a') as f:
        f.write(' '.join(sys.argv[1:]) + '\n')
"""
FAKE_SRUN = r"""#!/usr/bin/env python3
import os, subprocess, sys
cmd = sys.argv[1:]
while cmd[0].startswith('--'):  # srun options (SPECJAX_SRUN_ARGS)
    cmd = cmd[1:]
codes = [
    subprocess.run(cmd, env=dict(os.environ, SLURM_PROCID=str(i))).returncode
    for i in range(int(os.environ['SLURM_NTASKS']))
]
sys.exit(max(codes))
"""
# The task's python: records argv and the jax.distributed variables, exits FAKE_EXIT.
FAKE_TASK_PYTHON = r"""#!/usr/bin/env python3
import json, os, sys
names = ('SPECJAX_COORDINATOR', 'SPECJAX_NUM_PROCESSES', 'SPECJAX_PROCESS_ID')
env = {k: os.environ[k] for k in names if k in os.environ}
with open(os.environ['FAKE_ARGV'], 'a') as f:
    f.write(json.dumps([sys.argv[1:], env]) + '\n')
sys.exit(int(os.environ['FAKE_EXIT']))
"""


@pytest.mark.parametrize('exit_code', [0, 42])
def test_slurm_script_starts_one_process_per_task_with_arguments_intact(tmp_path, exit_code):
    """launch/slurm_gpu.sbatch on fake srun/scontrol: every task runs specjax.main with the
    arguments as given and jax.distributed's variables (coordinator on the first node, its own
    process id); a preempted run (exit 42) is requeued, a finished one is not."""
    script = REPO / 'launch/slurm_gpu.sbatch'
    lines = script.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith('#'))
    directives = [i for i, line in enumerate(lines) if line.startswith('#SBATCH')]
    assert directives and max(directives) < first_command  # sbatch stops reading at a command
    assert '#SBATCH --requeue' in lines and '#SBATCH --ntasks-per-node=1' in lines

    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    _script(bin_dir / 'scontrol', FAKE_SCONTROL)
    _script(bin_dir / 'srun', FAKE_SRUN)
    _script(bin_dir / 'python', FAKE_TASK_PYTHON)
    env = dict(
        os.environ,
        PATH=f'{bin_dir}:{os.environ["PATH"]}',
        SLURM_JOB_ID='4242',
        SLURM_JOB_NODELIST='gpu[07,08,09]',
        SLURM_NTASKS='3',
        SLURM_SUBMIT_DIR=str(tmp_path),
        SPECJAX_PYTHON=str(bin_dir / 'python'),
        SPECJAX_SRUN_ARGS='--cpu-bind=none --mpi=none',
        FAKE_LOG=str(tmp_path / 'scontrol.log'),
        FAKE_ARGV=str(tmp_path / 'argv.log'),
        FAKE_EXIT=str(exit_code),
    )
    args = [
        '--config=configs/distill.py:size=tiny',
        '--config.mesh.shape=(-1,1,1)',
        "--config.distill.teacher_workdir=/shared/it's here",
        '--config.name=two words',
    ]
    done = subprocess.run(
        ['bash', str(script), '/shared/run 1', '--', *args], env=env, capture_output=True
    )
    assert done.returncode == exit_code, done.stderr
    tasks = [json.loads(line) for line in (tmp_path / 'argv.log').read_text().splitlines()]
    assert [argv for argv, _ in tasks] == [
        ['-m', 'specjax.main', '--workdir=/shared/run 1', *args]
    ] * 3
    want = dict(SPECJAX_COORDINATOR='gpu07:24242', SPECJAX_NUM_PROCESSES='3')
    assert [env for _, env in tasks] == [dict(want, SPECJAX_PROCESS_ID=str(i)) for i in range(3)]
    requeued = (tmp_path / 'scontrol.log').read_text() if exit_code else ''
    assert requeued == ('requeue 4242\n' if exit_code == 42 else '')
    assert not (tmp_path / 'scontrol.log').exists() or exit_code == 42
