"""Goodput (DistServe's: requests per second that meet both the TTFT and the TPOT target) of three
schedulers around saturation, on the canonical workloads, in one invocation:

- `fcfs`: continuous batching, first come first served, the default budget (`max_num_tokens` 512,
  `max_batch_size` 64, chunked prefill);
- `fcfs-tuned`: the same with the fixed `max_num_tokens` and `max_batch_size` that give the most
  goodput at the middle rate, searched in the simulator as `inflight tune` searches (the space
  is `inflight tune`'s, chunked prefill on);
- `slo`: `scheduling_policy=slo` with the same targets, choosing budget and batch size itself
  under ceilings of 8192 tokens and 256 requests (`--reject-late` adds a fourth run with it).

    .venv/bin/python benchmarks/slo_goodput.py --target sim --model llama-3-8b --hardware h100 \\
        --rates 20,40,60,80 --ttft-ms 500 --tpot-ms 25 --plot runs/slo-h100
    .venv/bin/python benchmarks/slo_goodput.py --target local --rates 1,2,3 --ttft-ms 3000 --tpot-ms 250 \\
        --plot runs/slo-local       # the real engine on this machine (about 20 minutes on 2 cores)

Each rate reruns the workload spec at that Poisson rate (same seed, same lengths). Printed per
workload and rate: goodput, SLO attainment (share of requests meeting both targets), and TTFT
and TPOT p99; `--plot DIR` draws goodput and attainment against the rate.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from inflight.bench.metrics import RequestSLO
from inflight.bench.results import BenchRun
from inflight.bench.runs import RunPlan
from inflight.bench.workload import load_workload, with_request_rate
from inflight.sim.tune import SearchSpace

DEFAULTS = {"max_num_tokens": 512, "max_batch_size": 64, "enable_chunked_prefill": True}
# The SLO policy chooses each step's budget and the batch's size itself: these are only its
# ceilings, the largest values of the tuning space.
SLO_CEILINGS = {"max_num_tokens": 8192, "max_batch_size": 256}


def _runner(args: argparse.Namespace) -> Any:
    """A function (options, spec) -> BenchRun on the chosen target."""
    if args.target == "sim":
        from inflight.perf.profiles import load_profiles
        from inflight.sim.runs import SimTarget, simulate
        from inflight.sim.workload import synthetic_requests

        hardware, engine = load_profiles(args.hardware, args.engine_profile)
        target = SimTarget.of(args.model, hardware, engine)

        def run_sim(options: dict[str, Any], spec: Any, label: str) -> BenchRun:
            return simulate(target, options, synthetic_requests(spec), label, slo=args.slo)

        return run_sim
    import torch

    from inflight.bench.corpus import Corpus
    from inflight.bench.runs import run_in_process
    from inflight.bench.workload import generate_requests
    from inflight.model.loaded import LoadedModel

    loaded = LoadedModel.load(args.model, torch.float32, torch.device("cpu"))
    corpus = Corpus(loaded.tokenizer)

    def run_local(options: dict[str, Any], spec: Any, label: str) -> BenchRun:
        requests = generate_requests(spec, corpus)
        plan = RunPlan(label, {}, None)
        return run_in_process(args.model, {**options, "num_kv_blocks": args.num_kv_blocks}, [plan], requests,
                              slo=args.slo, progress=False, loaded=loaded)[0]

    return run_local


def _tuned(args: argparse.Namespace, spec: Any) -> dict[str, Any]:
    """The fixed budget and batch size with the most goodput, searched in the simulator (on the
    target's own profile; for the local target, `--tune-hardware`)."""
    from inflight.perf.profiles import load_profiles
    from inflight.sim.runs import SimTarget, simulate
    from inflight.sim.workload import synthetic_requests

    if args.target == "sim":
        hardware, engine = load_profiles(args.hardware, args.engine_profile)
    else:
        hardware, engine = load_profiles(args.tune_hardware)
    target = SimTarget.of(args.model if args.target == "sim" else None, hardware, engine)
    requests = synthetic_requests(spec)
    best: tuple[float, dict[str, Any]] | None = None
    for overrides in SearchSpace(enable_chunked_prefill=(True,)):
        options = {**overrides, "scheduling_policy": "continuous"}
        if args.target == "local":
            options["num_kv_blocks"] = args.num_kv_blocks
        run = simulate(target, options, requests, "tune", slo=args.slo)
        goodput = run.metrics.goodput or 0.0
        if best is None or goodput > best[0] * 1.005:  # ties: the earlier (smaller) configuration
            best = (goodput, overrides)
    assert best is not None
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=["sim", "local"], default="sim")
    parser.add_argument("--model", default=None, help="sim: a built-in shape (llama-3-8b); local: a model file")
    parser.add_argument("--hardware", default="h100", help="sim: the hardware profile")
    parser.add_argument("--engine-profile", default=None, help="sim: the engine profile (default vllm on a GPU)")
    parser.add_argument("--tune-hardware", default="cpu-local", help="local: the profile the budget is tuned on")
    parser.add_argument("--workloads", default="mixed,long-prefill")
    parser.add_argument("--rates", required=True, help="Poisson rates, req/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=None, help="override the specs' request counts")
    parser.add_argument("--ttft-ms", type=float, required=True)
    parser.add_argument("--tpot-ms", type=float, required=True)
    parser.add_argument("--reject-late", action="store_true", help="add a run of the slo policy with it")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="local: the KV pool")
    parser.add_argument("--plot", default=None, metavar="DIR")
    args = parser.parse_args()
    args.slo = RequestSLO(max_ttft_ms=args.ttft_ms, max_tpot_ms=args.tpot_ms)
    if args.target == "sim" and args.model is None:
        args.model = "llama-3-8b"
    rates = [float(r) for r in args.rates.split(",")]
    run = _runner(args)
    slo_options = {"scheduling_policy": "slo", "ttft_slo_ms": args.ttft_ms, "tbt_slo_ms": args.tpot_ms,
                   "enable_chunked_prefill": True}
    where = f"{args.model} on {args.hardware}" if args.target == "sim" else "the real engine on this machine"
    print(f"goodput: TTFT <= {args.ttft_ms:g} ms and TPOT <= {args.tpot_ms:g} ms; {where}")
    results: dict[str, dict[str, list[tuple[float, BenchRun]]]] = {}
    for name in args.workloads.split(","):
        spec, _ = load_workload(name)
        if args.num_requests is not None:
            spec = spec.model_copy(update={"num_requests": args.num_requests})
        tuned = _tuned(args, with_request_rate(spec, rates[len(rates) // 2]))
        configs = {
            "fcfs": {**DEFAULTS, "scheduling_policy": "continuous"},
            f"fcfs-tuned ({tuned['max_num_tokens']}/{tuned['max_batch_size']})":
                {**DEFAULTS, **tuned, "scheduling_policy": "continuous"},
            "slo": {**DEFAULTS, **SLO_CEILINGS, **slo_options},
        }
        if args.reject_late:
            configs["slo+reject-late"] = {**DEFAULTS, **SLO_CEILINGS, **slo_options, "reject_late": True}
        results[name] = {label: [] for label in configs}
        print(f"\n{name} ({spec.num_requests} requests)")
        print(f"{'rate':>6}  {'config':28s} {'goodput':>8} {'attain':>7} {'TTFT p99':>9} {'TPOT p99':>9} "
              f"{'refused':>7}")
        for rate in rates:
            at_rate = with_request_rate(spec, rate)
            for label, options in configs.items():
                result = run(options, at_rate, label)
                results[name][label].append((rate, result))
                m = result.metrics
                done = result.capture.results
                good = m.num_good or 0
                refused = sum(not r.ok for r in done)
                print(f"{rate:6g}  {label:28s} {m.goodput or 0:8.2f} {good / len(done):7.0%} "
                      f"{m.ttft_ms.p99 or 0:9.0f} {m.tpot_ms.p99 or 0:9.1f} {refused:7d}", flush=True)
    if args.plot:
        _plot(results, args, Path(args.plot))


def _plot(results: dict[str, dict[str, list[tuple[float, BenchRun]]]], args: argparse.Namespace, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for name, by_config in results.items():
        fig, (ax_g, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
        for label, points in by_config.items():
            rates = [rate for rate, _ in points]
            ax_g.plot(rates, [r.metrics.goodput or 0 for _, r in points], marker="o", label=label)
            attain = [sum(args.slo.is_met(x) for x in r.capture.results) / len(r.capture.results) for _, r in points]
            ax_a.plot(rates, [100 * a for a in attain], marker="o", label=label)
        ax_g.set(xlabel="arrival rate (req/s)", ylabel="goodput (req/s)", title=f"{name}: goodput")
        ax_a.set(xlabel="arrival rate (req/s)", ylabel="requests meeting both targets (%)",
                 title=f"{name}: SLO attainment", ylim=(0, 105))
        ax_g.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
        plt.close(fig)
    print(f"\nplots: {out}/")


if __name__ == "__main__":
    main()
