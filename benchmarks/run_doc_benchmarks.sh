#!/usr/bin/env bash
# Re-runs every figure of docs/benchmarks.md: one `inflight bench` invocation per comparison, so
# each ratio comes from runs made back to back on the same requests. Takes about 30 minutes on
# 2 CPU cores. Results (table, gzipped JSON, PNGs) go to $OUT (default benchmarks/results).
#
#   bash benchmarks/run_doc_benchmarks.sh            # all of them
#   bash benchmarks/run_doc_benchmarks.sh burst      # only the named ones
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
INFLIGHT=${INFLIGHT:-.venv/bin/inflight}
# A fixed KV pool (2048 blocks of 16 tokens) so KV percentages mean the same on any machine;
# two intra-op threads on an otherwise idle machine (TORCH_THREADS=1 on a shared one, where two
# spinning OpenMP threads and a neighbour stall steps for seconds: see the doc).
COMMON=(--num-kv-blocks 2048 --torch-threads "${TORCH_THREADS:-2}" --no-progress)
mkdir -p "$OUT"

run() {
    local name=$1; shift
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi
    echo "== $name: inflight bench $*" >&2
    "$INFLIGHT" bench "$@" "${COMMON[@]}" --output "$OUT/$name.json.gz" --plot "$OUT/$name" | tee "$OUT/$name.txt"
}

ONLY="$*"
run burst --workload burst --compare static,continuous,chunked
run mixed --workload mixed --compare static,continuous,chunked
run long-prefill --workload long-prefill --compare continuous,chunked --max-num-tokens 256
run shared-prefix --workload shared-prefix --compare no-prefix-caching,prefix-caching
# The same at a quarter of the rate, which the engine keeps up with even without the cache.
run shared-prefix-light --workload shared-prefix --request-rate 0.25 --num-requests 24 \
    --compare no-prefix-caching,prefix-caching
run budget-sweep --workload long-prefill --sweep max_num_tokens=64,128,256,512
# A second invocation of `mixed`: how far figures move between two runs on a shared machine.
run mixed-repeat --workload mixed --compare static,continuous,chunked
if [[ -f "$OUT/mixed.json.gz" ]]; then
    "$INFLIGHT" check --sla inflight/bench/specs/sla.yaml "$OUT/mixed.json.gz" | tee "$OUT/mixed-check.txt" || true
fi
