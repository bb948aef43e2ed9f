#!/usr/bin/env bash
# resume_after_kill.sh DIR WEIGHTS PATTERN EVERY LAUNCHER -- EXAMPLE ARGS...
#
# A training example killed mid-run resumes from its last job checkpoint and
# ends where the uninterrupted run ends (Note [Resuming the examples] in
# training.h):
#  1. EXAMPLE ARGS --out DIR/whole: the uninterrupted run, in one process,
#     without checkpoints.
#  2. [LAUNCHER] EXAMPLE ARGS --out DIR/killed --checkpoint-every EVERY --resume,
#     killed with SIGKILL once its first checkpoint is complete: the process
#     itself, or with a LAUNCHER (mpipe-launch ... --max-restarts 1 --) its
#     last rank, which the launcher restarts with the others.
#  3. Without a launcher, the same command again (the restart).
# The killed run must say "resumed from step", print the same matches of
# PATTERN (losses, accuracies) as the uninterrupted run from the resumed
# epoch on, and, in one process, save the same WEIGHTS file byte for byte.
# LAUNCHER is one word list ("" for none). Prints "SKIP:" when the data set
# is missing (exit 77 of the example).
set -uo pipefail
dir=$1 weights=$2 pattern=$3 every=$4 launcher=$5
shift 5
[ "$1" = "--" ] && shift
rm -rf "$dir"
mkdir -p "$dir"
fail() {
  echo "FAILED: $*"
  exit 1
}

timeout 300 "$@" --skip-if-no-data --out "$dir/whole" > "$dir/whole.log" 2>&1
rc=$?
[ $rc -eq 77 ] && { echo "SKIP: the data set is not installed"; exit 0; }
[ $rc -eq 0 ] || { cat "$dir/whole.log"; fail "the uninterrupted run exited with $rc"; }

# shellcheck disable=SC2086  # LAUNCHER is a word list
timeout 300 $launcher "$@" --out "$dir/killed" --checkpoint-every "$every" --resume \
  > "$dir/killed.log" 2>&1 &
job=$!
victim=
for _ in $(seq 1 2400); do  # at most 120 s
  if compgen -G "$dir/killed/checkpoints/step-*/complete" > /dev/null; then
    # $job is timeout; its child the example, or the launcher, whose newest
    # child is its last rank.
    victim=$(pgrep -n -P "$job" || true)
    [ -n "$launcher" ] && [ -n "$victim" ] && victim=$(pgrep -n -P "$victim" || true)
    break
  fi
  kill -0 "$job" 2> /dev/null || break
  sleep 0.05
done
[ -n "$victim" ] || { cat "$dir/killed.log"; fail "no checkpoint was completed before the run ended"; }
kill -KILL "$victim" 2> /dev/null || fail "the run ended before it could be killed"
echo "killed pid $victim after $(ls -d "$dir"/killed/checkpoints/step-* | xargs -n1 basename | tr '\n' ' ')"
wait "$job"
rc=$?
if [ -z "$launcher" ]; then
  [ $rc -eq 137 ] || fail "the killed run exited with $rc, not 137 (SIGKILL)"
  timeout 300 "$@" --out "$dir/killed" --checkpoint-every "$every" --resume > "$dir/killed.log" 2>&1
  rc=$?
fi
[ $rc -eq 0 ] || { cat "$dir/killed.log"; fail "the resumed run exited with $rc"; }
resumed=$(grep -a -o "resumed from step [0-9]*" "$dir/killed.log" | tail -n 1)
[ -n "$resumed" ] || { cat "$dir/killed.log"; fail "the restarted run did not resume"; }
echo "$resumed"

# The resumed run prints the results from its epoch on: they must be the
# uninterrupted run's last ones.
mapfile -t want < <(grep -a -o -E "$pattern" "$dir/whole.log")
# (from the resumed start on: a launcher's log also holds the killed attempt's)
mapfile -t got < <(sed -n '/resumed from step/,$p' "$dir/killed.log" | grep -a -o -E "$pattern")
[ ${#want[@]} -gt 0 ] || { cat "$dir/whole.log"; fail "the uninterrupted run printed nothing matching '$pattern'"; }
[ ${#got[@]} -gt 0 ] || { cat "$dir/killed.log"; fail "the resumed run printed nothing matching '$pattern'"; }
tail_of_want=("${want[@]: -${#got[@]}}")
if [ "${tail_of_want[*]}" != "${got[*]}" ]; then
  cat "$dir/killed.log"
  fail "the resumed run ended differently; uninterrupted: ${want[*]}; resumed: ${got[*]}"
fi
echo "the same ${#got[@]} results as the uninterrupted run: ${got[*]}"
if [ -z "$launcher" ]; then
  cmp "$dir/whole/$weights" "$dir/killed/$weights" || fail "the saved weights differ"
  echo "and the same weights, byte for byte ($weights)"
fi
