#!/usr/bin/env bash
# Re-runs every figure of docs/simulator.md. Results go to $OUT (default benchmarks/sim/results).
#
#   bash benchmarks/sim/run_validation.sh                 # all parts
#   bash benchmarks/sim/run_validation.sh calibrate cpu   # only the named parts
#
# Parts: calibrate (about a minute and a half, copies of the model included), measured (the real
# engine on burst, mixed and long-prefill: about 8 minutes on 2 cores), cpu (simulate those runs
# and compare), gpu (Orca, Sarathi-Serve and TP reproductions in simulation, about 10 minutes),
# speculative (a 2-thread calibration, then copy-edit one stream at a time and as a burst of 64,
# off and n-gram, each re-simulated: about 6 minutes; not among the default parts), int8 (a
# 2-thread calibration of the fp32 engine and of the int8 one into one profile, then the burst
# measured with and without --quantization int8, each re-simulated: about 8 minutes; not among the
# default parts), storage (a 2-thread calibration, then one stream of the embedded model and of
# 1B-shaped Q8_0 and BF16 files, each re-simulated: about 5 minutes; not among the default parts).
# Parts that time the real engine first wait until the 1-minute load average is under $MAX_LOAD
# (default 1.5): the machine is shared.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/sim/results}
INFLIGHT=${INFLIGHT:-.venv/bin/inflight}
MAX_LOAD=${MAX_LOAD:-1.5}
# As benchmarks/run_doc_benchmarks.sh: a fixed pool of 2048 KV blocks, one intra-op thread.
COMMON=(--num-kv-blocks 2048 --torch-threads 1 --no-progress)
PARTS=" ${*:-calibrate measured cpu gpu} "
mkdir -p "$OUT"

want() { [[ "$PARTS" == *" $1 "* ]]; }
wait_quiet() {
    while awk -v max="$MAX_LOAD" '{exit !($1 >= max)}' /proc/loadavg; do
        echo "waiting for a quiet machine (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2; sleep 20
    done
}
say() { echo "== $*" >&2; }

if want calibrate; then
    wait_quiet; say "calibrate"
    "$INFLIGHT" sim calibrate --output "$OUT/cpu-local.json" --samples "$OUT/calibration-steps.json" \
        | tee "$OUT/calibration.txt"
fi

if want measured; then
    for w in burst mixed; do
        wait_quiet; say "measure $w"
        "$INFLIGHT" bench --workload "$w" "${COMMON[@]}" --output "$OUT/measured-$w.json.gz" | tee "$OUT/measured-$w.txt"
    done
    wait_quiet; say "measure long-prefill"
    "$INFLIGHT" bench --workload long-prefill --compare continuous,chunked --max-num-tokens 256 "${COMMON[@]}" \
        --output "$OUT/measured-long-prefill.json.gz" | tee "$OUT/measured-long-prefill.txt"
fi

if want cpu; then
    for w in burst mixed long-prefill; do
        say "simulate $w against the measured run"
        "$INFLIGHT" sim --against "$OUT/measured-$w.json.gz" --hardware "$OUT/cpu-local.json" | tee "$OUT/validate-$w.txt"
    done
fi

if want speculative; then
    # As benchmarks/speculative.py runs: two intra-op threads, so calibrated with two.
    wait_quiet; say "calibrate with 2 threads"
    "$INFLIGHT" sim calibrate --torch-threads 2 --output "$OUT/cpu-2threads.json" | tee "$OUT/calibration-2threads.txt"
    SPEC='{"method": "ngram", "num_speculative_tokens": 4}'
    for shape in single burst; do
        SHAPE=(--max-concurrency 1); [[ $shape == burst ]] && SHAPE=(--num-requests 64)
        for mode in off ngram; do
            EXTRA=(); [[ $mode == ngram ]] && EXTRA=(--speculative-config "$SPEC")
            wait_quiet; say "measure copy-edit $shape $mode"
            "$INFLIGHT" bench --workload copy-edit "${SHAPE[@]}" --num-kv-blocks 2048 --torch-threads 2 --no-progress \
                "${EXTRA[@]}" --output "$OUT/measured-spec-$shape-$mode.json.gz" > /dev/null
            "$INFLIGHT" sim --against "$OUT/measured-spec-$shape-$mode.json.gz" --hardware "$OUT/cpu-2threads.json" \
                | tee "$OUT/validate-spec-$shape-$mode.txt"
        done
    done
fi

if want int8; then
    # One profile for both engines, fitted in one sitting: the fp32 engine (2 threads, as the runs
    # below), then the int8 engine's factors beside it.
    wait_quiet; say "calibrate with 2 threads, then with int8 matmuls"
    "$INFLIGHT" sim calibrate --torch-threads 2 --output "$OUT/cpu-2threads-int8.json" \
        > "$OUT/calibration-2threads-int8.txt"
    "$INFLIGHT" sim calibrate --quantization int8 --torch-threads 2 --base "$OUT/cpu-2threads-int8.json" \
        --output "$OUT/cpu-2threads-int8.json" | tee -a "$OUT/calibration-2threads-int8.txt"
    for q in none int8; do
        wait_quiet; say "measure burst, quantization $q"
        "$INFLIGHT" bench --workload burst --quantization "$q" --num-kv-blocks 2048 --torch-threads 2 --no-progress \
            --output "$OUT/measured-int8-burst-$q.json.gz" > /dev/null
        "$INFLIGHT" sim --against "$OUT/measured-int8-burst-$q.json.gz" --hardware "$OUT/cpu-2threads-int8.json" \
            | tee "$OUT/validate-int8-burst-$q.txt"
    done
fi

if want storage; then
    # Other storage types than the calibrated model's: a 2-thread calibration (the embedded model
    # and its BF16 and wider copies), then one stream of 4 burst requests of the embedded model and
    # of Llama-3.2-1B-shaped Q8_0 and BF16 files (made in $GGUFS if absent: 3.8 GB) and Q4_K and
    # IQ4_XS ones of random codes (2.1 GB more), re-simulated.
    GGUFS=${GGUFS:-/tmp/inflight-ggufs}
    [[ -f "$GGUFS/llama-3.2-1b-shaped-BF16.gguf" ]] || \
        .venv/bin/python benchmarks/gguf_vs_llama_cpp.py --make-models "$GGUFS" --sizes 1b --bf16 >&2
    for q in Q4_K IQ4_XS; do
        [[ -f "$GGUFS/llama-3.2-1b-shaped-$q-random.gguf" ]] || .venv/bin/python -c 'import sys; from pathlib import Path
from inflight.model.gguf_copy import resized_copy
source, kind = Path(sys.argv[1]), sys.argv[2]
resized_copy(source, 1.0, 16, source.parent, kind=kind).rename(source.parent / f"llama-3.2-1b-shaped-{kind}-random.gguf")' \
            "$GGUFS/llama-3.2-1b-shaped-BF16.gguf" "$q"
    done
    wait_quiet; say "calibrate with 2 threads"
    "$INFLIGHT" sim calibrate --torch-threads 2 --output "$OUT/cpu-2threads-storage.json" \
        > "$OUT/calibration-2threads-storage.txt"
    for q in Q4_1 Q8_0 BF16 Q4_K-random IQ4_XS-random; do
        MODEL=(); [[ $q != Q4_1 ]] && MODEL=(--model "$GGUFS/llama-3.2-1b-shaped-$q.gguf")
        wait_quiet; say "measure one stream, $q"
        "$INFLIGHT" bench "${MODEL[@]}" --workload burst --num-requests 4 --max-concurrency 1 --torch-threads 2 \
            --num-kv-blocks 512 --no-progress --output "$OUT/measured-storage-$q.json.gz" > /dev/null
        "$INFLIGHT" sim --against "$OUT/measured-storage-$q.json.gz" "${MODEL[@]}" \
            --hardware "$OUT/cpu-2threads-storage.json" | tee "$OUT/validate-storage-$q.txt"
    done
    # The same runs priced by the profile's own factors alone (every weight as fp32, the pricing
    # before `as_stored`): the profile with its `as_stored` factors left out.
    .venv/bin/python -c 'import json, sys; d = json.load(open(sys.argv[1])); d["engine"]["as_stored"] = {}
json.dump(d, open(sys.argv[2], "w"), indent=1)' "$OUT/cpu-2threads-storage.json" "$OUT/cpu-2threads-storage-own.json"
    for q in Q4_1 Q8_0 BF16 Q4_K-random IQ4_XS-random; do
        MODEL=(); [[ $q != Q4_1 ]] && MODEL=(--model "$GGUFS/llama-3.2-1b-shaped-$q.gguf")
        "$INFLIGHT" sim --against "$OUT/measured-storage-$q.json.gz" "${MODEL[@]}" \
            --hardware "$OUT/cpu-2threads-storage-own.json" | tee "$OUT/validate-storage-$q-own.txt"
    done
fi

if want gpu; then
    # The fitted vllm profile (the default on a GPU); ENGINE_PROFILE=FILE simulates another engine profile.
    GPU=(--model llama-3-8b --hardware h100)
    ENGINE_PROFILE=${ENGINE_PROFILE:-}
    [[ -n "$ENGINE_PROFILE" ]] && GPU+=(--engine-profile "$ENGINE_PROFILE")
    say "Orca: static vs continuous batching"
    "$INFLIGHT" sim --workload benchmarks/sim/orca.yaml "${GPU[@]}" --compare static,continuous,chunked \
        --max-batch-size 64 --plot "$OUT/orca" | tee "$OUT/orca.txt"
    for rate in 2 4 8 16; do
        "$INFLIGHT" sim --workload benchmarks/sim/orca.yaml "${GPU[@]}" --compare static,continuous \
            --max-batch-size 64 --num-requests 1000 --request-rate "$rate"
    done | tee "$OUT/orca-rates.txt"
    say "Sarathi-Serve: chunked vs whole-prompt prefill"
    "$INFLIGHT" sim --workload benchmarks/sim/sarathi.yaml "${GPU[@]}" --compare continuous,chunked \
        --max-num-tokens 512 --max-model-len 8192 --max-batch-size 128 \
        --plot "$OUT/sarathi" | tee "$OUT/sarathi.txt"
    "$INFLIGHT" sim --workload benchmarks/sim/sarathi.yaml "${GPU[@]}" --sweep max_num_tokens=256,512,1024,2048,4096 \
        --max-model-len 8192 --max-batch-size 128 --plot "$OUT/sarathi-sweep" | tee "$OUT/sarathi-sweep.txt"
    "$INFLIGHT" tune --workload benchmarks/sim/sarathi.yaml --sla benchmarks/sim/sarathi-sla.yaml "${GPU[@]}" \
        --max-model-len 8192 --max-num-tokens-grid 256,512,1024,2048,8192 --max-batch-size-grid 128 \
        --all | tee "$OUT/sarathi-tune.txt"
    # Capacity under the SLA: every configuration passes at 2 req/s; how far can each go?
    "$INFLIGHT" tune --workload benchmarks/sim/sarathi.yaml --sla benchmarks/sim/sarathi-sla.yaml "${GPU[@]}" \
        --max-model-len 8192 --max-num-tokens-grid 256,512,1024,2048,8192 --max-batch-size-grid 128 \
        --request-rate 2 --max-rate --top 6 | tee "$OUT/sarathi-capacity.txt"
    say "Tensor parallelism: Llama-3-70B on 2, 4 and 8 H100s"
    for tp in 2 4 8; do
        "$INFLIGHT" sim --workload benchmarks/sim/orca.yaml --model llama-3-70b --hardware h100 --tp "$tp" \
            ${ENGINE_PROFILE:+--engine-profile "$ENGINE_PROFILE"} --num-requests 1000 --max-batch-size 256 \
            --max-num-tokens 2048
    done | tee "$OUT/tp.txt"
fi
