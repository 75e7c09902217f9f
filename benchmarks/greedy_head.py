"""The LM head's greedy screen (`GreedyHead`: each greedy token from an integer screen and the fp32
sums of the few columns it cannot rule out, the fp32 head's argmax bit for bit) against the fp32
head and argmax, in the engine: the embedded model's single stream on `copy-edit` (12 requests),
and burst-64 on `copy-edit` and on the corpus `burst`, each by two engines in lockstep
(`run_lockstep`), one on the model with its screen and one on the same weights without it,
`--rounds` times. Every bench request is greedy (their tokens are the same either way:
tests/test_greedy_head.py). Printed: each engine's output tok/s and mean TPOT, and the screen's
ratio to the fp32 head.

    .venv/bin/python benchmarks/greedy_head.py [--rounds 2] [--only NAME] [--quantization none]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import torch

from inflight.bench.corpus import Corpus
from inflight.bench.runs import RunPlan, run_lockstep
from inflight.bench.workload import generate_requests, load_workload
from inflight.model.loaded import LoadedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import cpu_name  # noqa: E402

SCENARIOS = [("single stream, copy-edit", "copy-edit", 12, 1), ("burst-64, copy-edit", "copy-edit", 64, None),
             ("burst-64, burst (corpus text)", "burst", 64, None)]


def without_screen(loaded: LoadedModel) -> LoadedModel:
    """The same weights, a model object whose head has no greedy screen."""
    model = copy.copy(loaded.model)
    model.greedy_head = None
    return dataclasses.replace(loaded, model=model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=None, help="run the scenarios whose name contains this")
    parser.add_argument("--quantization", default="none", help="the loaded model's arithmetic, both engines alike")
    args = parser.parse_args()
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"), quantization=args.quantization)
    if loaded.model.greedy_head is None:
        print("this model's head has no greedy screen (it needs quantized GGUF blocks and the block kernels)")
        return 1
    models = [loaded, without_screen(loaded)]
    plans = [RunPlan("screen", {}), RunPlan("fp32 head", {})]
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, quantization {args.quantization}")
    for name, workload, count, concurrency in SCENARIOS:
        if args.only and args.only not in name:
            continue
        spec, path = load_workload(workload, num_requests=count)
        requests = generate_requests(spec, Corpus(loaded.tokenizer), path.parent)
        for i in range(args.rounds):
            runs = run_lockstep(None, {"max_batch_size": 64, "quantization": args.quantization}, plans, requests,
                                max_concurrency=concurrency, loaded=models)
            screen, fp32 = (r.metrics for r in runs)
            print(f"{name}, round {i + 1}: screen {screen.output_throughput:.1f} tok/s (TPOT mean "
                  f"{screen.tpot_ms.mean:.1f} ms), fp32 head {fp32.output_throughput:.1f} tok/s (TPOT mean "
                  f"{fp32.tpot_ms.mean:.1f} ms): {screen.output_throughput / fp32.output_throughput:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
