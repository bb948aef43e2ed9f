#!/usr/bin/env bash
# The long form of the cross-process stress test (tests/distributed/stress.cpp):
# 3 ranks, 4 ranks and 4 ranks as 2 replicas, each running MPIPE_STRESS_CALLS
# (default 2000) mixed calls over four pipelines (one in the V) on Gloo over 127.0.0.1, under
# the debug hook that delays and reorders deliveries (MPIPE_DEBUG_CHAOS, seed
# MPIPE_STRESS_SEED, default 1; MPIPE_STRESS_SEED=off runs without it). The
# calls' mix is drawn from MPIPE_STRESS_MIX (default 12345, as ctest's). Every
# result is checked against the plain model on every rank; a stage error is
# injected every ~50 calls. Prints one line per run and exits 1 if any failed.
# Builds mpipe_dist_stress and mpipe-launch into ${MPIPE_BUILD_DIR:-build} if needed.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${MPIPE_BUILD_DIR:-build}
calls=${MPIPE_STRESS_CALLS:-2000}
seed=${MPIPE_STRESS_SEED:-1}
mix=${MPIPE_STRESS_MIX:-12345}
if [ ! -x "$build/tests/mpipe_dist_stress" ] || [ ! -x "$build/mpipe-launch" ]; then
  bash scripts/build.sh > /dev/null || exit 1
fi
status=0
for run in "3 1" "4 1" "4 2"; do
  set -- $run
  ranks=$1 replicas=$2
  log=$(mktemp)
  env_args=()
  [ "$seed" != off ] && env_args=(MPIPE_DEBUG_CHAOS=$((seed * 10 + ranks + replicas)))
  start=$SECONDS
  env "${env_args[@]}" timeout 3000 "$build/mpipe-launch" -n "$ranks" --timeout 2900 -- \
    "$build/tests/mpipe_dist_stress" --calls="$calls" --replicas="$replicas" --timeout=60 \
    --seed="$mix" \
    > "$log" 2>&1
  rc=$?
  took=$((SECONDS - start))
  summary=$(grep -h "stress: [0-9]* passed" "$log" | head -n 1 | sed 's/^\[rank [0-9]*\] //')
  per_call=$(grep -ho "[0-9.]* ms per call" "$log" | head -n 1)
  printf 'stress: %s ranks, %s replica(s), %s calls, mix %s, hook %s: %s (%s; %s s), exit %s\n' \
    "$ranks" "$replicas" "$calls" "$mix" "${env_args[*]:-off}" "${summary:-no summary}" \
    "${per_call:-?}" "$took" "$rc"
  if [ "$rc" -ne 0 ]; then
    status=1
    grep -h "FAILED" "$log" | head -n 5
  fi
  rm -f "$log"
done
exit $status
