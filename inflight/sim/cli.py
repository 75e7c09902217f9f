"""`inflight sim` (a workload on the real scheduler over a cost model), `inflight sim calibrate`
(fit a hardware profile on this machine) and `inflight tune` (configurations that pass an SLA)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from inflight.bench.cli import add_output_options, add_runs_options, add_workload_options
from inflight.errors import ConfigError
from inflight.perf.profiles import BUILTIN_HARDWARE
from inflight.perf.shapes import BUILTIN_MODELS

_MODEL_HELP = (f"model shapes: a built-in name ({', '.join(BUILTIN_MODELS)}), a Hugging Face config.json or its "
               "folder, or a GGUF file (default: the embedded SmolLM2-135M)")
_HARDWARE_HELP = f"{', '.join(BUILTIN_HARDWARE)}, or a profile JSON from `inflight sim calibrate`"


def register(subparsers: Any) -> None:
    sim = subparsers.add_parser(
        "sim", help="simulate a workload: the real scheduler on a virtual clock over a cost model",
        description="Runs a workload spec through the production scheduler and block manager, with "
                    "step times from a roofline cost model instead of a model. Prints the bench table; "
                    "--output, --plot and --sla work as for `inflight bench`.",
    )
    _add_target_options(sim)
    add_workload_options(sim)
    sim.add_argument("--acceptance-rate", type=float, default=None, metavar="A",
                     help="with --speculative-config: the chance a proposed token is kept once those before it "
                          "were (default: the workload's acceptance_rate)")
    sim.add_argument("--proposal-rate", type=float, default=None, metavar="P",
                     help="with --speculative-config: the chance a decoding request's n-gram or suffix lookup finds "
                          "a proposal at a step (default: the workload's proposal_rate, else 1)")
    add_runs_options(sim, "simulate each configuration in turn")
    o = add_output_options(sim)
    o.add_argument("--against", default=None, metavar="RUN.json",
                   help="instead of --workload: re-simulate the runs of an `inflight bench` run file (its "
                        "workload, engine options and KV pool) and print measured, simulated and the error")
    _add_engine_options(sim)
    sim.set_defaults(func=cmd_sim)

    sub = sim.add_subparsers(dest="sim_command", metavar="{calibrate}")
    cal = sub.add_parser("calibrate", help="time real engine steps on this machine and fit a hardware profile",
                         description="Times a grid of engine steps (decodes, prefill chunks, mixed) with a "
                                     "real model on the CPU and fits the profile's efficiency factors and "
                                     "overheads by least squares.")
    cal.add_argument("--model", default=None, help="GGUF file or HF model folder (default: the embedded model)")
    cal.add_argument("--output", "-o", required=True, help="write the fitted profile (JSON) here")
    cal.add_argument("--base", default="cpu-local",
                     help="hardware whose nominal peaks the fit uses, and whose engine factors it starts from "
                          "(default cpu-local)")
    cal.add_argument("--name", default=None, help="name of the fitted profile (default: the base's)")
    cal.add_argument("--torch-threads", type=int, default=1,
                     help="intra-op threads, as the runs it should predict use (default 1)")
    cal.add_argument("--max-num-tokens", type=int, default=2048,
                     help="token budget of the timed engine: the largest prefill step (default 2048)")
    cal.add_argument("--repeats", type=int, default=2, help="times the grid is measured (default 2, ~1.5 min)")
    cal.add_argument("--samples", default=None, help="also write every timed step (JSON) here")
    cal.add_argument("--quantization", choices=["none", "int8"], default="none",
                     help="int8: time an engine with --quantization int8 and add its one factor (the int8 "
                          "matmuls' efficiency) to --base, a profile this command fitted on this machine")
    cal.set_defaults(func=cmd_calibrate)

    tune = subparsers.add_parser(
        "tune", help="search engine configurations in simulation for those that pass an SLA",
        description="Simulates every combination of --max-num-tokens-grid, --max-batch-size-grid and "
                    "chunked prefill on/off, checks each against the SLA, and prints those that pass, "
                    "highest output throughput first.",
    )
    _add_target_options(tune)
    add_workload_options(tune)
    tune.add_argument("--sla", required=True, help="SLA YAML file (as for `inflight check`)")
    g = tune.add_argument_group("search")
    g.add_argument("--max-num-tokens-grid", default="256,512,1024,2048,4096,8192", metavar="N,N,...")
    g.add_argument("--max-batch-size-grid", default="16,32,64,128,256", metavar="N,N,...")
    g.add_argument("--chunked-prefill-grid", default="on,off", metavar="on,off")
    g.add_argument("--replicas-grid", default="1", metavar="N,N,...",
                   help="fleet sizes to search (engine replicas behind a router; default 1)")
    g.add_argument("--router-grid", default="prefix", metavar="P,P,...",
                   help="routing policies to search with replicas > 1: prefix, pow2, round-robin")
    g.add_argument("--max-rate", action="store_true",
                   help="also find, for the best --top configurations, the highest Poisson rate that passes")
    g.add_argument("--top", type=int, default=5, help="configurations given a rate search (default 5)")
    g.add_argument("--all", action="store_true", help="also list the failing configurations and why")
    tune.add_argument("--output", "-o", default=None, help="write the passing runs to this JSON file")
    _add_engine_options(tune)
    tune.set_defaults(func=cmd_tune)

    check = subparsers.add_parser(
        "check", help="pre-launch checklist: a bench run file against an SLA, or (--plan) a configuration "
                      "against a workload before any traffic",
        description="`inflight check --sla SLA RUN.json` shows each SLA line as PASS or FAIL; exits 1 if any "
                    "fails, 2 on a bad file. `inflight check --plan --workload W [--sla SLA] [engine options]` "
                    "flags, before any traffic, requests longer than max_model_len, prompts the token budget "
                    "cannot take, a KV pool that cannot hold the batch (preemption ahead) and a full step "
                    "predicted above the SLA's TBT p99; exits 1 if anything is flagged.",
    )
    check.add_argument("--sla", default=None, help="SLA YAML file")
    check.add_argument("run", nargs="?", default=None, help="a JSON file written by `inflight bench --output`")
    check.add_argument("--report", default=None, metavar="FILE.html",
                       help="also write the run's self-contained HTML report, checked against --sla")
    p = check.add_argument_group("plan (--plan)")
    p.add_argument("--plan", action="store_true", help="check a configuration against a workload, sending nothing")
    p.add_argument("--engine-config", default=None, metavar="YAML",
                   help="the engine's options in a file: inflight's names, or vLLM's `--config` file "
                        "(max-num-seqs, max-num-batched-tokens, max-model-len, kv-cache-memory-bytes, ...)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's name for --max-batch-size")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's name for --max-num-tokens")
    _add_target_options(check)
    add_workload_options(check)
    _add_engine_options(check)
    check.set_defaults(func=cmd_check)


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("simulated target")
    t.add_argument("--hardware", default="cpu-local", help=_HARDWARE_HELP + " (default cpu-local)")
    t.add_argument("--engine-profile", default=None, metavar="NAME|FILE",
                   help="whose kernels and step loop: vllm, sglang, trtllm, inflight, or an engine profile "
                        "JSON (default: the engine calibrated with --hardware, else vllm on a GPU)")
    t.add_argument("--weight-dtype", default="auto", help="auto (the compute type), bfloat16, float16, fp8, int8")
    t.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (default 1)")
    t.add_argument("--replicas", type=int, default=1,
                   help="engine replicas behind a router, as `inflight serve --replicas` (default 1)")
    t.add_argument("--router", default="prefix", choices=["prefix", "pow2", "round-robin"],
                   help="the fleet's routing policy (with --replicas 2 or more)")
    t.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each GPU's memory for weights and KV, as vLLM's option (default 0.9)")
    t.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    from inflight.options import add_engine_options

    add_engine_options(parser)
    for action in parser._actions:  # the same engine options as bench; only --model means shapes here
        if "--model" in action.option_strings:
            action.help = _MODEL_HELP


def _target(args: argparse.Namespace) -> Any:
    from inflight.perf.cost_model import normalize_dtype
    from inflight.perf.profiles import load_profiles
    from inflight.sim.runs import SimTarget

    if not 0 < args.gpu_memory_utilization <= 1:
        raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be >= 1")
    hardware, engine = load_profiles(args.hardware, args.engine_profile)
    weights = normalize_dtype(args.weight_dtype, "auto", "--weight-dtype")
    kv = normalize_dtype(args.kv_cache_dtype, "auto", "--kv-cache-dtype")  # an engine option (the KV pool's)
    return SimTarget.of(args.model, hardware, engine, tp=args.tp, gpu_memory_utilization=args.gpu_memory_utilization,
                        weight_dtype=weights, kv_cache_dtype=kv)


def _workload(args: argparse.Namespace) -> tuple[Any, Path]:
    from inflight.bench.cli import workload_from_args

    return workload_from_args(args)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's options, and the fleet's (replicas, router) where there is more than one."""
    from inflight.options import engine_options

    options = engine_options(args)
    options.pop("device", None)
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        options.update(replicas=args.replicas, router=args.router)
    return options


def _document(args: argparse.Namespace, target: Any, spec: Any, spec_path: Path, num_requests: int,
              sla: Any) -> dict[str, Any]:
    from inflight.bench.report import command_line, environment, now_iso

    return {
        "created_at": now_iso(), "command": command_line(), "environment": environment(),
        "target": target.to_dict(), "engine_options": _engine_options(args),
        "workload": {"name": spec.name, "source": str(spec_path), "seed": spec.seed, "sha256": spec.sha256,
                     "num_requests": num_requests, "spec": spec.model_dump(mode="json")},
        "max_concurrency": args.max_concurrency,
        "sla": sla.model_dump(mode="json") if sla else None,
    }


def cmd_sim(args: argparse.Namespace) -> int:
    from inflight.bench.report import format_table, write_run_file
    from inflight.bench.runs import parse_compare, parse_sweep, plan_runs
    from inflight.bench.sla import check_run, format_check, load_sla
    from inflight.sim.runs import FLEET_OPTIONS, SIM_OPTIONS, simulate_plans
    from inflight.sim.workload import synthetic_requests

    target = _target(args)
    if args.against:
        return _validate(args.against, target)
    spec, spec_path = _workload(args)
    sla = load_sla(args.sla) if args.sla else None
    slo = sla.goodput.slo() if sla and sla.goodput else None
    compare = parse_compare(args.compare) if args.compare else []
    sweeps = [parse_sweep(s, extra=FLEET_OPTIONS + SIM_OPTIONS) for s in args.sweep]
    requests = synthetic_requests(spec, spec_path.parent)
    options = _engine_options(args)
    acceptance = args.acceptance_rate if args.acceptance_rate is not None else spec.acceptance_rate
    if acceptance is not None:
        if not 0 <= acceptance <= 1:
            raise ConfigError(f"--acceptance-rate must be in [0, 1], got {acceptance}")
        options["acceptance_rate"] = acceptance
    found = args.proposal_rate if args.proposal_rate is not None else spec.proposal_rate
    if found is not None:
        if not 0 <= found <= 1:
            raise ConfigError(f"--proposal-rate must be in [0, 1], got {found}")
        options["proposal_rate"] = found
    runs = simulate_plans(target, options, plan_runs(compare, sweeps), requests, args.max_concurrency, slo)
    title = f"inflight sim: {spec.name} ({len(requests)} requests, seed {spec.seed}), {target.describe()}"
    print(format_table(runs, title))
    if args.output:
        document = _document(args, target, spec, spec_path, len(requests), sla)
        document.update({"compare": compare, "sweep": dict(sweeps)})
        write_run_file(Path(args.output), document, runs)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        from inflight.bench.plots import plot_runs

        for path in plot_runs(runs, Path(args.plot), title=f"{spec.name} (simulated)",
                              sweep_keys=[k for k, _ in sweeps]):
            print(f"wrote {path}", file=sys.stderr)
    if args.report:
        from inflight.bench.html_report import write_report

        document = _document(args, target, spec, spec_path, len(requests), sla)
        print(f"wrote {write_report(Path(args.report), document, runs, sla, args.sla)}", file=sys.stderr)
    if sla is None:
        return 0
    results = [(run, check_run(sla, run, spec.name)) for run in runs]
    print(format_check(args.sla, args.output or "(this run)", results))
    return 0 if all(line.ok for _, lines in results for line in lines) else 1


def _validate(run_path: str, target: Any) -> int:
    from inflight.bench.report import read_run_file
    from inflight.sim.validate import format_comparisons, resimulate

    document, runs = read_run_file(Path(run_path))
    workload = document["workload"]
    load = document.get("environment", {}).get("load_average")
    title = (f"{run_path}: {workload['name']} ({workload['num_requests']} requests), measured (load average "
             f"{load}) against simulated on {target.describe()}")
    print(format_comparisons(resimulate(document, runs, target), title))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from inflight.perf.profiles import load_profiles, save_profile
    from inflight.sim.calibrate import calibrate
    from inflight.sim.fit import format_fit

    hardware, base = load_profiles(args.base)
    if hardware.kind != "cpu":
        raise ConfigError(f"calibrate times the engine on this machine's CPU; --base {args.base} is a GPU")
    if args.torch_threads < 1 or args.repeats < 1:
        raise ConfigError("--torch-threads and --repeats must be >= 1")

    def progress(message: str) -> None:
        print(message, file=sys.stderr)

    if args.quantization == "int8":
        from inflight.sim.calibrate import calibrate_int8

        if not base.calibration:
            raise ConfigError(f"--quantization int8 adds to a profile fitted on this machine; {args.base} was not "
                              f"(run `inflight sim calibrate -o FILE` first and pass --base FILE)")
        result, profile, samples = calibrate_int8(args.model, hardware, base, torch_threads=args.torch_threads,
                                                  max_num_tokens=args.max_num_tokens, repeats=args.repeats,
                                                  progress=progress)
        save_profile(Path(args.output), result.hardware, profile)
        print(f"wrote {args.output}", file=sys.stderr)
        print(format_fit(result, samples, int8=True))
        return 0
    result, samples, as_stored = calibrate(args.model, hardware, base, name=args.name or hardware.name,
                                torch_threads=args.torch_threads, max_num_tokens=args.max_num_tokens,
                                repeats=args.repeats, progress=progress)
    save_profile(Path(args.output), result.hardware, result.profile)
    print(f"wrote {args.output}", file=sys.stderr)
    if args.samples:
        def rows(fit: Any, steps: list[Any]) -> list[dict[str, Any]]:
            return [{"batch": [list(w) for w in s.batch], "duration_s": s.duration_s, "forward_s": s.forward_s,
                     "predicted_s": float(p), **({"storage": s.storage._asdict(), "hidden_size": s.shapes.hidden_size,
                                                  "num_layers": s.shapes.num_layers} if s.storage else {})}
                    for s, p in zip(steps, fit.predicted_s, strict=True)]

        Path(args.samples).write_text(json.dumps({
            "engine": dataclasses.asdict(result.profile), "hardware": dataclasses.asdict(result.hardware),
            "steps": rows(result, samples), "as_stored_steps": rows(*as_stored) if as_stored else None}))
    print(format_fit(result, samples))
    if as_stored is not None:
        print("\nwith the weights priced as stored, also on the model's copies (the factors of any other "
              "checkpoint's steps):")
        print(format_fit(*as_stored))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from inflight.bench.report import format_table, write_run_file
    from inflight.bench.runs import parse_value
    from inflight.bench.sla import load_sla
    from inflight.sim.tune import SearchSpace, Tuner, add_max_rates, format_candidates

    def ints(text: str, name: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ConfigError(f"--{name} wants integers separated by commas, got {text!r}") from None
        if not values or min(values) < 1:
            raise ConfigError(f"--{name} wants integers >= 1")
        return values

    chunked = tuple(parse_value(v) for v in args.chunked_prefill_grid.split(",") if v.strip())
    if not chunked or not all(isinstance(v, bool) for v in chunked):
        raise ConfigError("--chunked-prefill-grid wants on, off or on,off")
    routers = tuple(r.strip() for r in args.router_grid.split(",") if r.strip())
    if not routers or any(r not in ("prefix", "pow2", "round-robin") for r in routers):
        raise ConfigError("--router-grid wants prefix, pow2 and round-robin, separated by commas")
    space = SearchSpace(ints(args.max_num_tokens_grid, "max-num-tokens-grid"),
                        ints(args.max_batch_size_grid, "max-batch-size-grid"), chunked,
                        ints(args.replicas_grid, "replicas-grid"), routers)
    target = _target(args)
    spec, spec_path = _workload(args)
    sla = load_sla(args.sla)
    base = {k: v for k, v in _engine_options(args).items()
            if k not in ("max_num_tokens", "max_batch_size", "enable_chunked_prefill", "replicas", "router")}
    tuner = Tuner(target, spec, sla, base, spec_path.parent, args.max_concurrency)
    candidates = tuner.search(space)
    passing = [c for c in candidates if c.passed]
    if args.max_rate:
        passing = add_max_rates(tuner, passing, args.top)
    title = (f"inflight tune: {spec.name} ({len(tuner.requests)} requests) on {target.describe()}, SLA {args.sla}: "
             f"{len(passing)} of {len(candidates)} configurations pass ({tuner.num_simulations} simulations)")
    print(format_candidates(passing, title))
    if args.all:
        for c in candidates:
            if not c.passed:
                failed = ", ".join(f"{line.name} {_show(line.measured)} {line.unit} (limit {line.limit})"
                                   for line in c.checks if not line.ok)
                print(f"  FAIL {c.label}: {failed}")
    if passing and len(passing) <= 8:
        print(format_table([c.run for c in passing[:4]], "best configurations"))
    if args.output and passing:
        document = _document(args, target, spec, spec_path, len(tuner.requests), sla)
        document["tune"] = {"space": {"max_num_tokens": space.max_num_tokens, "max_batch_size": space.max_batch_size,
                                      "enable_chunked_prefill": space.enable_chunked_prefill,
                                      "replicas": space.replicas, "routers": space.routers},
                            "max_rates": {c.label: c.max_rate for c in passing}}
        write_run_file(Path(args.output), document, [c.run for c in passing])
        print(f"wrote {args.output}", file=sys.stderr)
    return 0 if passing else 1


def cmd_check(args: argparse.Namespace) -> int:
    from inflight.bench.cli import cmd_check as check_run_file

    if not args.plan:
        return check_run_file(args)
    if args.run:
        raise ConfigError("--plan checks a configuration, not a run file: drop RUN.json")
    return _check_plan(args)


def _check_plan(args: argparse.Namespace) -> int:
    from inflight.bench.sla import load_sla
    from inflight.config import EngineConfig
    from inflight.options import engine_option_fields
    from inflight.sim.plan import check_plan, format_plan, read_engine_config
    from inflight.sim.workload import synthetic_requests

    options = _engine_options(args)
    ignored: list[str] = []
    if args.engine_config:
        from_file, target_options, ignored = read_engine_config(Path(args.engine_config))
        defaults = {f.name: f.default for f, _ in engine_option_fields()}
        # The file's values, unless a flag set the option to something other than its default.
        options.update({k: v for k, v in from_file.items() if options.get(k) == defaults.get(k)})
        if "gpu_memory_utilization" in target_options and args.gpu_memory_utilization == 0.9:
            args.gpu_memory_utilization = float(target_options["gpu_memory_utilization"])
        if "tensor_parallel_size" in target_options and args.tp == 1:
            args.tp = int(target_options["tensor_parallel_size"])
    for vllm_flag, name in ((args.max_num_seqs, "max_batch_size"), (args.max_num_batched_tokens, "max_num_tokens")):
        if vllm_flag is not None:
            options[name] = vllm_flag
    if options.get("replicas", 1) != 1:
        raise ConfigError("--plan checks one engine; drop --replicas")
    target = _target(args)
    spec, spec_path = _workload(args)
    sla = load_sla(args.sla) if args.sla else None
    requests = synthetic_requests(spec, spec_path.parent)
    plan = check_plan(target, options, requests, sla)
    config = EngineConfig.from_kwargs(None, **options)
    sched = config.scheduler
    shown = (f"max_batch_size {sched.max_batch_size}, max_num_tokens {sched.max_num_tokens}, max_model_len "
             f"{sched.max_model_len}, chunked prefill {'on' if sched.enable_chunked_prefill else 'off'}, "
             f"block_size {config.cache.block_size}, KV {plan.num_kv_blocks} blocks")
    title = (f"inflight check --plan: {spec.name} ({len(requests)} requests, seed {spec.seed}) on "
             f"{target.describe()}" + (f", SLA {args.sla}" if sla else ""))
    print(format_plan(plan, title, shown, ignored))
    return 1 if plan.flags else 0


def _show(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
