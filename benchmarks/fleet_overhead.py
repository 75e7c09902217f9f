"""What the fleet's layers cost: one engine served by the plain process (`inflight serve`)
against the same engine as the only replica of a fleet (`--replicas 1 --min-replicas 1
--max-replicas 1`: the ingress in the serving process, the router, and a deployment handle to
the replica), with the same workload sent through HTTP by `inflight bench`'s client. The fleet
runs twice: with the inflight router, whose replica sends each step's pieces to the ingress in
one Ray message ("fleet of 1"), and with Ray Serve's own router, where every streamed chunk is
its own Ray message ("fleet of 1, per-chunk"). Each gets all the machine's cores for torch;
alternated. The CPU time of every process is measured over each run.

    .venv/bin/python benchmarks/fleet_overhead.py                     # burst workload, 2 rounds, ~12 min
    .venv/bin/python benchmarks/fleet_overhead.py --workload mixed --rounds 1 --servers one,fleet
    .venv/bin/python benchmarks/fleet_overhead.py --rounds 1 --idle-s 30      # also: what each costs idle
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import psutil
from serving import healthy, replicas_reporting, start_serve, stop

from inflight.bench.client import run_http
from inflight.bench.corpus import Corpus
from inflight.bench.results import BenchRun
from inflight.bench.workload import generate_requests, load_workload
from inflight.model.loader import resolve_model
from inflight.model.tokenizer import Tokenizer

SERVERS = {"one": "one process", "fleet": "fleet of 1", "fleet-direct": "fleet of 1, per-chunk"}


def _serve(server: str, num_kv_blocks: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    args = ["--num-kv-blocks", str(num_kv_blocks), "--log-level", "warning"]
    if server != "one":
        args += ["--replicas", "1", "--min-replicas", "1", "--max-replicas", "1",
                 "--replica-cpus", str(os.cpu_count() or 1)]
    if server == "fleet-direct":
        args += ["--router", "ray"]
    return start_serve(args, log, ready=replicas_reporting(1) if server != "one" else healthy)


def _cpu_seconds(server: subprocess.Popen[bytes]) -> dict[str, float]:
    """CPU seconds so far of the server and every process it started (Ray's included), keyed
    by pid and name; the process that runs the model (the plain server, or the replica) is
    "engine"."""
    out: dict[str, float] = {}
    root = psutil.Process(server.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd, times = " ".join(p.cmdline()), p.cpu_times()
        except psutil.Error:  # it has just exited
            continue
        engine = "EngineReplica" in cmd or ("inflight.cli serve" in cmd and "--replicas" not in cmd)
        out["engine" if engine else f"{p.pid} {cmd[:40]}"] = times.user + times.system
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="burst")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--servers", default="one,fleet,fleet-direct", help=f"some of {', '.join(SERVERS)}")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="first measure each server idle for this long: the CPU its processes take doing nothing")
    args = parser.parse_args()
    servers = args.servers.split(",")
    if unknown := set(servers) - set(SERVERS):
        parser.error(f"--servers: unknown {', '.join(sorted(unknown))}")
    spec, path = load_workload(args.workload)
    requests = generate_requests(spec, Corpus(Tokenizer.load(resolve_model(None))), path.parent)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    print(f"{spec.name}: {len(requests)} requests over HTTP; {os.cpu_count()} CPUs")
    print(f"{'server':22s} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TBT p50':>8} {'TBT p99':>8} "
          f"{'CPU s/run':>9} {'of it outside the engine':>24}")
    for _ in range(args.rounds):
        for server in servers:
            proc, url = _serve(server, args.num_kv_blocks, logs / f"overhead-{server}.log")
            try:
                if args.idle_s:
                    before = _cpu_seconds(proc)
                    time.sleep(args.idle_s)
                    idle = {name: t - before.get(name, 0.0) for name, t in _cpu_seconds(proc).items()}
                    outside = sum(t for name, t in idle.items() if t > 0 and name != "engine")
                    print(f"{SERVERS[server]:22s} idle: {outside / args.idle_s:.3f} cores outside the engine, "
                          f"{idle.get('engine', 0.0) / args.idle_s:.3f} in it", flush=True)
                before = _cpu_seconds(proc)
                capture, _ = run_http(url, requests, progress=False)
                spent = {name: t - before.get(name, 0.0) for name, t in _cpu_seconds(proc).items()}
            finally:
                stop(proc)
            m = BenchRun.measure(SERVERS[server], {}, capture).metrics
            total = sum(t for t in spent.values() if t > 0)
            engine = spent.get("engine", 0.0)
            print(f"{SERVERS[server]:22s} {m.output_throughput:9.1f} {m.ttft_ms.p50:8.0f}ms {m.ttft_ms.p99:8.0f}ms "
                  f"{m.tbt_ms.p50:7.1f}ms {m.tbt_ms.p99:7.1f}ms {total:9.1f} {total - engine:24.1f}", flush=True)


if __name__ == "__main__":
    main()
