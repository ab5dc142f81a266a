#!/usr/bin/env bash
# Starts the same command on every worker of a Cloud TPU VM slice (v4/v5e/v5p/v6e pods).
# JAX discovers the slice itself; checkpoints go to a shared bucket workdir so preemption resumes:
# a run that exits 42 (SIGTERM, checkpoint committed) is started again on that worker.
# Usage: launch/tpu_vm.sh TPU_NAME ZONE WORKDIR -- <python -m specjax.main args except --workdir>
# Example: launch/tpu_vm.sh my-v5p-64 us-east5-a gs://my-bucket/specjax/target_base -- \
#            --config=configs/pretrain.py:size=base --config.mesh.shape='(1,-1,1)'
# Each argument reaches specjax.main exactly as given here (tuples, spaces and quotes included):
# they are written, shell-quoted, into a run script that is copied to the workers, never
# re-split by a remote shell. Only the checkout's tracked and new files are copied (no .venv,
# no local workdirs or other ignored outputs). SPECJAX_REPO_DIR: the folder on each worker.
set -euo pipefail
tpu="${1:?TPU name}"; zone="${2:?zone}"; workdir="${3:?workdir (gs://...)}"; shift 3
[ "${1:-}" = "--" ] && shift
repo="${SPECJAX_REPO_DIR:-specjax}"
stage="$(mktemp -d)"; trap 'rm -rf "$stage"' EXIT

git ls-files -z --cached --others --exclude-standard | tar --null -T - -czf "$stage/specjax.tgz"
{
  echo '#!/usr/bin/env bash'
  echo '# Written by launch/tpu_vm.sh: reruns specjax.main while it exits 42 (preempted).'
  echo 'cd "$(dirname "$0")" && . .venv/bin/activate || exit 1'
  printf 'while python -m specjax.main --workdir=%q' "$workdir"
  (($#)) && printf ' %q' "$@"
  echo '; [ $? -eq 42 ]; do'
  echo '  echo "[tpu_vm.sh] preempted (exit 42): restarting"'
  echo 'done'
} > "$stage/run_specjax.sh"

q_repo="$(printf '%q' "$repo")"
gcloud compute tpus tpu-vm ssh "$tpu" --worker=all --zone="$zone" --command="mkdir -p $q_repo"
gcloud compute tpus tpu-vm scp --worker=all --zone="$zone" \
  "$stage/specjax.tgz" "$stage/run_specjax.sh" "$tpu:$repo/"
# One-time set-up on every worker (the TPU build of JAX), then the run loop in the background.
gcloud compute tpus tpu-vm ssh "$tpu" --worker=all --zone="$zone" --command="
  cd $q_repo && tar xzf specjax.tgz && python3 -m venv .venv && . .venv/bin/activate &&
  pip install -q -U 'jax[tpu]' gcsfs -e . && (nohup bash run_specjax.sh > run.log 2>&1 &)"
echo "started on all workers of $tpu; logs in ~/$repo/run.log on each worker"
