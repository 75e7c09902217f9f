"""Whether this host's speed drifts enough to bias configurations run one after the other: the
embedded model's single stream on `copy-edit` (12 requests), or with `--burst` 64 of them at once,
by two identical speculation-off engines and one with n-gram proposals (k = 4), run as whole runs
one after the other (`run_in_process`) and in lockstep, taking turns step by step on clocks that
run only during each engine's turns (`run_lockstep`), alternated `--rounds` times. Printed: each
run's output tok/s and its ratio to the first `off` engine of its sequence. On a steady host the
second `off` engine runs 1.00x either way; where whole runs put it elsewhere, whole-run ratios of
that size are the host's, not the configurations'.

    .venv/bin/python benchmarks/drift_check.py [--rounds 2] [--burst] [--quantization none]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from inflight.bench.corpus import Corpus
from inflight.bench.runs import RunPlan, run_in_process, run_lockstep
from inflight.bench.workload import generate_requests, load_workload
from inflight.model.loaded import LoadedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import cpu_name  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--burst", action="store_true", help="64 requests at once instead of a single stream")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"), quantization=args.quantization)
    spec, path = load_workload("copy-edit", **({"num_requests": 64} if args.burst else {}))
    requests = generate_requests(spec, Corpus(loaded.tokenizer), path.parent)
    concurrency = None if args.burst else 1
    plans = [RunPlan("off", {}), RunPlan("off-again", {}),
             RunPlan("ngram4", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}})]
    options = {"max_batch_size": 64, "quantization": args.quantization}
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, quantization {args.quantization}, "
          f"{len(requests)} requests {'at once' if args.burst else 'one at a time'}")
    for i in range(args.rounds):
        for mode in ("whole runs", "lockstep"):
            if mode == "whole runs":
                runs = run_in_process(None, options, plans, requests, max_concurrency=concurrency, progress=False,
                                      loaded=loaded)
            else:
                runs = run_lockstep(None, options, plans, requests, max_concurrency=concurrency, loaded=loaded)
            first = runs[0].metrics.output_throughput
            print(f"round {i + 1}, {mode:>10}: " + "; ".join(
                f"{r.label} {r.metrics.output_throughput:.1f} tok/s ({r.metrics.output_throughput / first:.2f}x)"
                for r in runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
