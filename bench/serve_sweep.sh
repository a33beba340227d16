#!/usr/bin/env bash
# Serving benchmark: tokenmill serve vs the naive transformers server, same workload.
#   bench/serve_sweep.sh [NUM_PROMPTS] [RATES]
# Writes bench/results/serve_{tokenmill,naive}.json and their PNGs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
N=${1:-32}
RATES=${2:-0.5,1,2,4,inf}
OUT=bench/results
wait_up() { for _ in $(seq 240); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 0.5; done; return 1; }

$PY -m tokenmill serve --port 8101 --served-model-name smollm2 >/tmp/tokenmill_serve.log 2>&1 &
PID=$!
wait_up http://127.0.0.1:8101
$PY -m tokenmill bench serve --base-url http://127.0.0.1:8101 --num-prompts "$N" --request-rate "$RATES" \
    --trace --label serve_tokenmill --output-dir $OUT
kill -TERM $PID; wait $PID || true

$PY bench/naive_server.py --port 8102 >/tmp/naive_serve.log 2>&1 &
PID=$!
wait_up http://127.0.0.1:8102
$PY -m tokenmill bench serve --base-url http://127.0.0.1:8102 --num-prompts "$N" --request-rate "${NAIVE_RATES:-0.5,inf}" \
    --label serve_naive --output-dir $OUT
kill -TERM $PID; wait $PID || true
