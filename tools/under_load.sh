#!/usr/bin/env bash
# Run a command beside N busy processes, as on a laptop with a browser open or a CI runner shared
# with other jobs: `bash tools/under_load.sh 2 make book`, or `make book LOAD=2`. Each busy
# process spins one core in pure Python; all are stopped when the command ends.
set -uo pipefail
n=${1:?usage: tools/under_load.sh N COMMAND [ARGS...]}
shift
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
trap 'exit 130' INT TERM
for ((i = 0; i < n; i++)); do
  python3 -c "while True: pass" &
  pids+=($!)
done
"$@"
