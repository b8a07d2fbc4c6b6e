#!/usr/bin/env bash
# Runs the whole test suite N times in a row (default 10) while two busy
# loops keep both cores of this machine occupied, and prints one line per
# run: exit code, seconds, load average, tests passed and failed. Logs of
# each run are kept in $OUT (default target/suite-under-load). Exits
# non-zero if any run failed.
#
#   bench/suite-under-load.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
n="${1:-10}"
out="${OUT:-target/suite-under-load}"
mkdir -p "$out"
cargo test --workspace --locked --no-run >/dev/null 2>&1 || { echo "build failed" >&2; exit 2; }
busy=()
for _ in 1 2; do ( while :; do :; done ) & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
failed_runs=0
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  cargo test --workspace --locked --no-fail-fast >"$out/run-$i.log" 2>&1
  rc=$?
  passed=$(grep -o '[0-9]* passed' "$out/run-$i.log" | awk '{s+=$1} END {print s+0}')
  failed=$(grep -o '[0-9]* failed' "$out/run-$i.log" | awk '{s+=$1} END {print s+0}')
  echo "run $i/$n: rc=$rc secs=$(( $(date +%s) - start )) load=\"$(cut -d' ' -f1-3 /proc/loadavg)\" passed=$passed failed=$failed"
  [ "$rc" -eq 0 ] || failed_runs=$((failed_runs + 1))
done
echo "failed runs: $failed_runs of $n"
[ "$failed_runs" -eq 0 ]
