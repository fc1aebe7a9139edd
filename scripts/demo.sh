#!/usr/bin/env bash
# The nvrx demo: 2 local "nodes" (supervisors) x 2 ranks train a small CPU model
# inside the in-process Wrapper, with a third supervisor as a spare node, while
# faults are injected: an exception and a hang (every rank restarts in-process),
# a SIGKILLed rank (its supervisor starts a replacement that rejoins the running
# job) and a lost node (node 1's supervisor and all its processes killed at once:
# the spare takes over node rank 1). The job resumes from its last checkpoint each
# time and finishes at full size; then the report is printed.
#   scripts/demo.sh [extra train_demo.py options, e.g. --no-wrapper]
# Env: DEMO_DIR (default ./demo_run),
#      DEMO_FAULTS (default "exception:15:2,kill:30:1,hang:45:3,node:52:2").
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
scripts/setup.sh >/dev/null
PY="$repo/.venv/bin/python"
DEMO_DIR="${DEMO_DIR:-$repo/demo_run}"
JOB_ID="demo-$(date +%Y%m%d-%H%M%S)"
export NVRX_DEMO_FAULTS="${DEMO_FAULTS:-exception:15:2,kill:30:1,hang:45:3,node:52:2}"
ports=$("$PY" - <<'PY'
import socket
s1, s2 = socket.socket(), socket.socket()
s1.bind(("127.0.0.1", 0)); s2.bind(("127.0.0.1", 0))
print(s1.getsockname()[1], s2.getsockname()[1])
PY
)
read -r master_port store_port <<<"$ports"
mkdir -p "$DEMO_DIR"
echo "demo: job $JOB_ID, 2 nodes x 2 ranks + 1 spare node, faults: $NVRX_DEMO_FAULTS"
pids=()
for node in 0 1 2; do
    "$repo/.venv/bin/nvrx-supervise" --nnodes 3 --spare-nodes 1 --node-rank "$node" --nproc-per-node 2 \
        --master-port "$master_port" --store-port "$store_port" --job-id "$JOB_ID" \
        --log-dir "$DEMO_DIR" --max-restarts 20 --grace-period 3 --node-timeout 3 \
        -- "$PY" "$repo/examples/train_demo.py" --steps 60 "$@" &
    pids+=("$!")
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' INT TERM
rc=0
for node in 0 1 2; do
    code=0
    { wait "${pids[$node]}"; } 2>/dev/null || code=$?  # (no "Killed" line from bash)
    # the lost node's supervisor was SIGKILLed by the injected node fault: 137 is expected there
    if [ "$code" -eq 137 ] && [[ "$NVRX_DEMO_FAULTS" == *node:* ]]; then
        echo "demo: the supervisor of slot $node was killed with its processes by the injected node fault (expected)"
    elif [ "$code" -ne 0 ]; then
        rc=$code
    fi
done
echo "demo: supervisors ended with exit code $rc; events in $DEMO_DIR/$JOB_ID"
"$repo/.venv/bin/nvrx-report" "$DEMO_DIR/$JOB_ID" || true
exit "$rc"
