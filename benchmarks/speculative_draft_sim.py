"""What a draft model would give, in the simulator: one stream's decode speed-up against the
chance that each proposed token is kept, for a draft whose passes cost what its shapes cost.

For each (target, draft, hardware): the `mixed` workload's lengths, one request at a time; off, a
free proposer (n-gram's cost: none) and the draft model, fixed k (every proposal verified) and
adaptive (lengths chosen each step with the draft's passes priced). Printed: mean TPOT against
off per acceptance rate, and the rate at which the draft starts to pay. Runs in virtual time.

    .venv/bin/python benchmarks/speculative_draft_sim.py [--k 4] [--num-requests 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from inflight.bench.workload import load_workload
from inflight.perf.profiles import load_hardware
from inflight.sim.runs import SimTarget, simulate
from inflight.sim.workload import synthetic_requests

PAIRS = [("llama-3.1-8b", "llama-3.2-1b", "h100"), ("llama-3.1-8b", "llama-3.2-1b", "cpu-local")]
RATES = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/speculative-draft-sim.json")
    args = parser.parse_args()
    spec, path = load_workload("mixed", num_requests=args.num_requests)
    requests = synthetic_requests(spec, path.parent)
    document: dict[str, Any] = {"command": " ".join(sys.argv), "k": args.k, "num_requests": args.num_requests,
                                "results": []}
    for model, draft, hardware in PAIRS:
        target = SimTarget.of(model, load_hardware(hardware))
        off = simulate(target, {}, requests, "off", max_concurrency=1).metrics.tpot_ms.mean
        configs = {
            "free proposals, adaptive": {"method": "ngram", "num_speculative_tokens": args.k},
            "draft, fixed": {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k,
                             "adaptive": False},
            "draft, adaptive": {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k},
        }
        print(f"\n{target.describe()}, draft {draft}, k = {args.k}: off TPOT {off:.2f} ms; TPOT speed-up "
              f"against off by the chance each proposed token is kept")
        print(f"{'kept':>6}  " + "  ".join(f"{c:>26}" for c in configs))
        for rate in RATES:
            speedups = {label: off / simulate(target, {"speculative_config": config, "acceptance_rate": rate},
                                              requests, label, max_concurrency=1).metrics.tpot_ms.mean
                        for label, config in configs.items()}
            print(f"{rate:>6.1f}  " + "  ".join(f"{s:>25.2f}x" for s in speedups.values()))
            document["results"].append({"model": model, "draft": draft, "hardware": hardware, "acceptance_rate": rate,
                                        "off_tpot_ms": off, "speedups": speedups})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
