"""`inflight serve` as a real process under load: SIGTERM with two dozen streams open. New
requests get 503 while the running ones drain; streams that can finish within the shutdown
timeout do, the others end with a clean error event at the timeout; the process exits 0 and
then refuses connections."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

NUM_STREAMS = 24
SHORT_MAX_TOKENS = 8  # half the streams: done well within the drain, even on a loaded machine
LONG_MAX_TOKENS = 1000  # the other half: 1,000 steps take far longer than the drain on a CPU
SHUTDOWN_TIMEOUT_S = 6
FLUSH_S = 5  # uvicorn's own wait for responses still being written, after the drain


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited during startup"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy in time")


def test_sigterm_under_load_drains_and_exits_zero(tmp_path: Path) -> None:
    """Also: the single process never imports Ray (a `ray` that cannot be imported comes first
    on its path)."""
    poison = tmp_path / "poison" / "ray"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('the single-process server imported ray')\n")
    path = os.pathsep.join(p for p in (str(poison.parent), os.environ.get("PYTHONPATH", "")) if p)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inflight.cli", "serve", "--port", str(port), "--num-kv-blocks", "256",
         "--max-model-len", "1024", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path},
    )
    try:
        _wait_healthy(url, proc, timeout_s=90)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        events: list[list[dict[str, Any]]] = [[] for _ in range(NUM_STREAMS)]
        ended_at = [float("inf")] * NUM_STREAMS
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        max_tokens = [SHORT_MAX_TOKENS if i % 2 == 0 else LONG_MAX_TOKENS for i in range(NUM_STREAMS)]

        def stream(i: int) -> None:
            body = {"model": model, "prompt": f"Story number {i}:", "max_tokens": max_tokens[i],
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        started[i].set()
                        data = line.removeprefix("data: ")
                        events[i].append({"done": True} if data == "[DONE]" else json.loads(data))
            ended_at[i] = time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)

        # While draining, the server still answers, but refuses new work.
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=2).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        assert all(threads[i].is_alive() for i in range(1, NUM_STREAMS, 2)), "long streams ended before the drain"

        for t in threads:
            t.join(SHUTDOWN_TIMEOUT_S + FLUSH_S + 30)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - sigterm_at < SHUTDOWN_TIMEOUT_S + FLUSH_S + 10
        for i, stream_events in enumerate(events):
            assert stream_events[-1] == {"done": True}, f"stream {i} did not end cleanly"
            assert ended_at[i] - sigterm_at < SHUTDOWN_TIMEOUT_S + FLUSH_S
            if max_tokens[i] == SHORT_MAX_TOKENS:  # finished in full during the drain
                assert stream_events[-2]["usage"]["completion_tokens"] == SHORT_MAX_TOKENS
                assert not any("error" in e for e in stream_events)
            else:  # ended by the shutdown timeout, with an error event the client can read
                error = stream_events[-2]["error"]
                assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
                assert ended_at[i] - sigterm_at >= SHUTDOWN_TIMEOUT_S - 1
        # Closed: connections are refused, not left hanging.
        try:
            httpx.get(url + "/health", timeout=5)
            raise AssertionError("the server still answers after it exited")
        except httpx.ConnectError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    output = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in output, output
