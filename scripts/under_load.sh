#!/usr/bin/env bash
# Run a command N times in a row while a spinning process keeps one core busy (the slow, loaded machine
# the fault tests must survive), printing each run's exit status and wall time. Stops at the first failure.
#
#   scripts/under_load.sh 3 .venv/bin/python -m pytest -q tests/pipeline/test_multinode.py tests/pipeline/test_faults.py
set -uo pipefail
runs=$1; shift
python3 -c "while True: pass" &
hog=$!
trap 'kill $hog 2>/dev/null' EXIT
echo "[under_load] one core kept busy by pid $hog on $(nproc) cores; $runs run(s) of: $*"
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  "$@"
  rc=$?
  echo "[under_load] run $i/$runs: exit $rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || exit $rc
done
