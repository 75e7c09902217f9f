"""Whether a ratio measured in lockstep is a lone engine's: the embedded model's single stream on
`copy-edit` (12 requests), speculation off against one speculating configuration (`--spec`,
n-gram at k = 8 by default), each round `--pairs` pairs of whole runs alone, one after the other,
every other pair in reverse order (so that the host's drift over the round favours neither), then
the two in lockstep (`run_lockstep`). Printed: each pair's ratio and each lockstep ratio, and the
mean, median and spread of each over all rounds. Where lockstep's mean sits within the pairs'
spread of their mean, lockstep measures what a lone engine gives, with one run instead of many.

    .venv/bin/python benchmarks/lockstep_check.py [--rounds 3] [--pairs 4] [--spec JSON] [--quantization none]
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=4, help="whole-run pairs a round")
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 8}')
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"), quantization=args.quantization)
    spec, path = load_workload("copy-edit")
    requests = generate_requests(spec, Corpus(loaded.tokenizer), path.parent)
    options = {"max_batch_size": 64, "quantization": args.quantization}
    on = {"speculative_config": json.loads(args.spec)}
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, quantization {args.quantization}, {args.spec} "
          f"against off, single stream of {len(requests)} requests")
    alone: list[float] = []
    lockstep: list[float] = []
    for i in range(args.rounds):
        plans = []
        for p in range(args.pairs):
            pair = [RunPlan(f"off#{p}", {}), RunPlan(f"on#{p}", on)]
            plans += pair if p % 2 == 0 else pair[::-1]
        tok = {run.label: run.metrics.output_throughput
               for run in run_in_process(None, options, plans, requests, max_concurrency=1, progress=False,
                                         loaded=loaded)}
        pairs = [tok[f"on#{p}"] / tok[f"off#{p}"] for p in range(args.pairs)]
        off, spec_run = run_lockstep(None, options, [RunPlan("off", {}), RunPlan("on", on)], requests,
                                     max_concurrency=1, loaded=loaded)
        lockstep.append(spec_run.metrics.output_throughput / off.metrics.output_throughput)
        alone += pairs
        print(f"round {i + 1}: alone, pair by pair " + ", ".join(f"{r:.2f}x" for r in pairs)
              + f" (off {min(tok[f'off#{p}'] for p in range(args.pairs)):.0f}-"
              f"{max(tok[f'off#{p}'] for p in range(args.pairs)):.0f} tok/s); lockstep {lockstep[-1]:.2f}x "
              f"(off {off.metrics.output_throughput:.0f} tok/s)", flush=True)
    for name, ratios in (("alone", alone), ("lockstep", lockstep)):
        print(f"{name:>8}: mean {statistics.mean(ratios):.3f}x, median {statistics.median(ratios):.3f}x, "
              f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
