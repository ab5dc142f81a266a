#!/usr/bin/env bash
# Runs N cooperating JAX processes on this machine (CPU, gloo collectives), as a pod would.
# Usage: launch/local_multiprocess.sh NUM_PROCESSES DEVICES_PER_PROCESS -- <python -m specjax.main args>
# Example: launch/local_multiprocess.sh 2 2 -- --config=configs/pretrain.py:size=tiny \
#            --config.mesh.shape='(-1,1,1)' --workdir=/tmp/mp_run
# Environment: SPECJAX_PYTHON (default python), SPECJAX_MODULE (default specjax.main; the tests
# run their own worker), SPECJAX_LOG_DIR (default .: proc_<i>.log per process), SPECJAX_PORT.
set -euo pipefail
num="${1:?number of processes}"; per="${2:?devices per process}"; shift 2
[ "${1:-}" = "--" ] && shift
python="${SPECJAX_PYTHON:-python}"; module="${SPECJAX_MODULE:-specjax.main}"
logs="${SPECJAX_LOG_DIR:-.}"; mkdir -p "$logs"
# Exit status 42 from every process = preempted after the checkpoint: all are started again
# (at most SPECJAX_MAX_RESTARTS times, default 10). The final status is this script's.
restarts="${SPECJAX_MAX_RESTARTS:-10}"
pids=(); stop=0
trap 'stop=1; kill -TERM "${pids[@]}" 2>/dev/null' INT TERM  # an operator's stop: no restart
for ((attempt = 0; ; attempt++)); do
  port="${SPECJAX_PORT:-$((20000 + RANDOM % 20000))}"
  pids=()
  for ((i = 0; i < num; i++)); do
    SPECJAX_COORDINATOR="127.0.0.1:${port}" SPECJAX_NUM_PROCESSES="$num" SPECJAX_PROCESS_ID="$i" \
      SPECJAX_CPU_DEVICES_PER_PROCESS="$per" JAX_PLATFORMS=cpu \
      "$python" -m "$module" "$@" >> "${logs}/proc_${i}.log" 2>&1 &
    pids+=($!)
  done
  status=0; preempted=1
  for pid in "${pids[@]}"; do
    rc=0; wait "$pid" || rc=$?
    [ "$rc" -eq 42 ] || preempted=0
    [ "$rc" -eq 0 ] || status=$rc
  done
  [ "$preempted" -eq 1 ] && [ "$stop" -eq 0 ] && [ "$attempt" -lt "$restarts" ] || break
  echo "[local_multiprocess.sh] preempted (exit 42): restarting ($((attempt + 1))/$restarts)"
done
tail -n 5 "${logs}/proc_0.log"
exit "$status"
