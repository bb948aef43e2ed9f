#!/usr/bin/env bash
# Starts PROGRAM as 2 ranks with torchrun's variables set by hand (RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on 127.0.0.1), as torchrun
# --no-python would, each bounded by a timeout; prefixes each rank's lines.
# Usage: ranks_by_env.sh PROGRAM [ARGS...]
set -uo pipefail
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 OMP_NUM_THREADS=1
pids=()
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r timeout 250 "$@" 2>&1 | sed -u "s/^/[rank $r] /" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
