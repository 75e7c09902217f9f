"""Routers compared on a real fleet: `inflight serve --replicas N` started once per router, the
same workload sent to each through HTTP (`inflight bench`'s client), in one invocation.

The workload (`multi-prefix` by default) has several distinct long system prompts whose KV
together outgrows one replica's pool: a router that sends each prompt where it is cached keeps
hitting the prefix cache, one blind to the cache recomputes them. Printed per router: the
prefix-cache hit rate (prompt tokens found cached, from the replicas' own counters), TTFT p50 and
p99, output throughput, and how the requests split over the replicas.

    .venv/bin/python benchmarks/fleet_routing.py                          # 2 replicas, 4 routers, ~8 min
    .venv/bin/python benchmarks/fleet_routing.py --routers prefix,ray --repeats 2 --num-kv-blocks 160

`--repeats` alternates the routers (prefix, ray, prefix, ray, ...), as a noisy machine needs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from serving import replicas_reporting, start_serve, stop

from inflight.bench.client import run_http
from inflight.bench.corpus import Corpus
from inflight.bench.results import BenchRun
from inflight.bench.server_metrics import parse_prometheus
from inflight.bench.workload import generate_requests, load_workload, with_request_rate
from inflight.model.loader import resolve_model
from inflight.model.tokenizer import Tokenizer

HITS, QUERIES = "inflight:prefix_cache_hits_total", "inflight:prefix_cache_queries_total"


def _start(router: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    serve_args = ["--replicas", str(args.replicas), "--router", router, "--num-kv-blocks", str(args.num_kv_blocks),
                  "--log-level", "warning"]
    if args.replica_cpus:
        serve_args += ["--replica-cpus", str(args.replica_cpus)]
    return start_serve(serve_args, log, ready=replicas_reporting(args.replicas))


def _one(router: str, requests: list[Any], args: argparse.Namespace, log: Path) -> dict[str, Any]:
    proc, url = _start(router, args, log)
    try:
        before = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
        capture, _ = run_http(url, requests, progress=False)
        time.sleep(2.5)  # the replicas' last counters reach the board
        text = httpx.get(url + "/metrics", timeout=10).text  # also: how requests split over the replicas
        after = parse_prometheus(text)
    finally:
        stop(proc)
    run = BenchRun.measure(router, {}, capture)
    split = Counter[str]()
    for line in text.splitlines():
        if line.startswith("inflight:request_success_total{") and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            split[replica] += int(float(line.rsplit(" ", 1)[1]))
    queries = after.get(QUERIES, 0.0) - before.get(QUERIES, 0.0)
    hits = after.get(HITS, 0.0) - before.get(HITS, 0.0)
    m = run.metrics
    return {"router": router, "hit_rate": hits / queries if queries else 0.0, "prompt_tokens": queries,
            "ttft_p50_ms": m.ttft_ms.p50, "ttft_p99_ms": m.ttft_ms.p99, "output_tok_s": m.output_throughput,
            "duration_s": capture.duration_s, "failed": m.num_failed, "split": sorted(split.values(), reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", default="prefix,pow2,round-robin,ray")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=int, default=None)
    parser.add_argument("--workload", default="multi-prefix")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="override the workload's Poisson rate")
    parser.add_argument("--num-kv-blocks", type=int, default=160,
                        help="each replica's KV pool (default 160 blocks of 16: about 4 of the 8 prompts)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default=None, help="write the rows (JSON) here")
    args = parser.parse_args()
    spec, _ = load_workload(args.workload)
    if args.num_requests is not None:
        spec = spec.model_copy(update={"num_requests": args.num_requests})
    if args.rate is not None:
        spec = with_request_rate(spec, args.rate)
    requests = generate_requests(spec, Corpus(Tokenizer.load(resolve_model(None))))
    routers = args.routers.split(",")
    print(f"{spec.name}: {len(requests)} requests; {args.replicas} replicas of {args.num_kv_blocks} KV blocks; "
          f"{os.cpu_count()} CPUs")
    print(f"{'router':12s} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>9} {'failed':>6}  split")
    rows = []
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    for rep in range(args.repeats):
        for router in routers:
            row = _one(router, requests, args, logs / f"fleet-{router}-{rep}.log")
            rows.append(row)
            print(f"{router:12s} {row['hit_rate']:8.1%} {row['ttft_p50_ms']:8.0f}ms {row['ttft_p99_ms']:8.0f}ms "
                  f"{row['output_tok_s']:9.1f} {row['failed']:6d}  {'/'.join(map(str, row['split']))}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"workload": spec.name, "replicas": args.replicas,
                                                 "num_kv_blocks": args.num_kv_blocks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
