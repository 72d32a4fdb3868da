#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine: set up, start `nightshift serve`
# (API + workers + beat; SQLite, local folder, filesystem broker under NIGHTSHIFT_HOME), submit
# examples/batch.jsonl, wait with a progress bar, print the results, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate

export NIGHTSHIFT_HOME=${NIGHTSHIFT_HOME:-$PWD/.nightshift}
export NIGHTSHIFT_PORT=${NIGHTSHIFT_PORT:-8000}
INPUT=${1:-examples/batch.jsonl}
mkdir -p "$NIGHTSHIFT_HOME"

nightshift serve --port "$NIGHTSHIFT_PORT" >"$NIGHTSHIFT_HOME/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT

for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$NIGHTSHIFT_PORT/health" >/dev/null && break
  kill -0 "$server" 2>/dev/null || { cat "$NIGHTSHIFT_HOME/serve.log"; exit 1; }
  sleep 0.5
done

batch_id=$(nightshift submit "$INPUT" --wait)
echo "== batch $batch_id"
nightshift status "$batch_id" | python -c 'import json,sys; b=json.load(sys.stdin); print("status:", b["status"], "| request_counts:", b["request_counts"], "| usage:", b["usage"])'
echo "== results (output file, then error file)"
nightshift results "$batch_id"
