"""`inflight bench` (measure a workload on a server or an in-process engine) and the run-file half
of `inflight check` (a run against an SLA; the command and its `--plan` half are registered with
the simulator's, `inflight.sim.cli`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from inflight.bench.metrics import RequestSLO
from inflight.bench.report import (
    command_line,
    environment,
    format_table,
    now_iso,
    read_run_file,
    write_run_file,
)
from inflight.bench.results import BenchRun
from inflight.bench.runs import PRESETS, RunPlan, parse_compare, parse_sweep, plan_runs
from inflight.bench.server_metrics import SERVER_KINDS
from inflight.bench.sla import SLA, CheckLine, check_run, format_check, load_sla
from inflight.bench.workload import (
    BenchRequest,
    WorkloadSpec,
    canonical_specs,
    dataset_workload,
    load_workload,
    parse_workload,
    with_request_rate,
)
from inflight.errors import ConfigError


def register(subparsers: Any) -> None:
    from inflight.options import add_engine_options

    bench = subparsers.add_parser(
        "bench", help="measure throughput, latency and KV use on a fixed workload",
        description="Runs a seeded workload against a server (--url) or an engine in-process, "
                    "prints a table and optionally writes JSON (--output) and plots (--plot).",
    )
    add_workload_options(bench)
    t = bench.add_argument_group("target")
    t.add_argument("--url", default=None,
                   help="an OpenAI-compatible server (http://127.0.0.1:8000); default: an engine in-process")
    t.add_argument("--served-model-name", default=None, help="model name to send (default: the server's first)")
    t.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    t.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout in seconds")
    t.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent to the server before the timed run and left out of it (default 1; "
                        "the in-process engine always warms up)")
    t.add_argument("--server-kind", default="auto", choices=("auto", *SERVER_KINDS),
                   help="whose /metrics names to read (KV usage, queue, preemptions, failures); "
                        "default: recognized from the names")
    t.add_argument("--metrics-url", default=None,
                   help="where the server's /metrics is, if not beside its API (Triton: http://HOST:8002)")
    t.add_argument("--metrics-interval", type=float, default=0.5, metavar="SECONDS",
                   help="how often to sample the server's /metrics during the run (default 0.5)")
    t.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of the in-process engine (default: torch's choice)")
    add_runs_options(bench, "run each configuration in turn", "(in-process only)").add_argument(
        "--lockstep", action="store_true",
        help="with --compare or --sweep: run the configurations at once, their engines taking turns step by step, "
             "each timed by a clock of its own turns (a host whose speed drifts slows all alike; every KV pool alive "
             "at once)")
    o = add_output_options(bench)
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c = bench.add_argument_group("capacity under the SLA")
    c.add_argument("--find-max-rate", action="store_true",
                   help="run the workload's requests at Poisson rates, doubling then bisecting, to the highest "
                        "rate at which every --sla line passes; exit 0 if the SLA's min_request_rate passes")
    c.add_argument("--start-rate", type=float, default=None, metavar="REQ_PER_S",
                   help="the first rate tried after the SLA's min_request_rate (default: the spec's rate, "
                        "else min_request_rate, else 1)")
    c.add_argument("--rate-tolerance", type=float, default=0.1,
                   help="stop when the passing and failing rates are within this fraction (default 0.1)")
    c.add_argument("--max-trials", type=int, default=8, help="at most this many runs (default 8)")
    c.add_argument("--max-duration", type=float, default=1800.0, metavar="SECONDS",
                   help="start no new run after this many seconds (default 1800)")
    add_engine_options(bench)
    bench.set_defaults(func=cmd_bench)


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The workload and its overrides, as `bench`, `sim` and `tune` take them."""
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", default=None,
                   help=f"a canonical workload ({', '.join(sorted(canonical_specs()))}) or a YAML spec path")
    w.add_argument("--dataset", default=None, metavar="FILE",
                   help="replay your own prompts: JSONL of OpenAI chat/completion requests or ShareGPT JSON "
                        "(alone: each record once, all at once; with --workload: its arrivals and seed)")
    w.add_argument("--workload-seed", type=int, default=None, help="override the spec's seed")
    w.add_argument("--num-requests", type=int, default=None, help="override the spec's number of requests")
    w.add_argument("--request-rate", type=float, default=None,
                   help="override the arrival rate in requests/s (inf: all at once)")


def add_runs_options(parser: argparse.ArgumentParser, compare: str, where: str = "") -> argparse._ArgumentGroup:
    """--compare (the presets of `PRESETS`) and --sweep, as `bench` and `sim` take them."""
    r = parser.add_argument_group("runs")
    r.add_argument("--compare", default=None, metavar="A,B,...",
                   help=f"{compare}: {', '.join(PRESETS)} {where}".rstrip())
    r.add_argument("--sweep", action="append", default=[], metavar="OPTION=V1,V2,...",
                   help="each value of an engine option, e.g. max_num_tokens=64,128,256 (repeatable)")
    return r


def add_output_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The run file, plots and SLA of a run, as `bench` and `sim` take them."""
    o = parser.add_argument_group("output")
    o.add_argument("--output", "-o", default=None, help="write the runs to this JSON file")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots to this folder")
    o.add_argument("--sla", default=None, help="SLA YAML: goodput limits, and a check after the run")
    o.add_argument("--report", default=None, metavar="FILE.html",
                   help="write one self-contained HTML page: SLA table, figures, latency distributions, KV "
                        "watermark beside the arrivals, capacity curve, command and workload")
    return o


def workload_from_args(args: argparse.Namespace) -> tuple[WorkloadSpec, Path]:
    """The spec of --workload and/or --dataset, with the command line's overrides."""
    overrides = {"seed": args.workload_seed, "num_requests": args.num_requests}
    if args.workload:
        spec, path = load_workload(args.workload, **overrides)
        if args.dataset:
            spec = parse_workload({**spec.model_dump(exclude_none=True),
                                   "dataset": {"path": str(Path(args.dataset).resolve())}}, source=args.workload)
    elif args.dataset:
        spec, path = dataset_workload(args.dataset, **overrides)
    else:
        raise ConfigError("give --workload (a spec) or --dataset (your prompts), or both")
    if args.request_rate is not None:
        spec = with_request_rate(spec, args.request_rate)
    return spec, path


def cmd_bench(args: argparse.Namespace) -> int:
    from inflight.options import engine_options

    spec, spec_path = workload_from_args(args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be >= 1")
    if args.num_warmups < 0:
        raise ConfigError("--num-warmups must be >= 0")
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise ConfigError("--torch-threads must be >= 1")
        import torch

        torch.set_num_threads(args.torch_threads)
    sla = load_sla(args.sla) if args.sla else None
    slo = sla.goodput.slo() if sla and sla.goodput else None
    compare = parse_compare(args.compare) if args.compare else []
    sweeps = [parse_sweep(s) for s in args.sweep]
    plans = plan_runs(compare, sweeps)
    progress = not args.no_progress and sys.stderr.isatty()
    document: dict[str, Any] = {"created_at": now_iso(), "command": command_line(), "environment": environment()}
    if args.find_max_rate:
        if sla is None:
            raise ConfigError("--find-max-rate needs --sla: the lines every trial must pass")
        if compare or sweeps:
            raise ConfigError("--find-max-rate searches one configuration; drop --compare and --sweep")
        return _find_max_rate(args, spec, spec_path, sla, progress, document)

    if args.lockstep and (args.url or args.find_max_rate):
        raise ConfigError("--lockstep runs in-process configurations side by side; drop --url and --find-max-rate")
    if args.url:
        if compare or sweeps:
            raise ConfigError("--compare and --sweep need an in-process engine; a server has one configuration")
        runs, requests, document["target"] = _bench_http(args, spec, spec_path, slo, progress)
    else:
        options = engine_options(args)
        runs, requests = _bench_in_process(args, options, plans, spec, spec_path, slo, progress)
        document["target"] = {"kind": "in-process", "model": args.model}
        document.update({"engine_options": options, "compare": compare, "sweep": dict(sweeps)})

    document.update({
        "workload": {"name": spec.name, "source": str(spec_path), "seed": spec.seed, "sha256": spec.sha256,
                     "num_requests": len(requests), "spec": spec.model_dump(mode="json")},
        "max_concurrency": args.max_concurrency,
        "sla": sla.model_dump(mode="json") if sla else None,
    })
    document["environment"]["load_average_end"] = environment()["load_average"]
    title = f"inflight bench: {spec.name} ({len(requests)} requests, seed {spec.seed})"
    print(format_table(runs, title))
    if args.output:
        write_run_file(Path(args.output), document, runs)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        from inflight.bench.plots import plot_runs

        for path in plot_runs(runs, Path(args.plot), title=spec.name, sweep_keys=[k for k, _ in sweeps]):
            print(f"wrote {path}", file=sys.stderr)
    _write_report(args, document, runs, sla)
    if sla is not None:
        return _check_and_print(sla, args.sla, args.output or "(this run)", runs, spec.name)
    return 0


def _write_report(args: argparse.Namespace, document: dict[str, Any], runs: list[BenchRun], sla: SLA | None) -> None:
    if getattr(args, "report", None):
        from inflight.bench.html_report import write_report

        print(f"wrote {write_report(Path(args.report), document, runs, sla, args.sla)}", file=sys.stderr)


def _bench_http(args: argparse.Namespace, spec: WorkloadSpec, spec_path: Path, slo: RequestSLO | None,
                progress: bool) -> tuple[list[BenchRun], list[BenchRequest], dict[str, Any]]:
    from inflight.bench.client import run_http
    from inflight.bench.corpus import Corpus
    from inflight.bench.workload import generate_requests
    from inflight.model.loader import resolve_model
    from inflight.model.tokenizer import Tokenizer

    # Prompts are cut with the tokenizer of --model, which must be the model the server runs.
    requests = generate_requests(spec, Corpus(Tokenizer.load(resolve_model(args.model))), spec_path.parent)
    if args.metrics_interval <= 0:
        raise ConfigError("--metrics-interval must be > 0")
    capture, info = run_http(args.url, requests, model=args.served_model_name,
                             max_concurrency=args.max_concurrency, progress=progress, timeout_s=args.timeout,
                             metrics_interval_s=args.metrics_interval, server_kind=args.server_kind,
                             metrics_url=args.metrics_url, num_warmups=args.num_warmups)
    sampling = info["metrics"]
    if sampling["problem"]:
        print(f"inflight bench: server metrics not read: {sampling['problem']}", file=sys.stderr)
    else:
        print(f"inflight bench: {sampling['server_kind']} /metrics sampled {sampling['scrapes']} times, "
              f"{sampling['scrape_mean_ms']} ms each, {sampling['parse_cpu_mean_ms']} ms of it our CPU "
              f"({100 * sampling['cpu_share']:.2f}% of the run); "
              f"exposes {', '.join(sampling['exposed']) or 'nothing the gate reads'}", file=sys.stderr)
    return [BenchRun.measure("server", info, capture, slo)], requests, {"kind": "http", **info}


def _bench_in_process(args: argparse.Namespace, options: dict[str, Any], plans: list[RunPlan],
                      spec: WorkloadSpec, spec_path: Path, slo: RequestSLO | None,
                      progress: bool) -> tuple[list[BenchRun], list[BenchRequest]]:
    from inflight.bench.corpus import Corpus
    from inflight.bench.runs import run_in_process, run_lockstep
    from inflight.bench.workload import generate_requests
    from inflight.config import EngineConfig
    from inflight.engine.engine import load_model_for

    loaded = load_model_for(EngineConfig.from_kwargs(args.model, **options))  # a bad option fails first
    requests = generate_requests(spec, Corpus(loaded.tokenizer), spec_path.parent)
    if args.lockstep:
        runs = run_lockstep(args.model, options, plans, requests, max_concurrency=args.max_concurrency, slo=slo,
                            loaded=loaded)
    else:
        runs = run_in_process(args.model, options, plans, requests, max_concurrency=args.max_concurrency,
                              slo=slo, progress=progress, loaded=loaded)
    return runs, requests


def _find_max_rate(args: argparse.Namespace, spec: WorkloadSpec, spec_path: Path, sla: SLA, progress: bool,
                   document: dict[str, Any]) -> int:
    """`--find-max-rate`: the same requests (prompts and lengths fixed by the spec's seed) at
    rising Poisson rates, against the server or an in-process engine alike."""
    from inflight.bench.capacity import find_max_rate, format_capacity
    from inflight.bench.corpus import Corpus
    from inflight.bench.workload import generate_requests

    if args.max_trials < 1 or args.max_duration <= 0 or not 0 < args.rate_tolerance < 1:
        raise ConfigError("--max-trials must be >= 1, --max-duration > 0 and --rate-tolerance in (0, 1)")
    slo = sla.goodput.slo() if sla.goodput else None
    start = args.start_rate or getattr(spec.arrivals, "rate", None) or sla.min_request_rate or 1.0
    if args.url:
        from inflight.bench.client import run_http
        from inflight.model.loader import resolve_model
        from inflight.model.tokenizer import Tokenizer

        corpus = Corpus(Tokenizer.load(resolve_model(args.model)))
        document["target"] = {"kind": "http", "url": args.url}

        def run_at(rate: float, requests: list[BenchRequest]) -> BenchRun:
            capture, info = run_http(args.url, requests, model=args.served_model_name,
                                     max_concurrency=args.max_concurrency, progress=progress, timeout_s=args.timeout,
                                     metrics_interval_s=args.metrics_interval, server_kind=args.server_kind,
                                     metrics_url=args.metrics_url, num_warmups=args.num_warmups)
            document["target"].update(info)
            return BenchRun.measure(f"rate={rate:.4g}", info, capture, slo)
    else:
        from inflight.bench.runs import run_in_process
        from inflight.config import EngineConfig
        from inflight.engine.engine import load_model_for
        from inflight.options import engine_options

        options = engine_options(args)
        loaded = load_model_for(EngineConfig.from_kwargs(args.model, **options))
        corpus = Corpus(loaded.tokenizer)
        document["target"] = {"kind": "in-process", "model": args.model}
        document["engine_options"] = options

        def run_at(rate: float, requests: list[BenchRequest]) -> BenchRun:
            (run,) = run_in_process(args.model, options, plan_runs(), requests, max_concurrency=args.max_concurrency,
                                    slo=slo, progress=progress, loaded=loaded)
            run.label = f"rate={rate:.4g}"
            return run

    def measure(rate: float) -> tuple[BenchRun, list[CheckLine]]:
        run = run_at(rate, generate_requests(with_request_rate(spec, rate), corpus, spec_path.parent))
        return run, check_run(sla, run, spec.name)

    capacity = find_max_rate(measure, start, args.rate_tolerance, args.max_trials, args.max_duration,
                             sla.min_request_rate, progress=lambda line: print(line, file=sys.stderr))
    title = f"inflight bench --find-max-rate: {spec.name} ({spec.num_requests} requests a trial, seed {spec.seed})"
    print(format_capacity(capacity, slo, title))
    floor = sla.min_request_rate
    verdict = capacity.passes(floor) if floor is not None else capacity.max_rate is not None
    if floor is not None:
        print(f"min_request_rate {floor:g} req/s: {'PASS' if verdict else 'FAIL'}")
    runs = [t.run for t in capacity.trials]
    document.update({
        "workload": {"name": spec.name, "source": str(spec_path), "seed": spec.seed, "sha256": spec.sha256,
                     "num_requests": spec.num_requests, "spec": spec.model_dump(mode="json")},
        "max_concurrency": args.max_concurrency,
        "sla": sla.model_dump(mode="json"),
        "capacity": {"max_rate": capacity.max_rate, "stopped": capacity.stopped, "min_request_rate": floor,
                     "passed": bool(verdict),
                     "trials": [{"rate": t.rate, "passed": t.passed, "limiting": t.limiting,
                                 "attainment": t.attainment(slo), "label": t.run.label} for t in capacity.trials]},
    })
    if args.output:
        write_run_file(Path(args.output), document, runs)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        from inflight.bench.plots import plot_capacity

        folder = Path(args.plot)
        folder.mkdir(parents=True, exist_ok=True)
        points = [(t.rate, t.run.metrics.goodput, t.attainment(slo), t.passed) for t in capacity.trials]
        print(f"wrote {plot_capacity(points, folder / 'capacity.png', capacity.max_rate, spec.name)}", file=sys.stderr)
    _write_report(args, document, runs, sla)
    return 0 if verdict else 1


def cmd_check(args: argparse.Namespace) -> int:
    if not args.sla or not args.run:
        raise ConfigError("inflight check --sla SLA RUN.json (or --plan, before any traffic)")
    sla = load_sla(args.sla)
    document, runs = read_run_file(Path(args.run))
    workload = (document.get("workload") or {}).get("name")
    _write_report(args, document, runs, sla)
    return _check_and_print(sla, args.sla, args.run, runs, workload)


def _check_and_print(sla: SLA, sla_path: str, run_path: str, runs: list[BenchRun], workload: str | None) -> int:
    results = [(run, check_run(sla, run, workload)) for run in runs]
    print(format_check(sla_path, run_path, results))
    return 0 if all(line.ok for _, lines in results for line in lines) else 1
