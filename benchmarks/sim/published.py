"""The simulator against published figures of other engines: every point of
`benchmarks/sim/published/points.yaml` predicted with its engine profile, on its hardware and
setup, beside the figure its source prints, with the ratio and the `inflight sim` command that
reproduces the prediction.

    .venv/bin/python benchmarks/sim/published.py                    # every point (~28 min on 2 cores)
    .venv/bin/python benchmarks/sim/published.py --only trt-8b       # ids starting with trt-8b
    .venv/bin/python benchmarks/sim/published.py --scale 0.25 --engine-profile FILE   # quick, for fitting

`--scale` runs a fraction of each point's requests (fewer requests than published: a quick
look while choosing factors, not a like-for-like figure). `--engine-profile` replaces the
named engine's built-in profile with a JSON file. `--output` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from inflight.bench.results import BenchRun
from inflight.bench.workload import load_workload, with_request_rate
from inflight.config import ModelConfig
from inflight.perf.profiles import EngineProfile, HardwareProfile, load_profiles
from inflight.perf.shapes import num_params
from inflight.sim.runs import SimTarget, simulate
from inflight.sim.shapes import resolve_shapes
from inflight.sim.workload import synthetic_requests

HERE = Path(__file__).resolve().parent / "published"
TARGET_KEYS = ("gpu_memory_utilization",)


def metric(run: BenchRun, name: str) -> float | None:
    m = run.metrics
    return {"output_tok_s": m.output_throughput, "ttft_mean_ms": m.ttft_ms.mean, "ttft_p50_ms": m.ttft_ms.p50,
            "itl_mean_ms": m.tbt_ms.mean, "tpot_p50_ms": m.tpot_ms.p50, "tpot_mean_ms": m.tpot_ms.mean}[name]


def point_options(point: dict[str, Any], defaults: dict[str, dict[str, Any]]) -> dict[str, Any]:
    given = point.get("options", point["engine"])
    options = dict(defaults[given]) if isinstance(given, str) else dict(given)
    if "dtype" in point:
        options["dtype"] = point["dtype"]
    if "gpu_memory_utilization" in point:
        options["gpu_memory_utilization"] = point["gpu_memory_utilization"]
    return options


def predict(point: dict[str, Any], defaults: dict[str, dict[str, Any]], scale: float,
            engines: dict[str, EngineProfile]) -> tuple[float | None, list[str]]:
    """The point's predicted figure, and the command line that gives it."""
    options = point_options(point, defaults)
    utilization = float(options.pop("gpu_memory_utilization", 0.9))
    # A static batch is one batch of the published size: never scaled.
    static = options.get("scheduling_policy") == "static"
    num_requests = point["num_requests"] if static else max(1, round(point["num_requests"] * scale))
    spec, path = load_workload(str(HERE / f"{point['workload']}.yaml"), num_requests=num_requests)
    rate = point.get("request_rate", math.inf)
    spec = with_request_rate(spec, rate)
    requests = synthetic_requests(spec, path.parent)
    longest = max(r.prompt_len + r.output_len for r in requests)
    options.setdefault("max_model_len", point.get("max_model_len", max(4096, longest)))
    name, shapes = resolve_shapes(point["model"])
    hardware, engine = load_profiles(point["hardware"], point["engine"])
    if options.get("max_batch_size") == TRTLLM_BENCH:
        options["max_batch_size"], options["max_num_tokens"] = trtllm_bench_limits(point, shapes, hardware, requests)
    engine = engines.get(point["engine"], engine)
    target = SimTarget(name, shapes, hardware, point.get("tp", 1), utilization, engine,
                       point.get("weights", "auto"), point.get("kv", "auto"))
    run = simulate(target, options, requests, point["id"])
    value = metric(run, point["metric"])
    if value is not None and point.get("per_gpu"):
        value /= target.tp
    return value, command(point, options, num_requests, rate, utilization)


# `max_batch_size: trtllm-bench` in points.yaml: the limits trtllm-bench's engine build picks.
TRTLLM_BENCH = "trtllm-bench"


def trtllm_bench_limits(point: dict[str, Any], shapes: ModelConfig, hardware: HardwareProfile,
                        requests: list[Any]) -> tuple[int, int]:
    """The max batch size and token budget `trtllm-bench build` gives an engine for a dataset of
    one ISL/OSL (tensorrt_llm/bench/build/tuning.py, `calc_engine_setting`): as many requests as
    0.95 of the memory the weights leave holds at their full ISL + OSL (the weights counted at 1
    byte per parameter for FP8, else 2; at least one KV head per GPU), capped at 4096 and rounded
    up, to a multiple of 32 (at least 64) below 256, of 128 below 1024, else of 256; the token
    budget is that many requests times 1 + ISL/OSL, capped at 32768 and rounded up, at least 2048."""
    lengths = {(r.prompt_len, r.output_len) for r in requests}
    if len(lengths) != 1:
        raise SystemExit(f"{point['id']}: trtllm-bench's limits need one ISL/OSL, the workload has {len(lengths)}")
    ((isl, osl),) = lengths
    tp = point.get("tp", 1)
    weight_bytes = 1 if point.get("weights") == "fp8" else 2
    kv_bytes = 1 if point.get("kv") == "fp8" else 2
    gib = 1024 ** 3
    per_token = 2 * shapes.num_layers * max(tp, shapes.num_kv_heads) * shapes.head_dim * kv_bytes / gib
    engine = num_params(shapes) / 1e9 * weight_bytes  # as tuning.py counts it: GB of parameters
    available = hardware.memory_bytes / gib * tp - engine
    max_requests = available * 0.95 / per_token / (isl + osl)
    raw_batch = min(max_requests, 4096)
    raw_tokens = min(raw_batch * (1 + isl / osl), 32768)
    batch = max(64, _round_up(raw_batch, 32 if raw_batch < 256 else 128 if raw_batch < 1024 else 256))
    tokens = max(2048, _round_up(raw_tokens, 256 if raw_tokens < 4096 else 512 if raw_tokens < 8192 else 1024))
    return batch, tokens


def _round_up(x: float, step: int) -> int:
    return step * math.ceil(x / step)


def command(point: dict[str, Any], options: dict[str, Any], num_requests: int, rate: float,
            utilization: float) -> list[str]:
    args = ["inflight", "sim", "--workload", f"benchmarks/sim/published/{point['workload']}.yaml",
            "--num-requests", str(num_requests), "--model", point["model"], "--hardware", point["hardware"],
            "--engine-profile", point["engine"]]
    if math.isfinite(rate):
        args += ["--request-rate", f"{rate:g}"]
    if point.get("tp", 1) > 1:
        args += ["--tp", str(point["tp"])]
    for flag, key in (("--weight-dtype", "weights"), ("--kv-cache-dtype", "kv")):
        if key in point:
            args += [flag, point[key]]
    if utilization != 0.9:
        args += ["--gpu-memory-utilization", f"{utilization:g}"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default=str(HERE / "points.yaml"))
    parser.add_argument("--only", default=None, help="ids starting with this (comma-separated prefixes)")
    parser.add_argument("--engine", default=None, help="only this engine's points")
    parser.add_argument("--role", default=None, choices=["fit", "check"])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each point's requests (default 1)")
    parser.add_argument("--engine-profile", action="append", default=[], metavar="FILE",
                        help="an engine profile JSON replacing the built-in of its name (repeatable)")
    parser.add_argument("--output", "-o", default=None)
    parser.add_argument("--markdown", default=None, metavar="FILE",
                        help="also write the table and the commands as markdown (docs/simulator.md's)")
    args = parser.parse_args()
    data = yaml.safe_load(Path(args.points).read_text(encoding="utf-8"))
    engines = {}
    for path in args.engine_profile:
        profile = EngineProfile.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        engines[profile.name] = profile
    prefixes = tuple(args.only.split(",")) if args.only else ("",)
    points = [p for p in data["points"] if p["id"].startswith(prefixes) and args.engine in (None, p["engine"])
              and args.role in (None, p["role"])]
    rows = []
    print(f"{'point':<42}{'metric':<14}{'published':>11}{'predicted':>11}{'ratio':>7}  role", flush=True)
    for point in points:
        started = time.perf_counter()
        value, cmd = predict(point, data["defaults"], args.scale, engines)
        ratio = None if value is None else value / point["published"]
        mark = " approx" if point.get("approx") else ""
        shown = "-" if value is None else f"{value:.4g}"
        print(f"{point['id']:<42}{point['metric']:<14}{point['published']:>11.4g}{shown:>11}"
              f"{'' if ratio is None else f'{ratio:.2f}':>7}  {point['role']}{mark}"
              f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        rows.append({**point, "predicted": value, "ratio": ratio, "command": shlex.join(cmd)})
    summarize(rows)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, data["sources"]), encoding="utf-8")
        print(f"wrote {args.markdown}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps({"scale": args.scale, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def setup(point: dict[str, Any]) -> str:
    types = "/".join(point.get(k, point.get("dtype", "bf16")) for k in ("weights", "kv")).replace("float16", "fp16")
    gpus = f"{point.get('tp', 1)}x {point['hardware']}"
    rate = point.get("request_rate")
    load = f"{point['num_requests']} at {rate:g}/s" if rate else f"{point['num_requests']} at once"
    if point.get("options", {}) and isinstance(point["options"], dict) \
            and point["options"].get("scheduling_policy") == "static":
        load = f"static batch of {point['num_requests']}"
    return f"{point['model']}, {gpus}, {types}, {point['workload']}, {load}"


def markdown(rows: list[dict[str, Any]], sources: dict[str, str]) -> str:
    lines = ["| point | source | engine | setup | figure | published | predicted | ratio | role |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"**{r['ratio']:.2f}**"
        predicted = "-" if r["predicted"] is None else f"{r['predicted']:.4g}"
        role = r["role"] + (", approx" if r.get("approx") else "")
        lines.append(f"| {r['id']} | {r['source']} | {r['engine']} | {setup(r)} | {r['metric']} | "
                     f"{r['published']:g} | {predicted} | {ratio} | {role} |")
    lines += ["", "```bash"]
    for r in rows:
        lines += [f"# {r['id']}", r["command"]]
    lines += ["```", ""]
    return "\n".join(lines)


def summarize(rows: list[dict[str, Any]]) -> None:
    print()
    for engine in sorted({r["engine"] for r in rows}):
        for role in ("fit", "check"):
            ratios = [r["ratio"] for r in rows if r["engine"] == engine and r["role"] == role and r["ratio"]]
            if ratios:
                within = sum(abs(x - 1) <= 0.15 for x in ratios)
                worst = max(ratios, key=lambda x: abs(math.log(x)))
                print(f"{engine:<8} {role:<6} {len(ratios):>3} points, {within} within 15%, "
                      f"mean |log ratio| {sum(abs(math.log(x)) for x in ratios) / len(ratios):.3f}, "
                      f"worst {worst:.2f}")


if __name__ == "__main__":
    sys.exit(main())
