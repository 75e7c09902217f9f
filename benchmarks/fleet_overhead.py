"""What the fleet's layers cost: one engine served by the plain process (`inflight serve`)
against the same engine as the only replica of a fleet (`--replicas 1 --min-replicas 1
--max-replicas 1`: Ray Serve's proxy, the ingress, the router and a deployment handle in
between, every streamed chunk crossing Ray), with the same workload sent through HTTP by
`inflight bench`'s client. Both get all the machine's cores for torch; alternated.

    .venv/bin/python benchmarks/fleet_overhead.py                     # burst workload, 2 rounds, ~8 min
    .venv/bin/python benchmarks/fleet_overhead.py --workload mixed --rounds 1
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from inflight.bench.client import run_http
from inflight.bench.corpus import Corpus
from inflight.bench.results import BenchRun
from inflight.bench.workload import generate_requests, load_workload
from inflight.model.loader import resolve_model
from inflight.model.tokenizer import Tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(fleet: bool, num_kv_blocks: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "inflight.cli", "serve", "--port", str(port), "--num-kv-blocks", str(num_kv_blocks),
           "--log-level", "warning"]
    if fleet:
        cmd += ["--replicas", "1", "--min-replicas", "1", "--max-replicas", "1",
                "--replica-cpus", str(os.cpu_count() or 1)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited during startup; see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not come up; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="burst")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    args = parser.parse_args()
    spec, path = load_workload(args.workload)
    requests = generate_requests(spec, Corpus(Tokenizer.load(resolve_model(None))), path.parent)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    print(f"{spec.name}: {len(requests)} requests over HTTP; {os.cpu_count()} CPUs")
    print(f"{'server':14s} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TBT p50':>8} {'TBT p99':>8}")
    for _ in range(args.rounds):
        for fleet in (False, True):
            name = "fleet of 1" if fleet else "one process"
            proc, url = _serve(fleet, args.num_kv_blocks, logs / f"overhead-{'fleet' if fleet else 'one'}.log")
            try:
                capture, _ = run_http(url, requests, progress=False)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            m = BenchRun.measure(name, {}, capture).metrics
            print(f"{name:14s} {m.output_throughput:9.1f} {m.ttft_ms.p50:8.0f}ms {m.ttft_ms.p99:8.0f}ms "
                  f"{m.tbt_ms.p50:7.1f}ms {m.tbt_ms.p99:7.1f}ms", flush=True)


if __name__ == "__main__":
    main()
