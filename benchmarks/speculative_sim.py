"""SmartSpec's question in the simulator: at what load does fixed-length speculative decoding
start to hurt, and does a length chosen each step avoid it?

Llama-3-8B on one H100 (the built-in profiles), the `mixed` workload's lengths at a sweep of
Poisson rates from near idle to past saturation; speculation off, fixed k (every proposal
verified: `"adaptive": false`) and adaptive k, each proposed token kept with `--acceptance-rate`.
Printed per rate: each configuration's mean TPOT, TTFT p99 and output tok/s, and its TPOT against
off (below 1.00x: speculation hurts). Runs in virtual time (seconds of CPU per run).

    .venv/bin/python benchmarks/speculative_sim.py [--acceptance-rate 0.7] [--k 4] [--model llama-3-8b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from inflight.bench.workload import load_workload, with_request_rate
from inflight.perf.profiles import load_hardware
from inflight.sim.runs import SimTarget, simulate
from inflight.sim.workload import synthetic_requests

RATES = (1.0, 4.0, 16.0, 32.0, 64.0, 128.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--acceptance-rate", type=float, default=0.7)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--rates", default=",".join(str(r) for r in RATES))
    parser.add_argument("--out", default="benchmarks/results/speculative-sim.json")
    args = parser.parse_args()
    target = SimTarget.of(args.model, load_hardware(args.hardware))
    configs: dict[str, dict[str, Any]] = {
        "off": {},
        f"fixed k={args.k}": {"speculative_config": {"method": "ngram", "num_speculative_tokens": args.k,
                                                     "adaptive": False}, "acceptance_rate": args.acceptance_rate},
        f"adaptive k<={args.k}": {"speculative_config": {"method": "ngram", "num_speculative_tokens": args.k},
                                  "acceptance_rate": args.acceptance_rate},
    }
    print(f"{target.describe()}; mixed workload lengths, {args.num_requests} requests; each proposed token kept "
          f"with chance {args.acceptance_rate}")
    header = f"{'rate':>6}  " + "  ".join(f"{c:>34}" for c in configs)
    print(header + "\n" + f"{'req/s':>6}  " + "  ".join(f"{'TPOT ms (x off)  TTFT p99  tok/s':>34}" for _ in configs))
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        spec, path = load_workload("mixed", num_requests=args.num_requests)
        requests = synthetic_requests(with_request_rate(spec, rate), path.parent)
        found = {label: simulate(target, {"max_batch_size": 256, **options}, requests, label).metrics
                 for label, options in configs.items()}
        off = found["off"].tpot_ms.mean
        cells = []
        for m in found.values():
            speedup = off / m.tpot_ms.mean if m.tpot_ms.mean else float("nan")
            cells.append(f"{m.tpot_ms.mean:6.2f} ({speedup:4.2f}x) {m.ttft_ms.p99:8.0f} {m.output_throughput:6.0f}")
        print(f"{rate:6.1f}  " + "  ".join(f"{c:>34}" for c in cells))
        rows.append({"rate": rate, **{label: {"tpot_mean_ms": m.tpot_ms.mean, "ttft_p99_ms": m.ttft_ms.p99,
                                              "output_tok_s": m.output_throughput,
                                              "tokens_per_draft_step": m.spec_tokens_per_draft}
                                      for label, m in found.items()}})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"target": target.describe(), "acceptance_rate": args.acceptance_rate,
                                          "k": args.k, "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
