#!/usr/bin/env bash
# Start-up to first served token: starts `inflight serve` on the embedded model, waits for
# /health, streams one completion and prints the seconds from launch to its first token.
# Usage: benchmarks/startup.sh [port]   (run scripts/setup.sh first: it builds the CPU kernels)
set -euo pipefail
cd "$(dirname "$0")/.."
port=${1:-8765}
start=$(date +%s%N)
.venv/bin/inflight serve --port "$port" > /dev/null 2>&1 &
pid=$!
until curl -s -o /dev/null "http://127.0.0.1:$port/health"; do sleep 0.1; done
curl -sN "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct.Q4_1","prompt":"Hello","max_tokens":1,"stream":true}' | grep -q '"text"'
end=$(date +%s%N)
echo "start-up to first token: $(( (end - start) / 1000000 )) ms"
kill "$pid"
wait "$pid" 2>/dev/null || true
