#!/usr/bin/env bash
# Starts the same command on every worker of a Cloud TPU VM slice (v4/v5e/v5p/v6e pods).
# JAX discovers the slice itself; checkpoints go to a shared bucket workdir so preemption resumes:
# a run that exits 42 (SIGTERM, checkpoint committed) is started again on that worker.
# Usage: launch/tpu_vm.sh TPU_NAME ZONE WORKDIR -- <python -m specjax.main args except --workdir>
# Example: launch/tpu_vm.sh my-v5p-64 us-east5-a gs://my-bucket/specjax/target_base -- \
#            --config=configs/target.py:size=base
set -euo pipefail
tpu="${1:?TPU name}"; zone="${2:?zone}"; workdir="${3:?workdir (gs://...)}"; shift 3
[ "${1:-}" = "--" ] && shift
repo="${SPECJAX_REPO_DIR:-specjax}"
# One-time set-up on every worker: copy the checkout and install it with the TPU build of JAX.
gcloud compute tpus tpu-vm scp --recurse --worker=all --zone="$zone" . "$tpu:$repo"
gcloud compute tpus tpu-vm ssh "$tpu" --worker=all --zone="$zone" --command="
  cd $repo && python3 -m venv .venv && . .venv/bin/activate &&
  pip install -q -U 'jax[tpu]' -e . &&
  nohup bash -c 'while python -m specjax.main --workdir=$workdir $*; [ \$? -eq 42 ]; do
    echo \"[tpu_vm.sh] preempted (exit 42): restarting\"; done' > run.log 2>&1 &"
echo "started on all workers of $tpu; logs in ~/$repo/run.log on each worker"
