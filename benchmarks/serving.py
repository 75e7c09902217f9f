"""`inflight serve` as a benchmark's subprocess: started on a free loopback port, waited for
until it is ready, and stopped by SIGTERM (its drain), as a user would run it. Shared by the
benchmarks that measure a server from outside (fleet_*.py, soak.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from inflight.bench.server_metrics import parse_prometheus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    return httpx.get(url + "/health", timeout=2).status_code == 200


def replicas_reporting(n: int) -> Callable[[str], bool]:
    """Ready once `n` engine replicas report to the fleet's `/metrics`."""

    def ready(url: str) -> bool:
        text = httpx.get(url + "/metrics", timeout=2).text
        return parse_prometheus(text).get("inflight:fleet_replicas_reporting", 0) >= n

    return ready


def start_serve(args: list[str], log: Path, ready: Callable[[str], bool] = healthy, timeout_s: float = 300,
                port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Runs `inflight serve ARGS --port P` (P free unless given), its output to `log`; returns
    the process and its URL once `ready(url)`. Exits the benchmark with one line if it does not
    come up."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "inflight.cli", "serve", *args, "--port", str(port)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited during startup; see {log}")
        try:
            if ready(url):
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"the server did not come up in {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; returns its exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
