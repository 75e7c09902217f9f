"""Chooses an engine profile's factors so that its `role: fit` points in
`benchmarks/sim/published/points.yaml` come out as published: coordinate search over the
logarithm of each factor, minimising the mean squared log ratio of predicted to published.
Writes the profile JSON; the built-in profiles in inflight/perf/profiles.py were set from
its output.

    .venv/bin/python benchmarks/sim/fit_engine_profiles.py --engine trtllm --scale 0.1 \
        --output benchmarks/sim/results/engine-trtllm.json

A run predicts the fit points some dozens of times: about 10-20 minutes at --scale 0.1. The
built-in trtllm profile's 8-bit share, roofline exponent and KV bandwidth share came from one
round over every fit point whole (about 50 minutes on one core), from the profile before it:

    .venv/bin/python benchmarks/sim/fit_engine_profiles.py --engine trtllm --scale 1 --rounds 1 \
        --start benchmarks/sim/results/engine-trtllm-start.json \
        --factors eight_bit_flops_efficiency,roofline_exponent,attention_bandwidth_efficiency,request_overhead_s \
        --steps 1.12,1.3,1.06,2 \
        --output benchmarks/sim/results/engine-trtllm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published import HERE, predict  # noqa: E402

from inflight.bench.workload import load_workload  # noqa: E402
from inflight.perf.profiles import BUILTIN_ENGINES, EngineProfile  # noqa: E402
from inflight.sim.workload import synthetic_requests  # noqa: E402

FACTORS = ("flops_efficiency", "eight_bit_flops_efficiency", "bandwidth_efficiency", "attention_bandwidth_efficiency",
           "step_overhead_s", "request_overhead_s", "layer_overhead_s", "roofline_exponent", "allreduce_latency_s",
           "allreduce_bandwidth_efficiency")


# What no engine's kernels reach: a fit that wants more is making up for something else.
CAPS = {"flops_efficiency": 0.8, "eight_bit_flops_efficiency": 0.8, "bandwidth_efficiency": 0.92,
        "attention_bandwidth_efficiency": 0.9, "allreduce_bandwidth_efficiency": 0.9}


def point_scale(point: dict[str, Any], scale: float, budget: float) -> float:
    """`scale` for a point whose requests decode more than `budget` tokens in all (a simulated
    burst of a few thousand long outputs takes minutes), else 1: small bursts run whole, since
    a burst cut short ramps up and drains in a larger share of its time."""
    spec, path = load_workload(str(HERE / f"{point['workload']}.yaml"), num_requests=point["num_requests"])
    total = sum(r.output_len for r in synthetic_requests(spec, path.parent))
    return scale if total > budget else 1.0


def loss(profile: EngineProfile, points: list[dict[str, Any]], defaults: dict[str, Any],
         scales: list[float]) -> float:
    total = 0.0
    for point, scale in zip(points, scales, strict=True):
        value, _ = predict(point, defaults, scale, {profile.name: profile})
        total += math.log(max(value or 1e-9, 1e-9) / point["published"]) ** 2
    return total / len(points)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, choices=sorted(BUILTIN_ENGINES))
    parser.add_argument("--scale", type=float, default=0.1,
                        help="fraction of the requests of the points over --budget output tokens")
    parser.add_argument("--budget", type=float, default=1.5e6, help="output tokens a point may run whole")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--factors", default=",".join(FACTORS))
    parser.add_argument("--steps", default="", metavar="X,...",
                        help="each factor's first step, in --factors order (default 1.4 each; each round takes "
                             "the square root)")
    parser.add_argument("--start", default=None, metavar="FILE", help="start from this engine profile JSON")
    parser.add_argument("--output", "-o", required=True)
    args = parser.parse_args()
    data = yaml.safe_load((HERE / "points.yaml").read_text(encoding="utf-8"))
    points = [p for p in data["points"] if p["engine"] == args.engine and p["role"] == "fit"]
    factors = [f for f in args.factors.split(",") if f]
    tp_points = any(p.get("tp", 1) > 1 for p in points)
    factors = [f for f in factors if tp_points or not f.startswith("allreduce")]
    best = BUILTIN_ENGINES[args.engine]
    if args.start:
        best = EngineProfile.from_dict(json.loads(Path(args.start).read_text(encoding="utf-8")))
    scales = [point_scale(p, args.scale, args.budget) for p in points]
    print("scales: " + ", ".join(f"{p['id']} {s:g}" for p, s in zip(points, scales, strict=True)), flush=True)
    best_loss = loss(best, points, data["defaults"], scales)
    print(f"start: loss {best_loss:.4f}", flush=True)
    given = [float(x) for x in args.steps.split(",") if x]
    if given and len(given) != len(factors):
        parser.error(f"--steps gives {len(given)} steps for {len(factors)} factors")
    steps = dict(zip(factors, given or [1.4] * len(factors), strict=True))
    for round_ in range(args.rounds):
        for name in factors:
            if getattr(best, name) == 0 and not name.endswith("_s"):
                continue  # an 8-bit share of 0 means the 16-bit one: nothing to fit
            step = steps[name]
            for direction in (step, 1 / step):
                value = getattr(best, name) * direction
                if name in CAPS:
                    value = min(value, CAPS[name])
                if name.endswith("_s") and value == 0:
                    value = 1e-6
                if name == "roofline_exponent":
                    value = max(value, 1.0)
                trial = dataclasses.replace(best, **{name: value})
                trial_loss = loss(trial, points, data["defaults"], scales)
                if trial_loss < best_loss:
                    best, best_loss = trial, trial_loss
                    print(f"round {round_}: {name} = {value:.4g}, loss {best_loss:.4f}", flush=True)
                    break
        steps = {name: math.sqrt(step) for name, step in steps.items()}
    Path(args.output).write_text(json.dumps(best.to_dict(), indent=2) + "\n")
    print(json.dumps({f: getattr(best, f) for f in factors}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
