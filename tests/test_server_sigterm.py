"""`inflight serve` as a real process: SIGTERM lets open streams finish, then exits 0."""

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

import httpx

NUM_STREAMS = 3
MAX_TOKENS = 48  # long enough that SIGTERM lands while all streams run


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


def test_sigterm_lets_streams_finish_and_exits_zero(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inflight.cli", "serve", "--port", str(port), "--num-kv-blocks", "256",
         "--max-model-len", "512", "--shutdown-timeout", "30", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        _wait_healthy(url, proc, timeout_s=90)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        events: list[list[dict[str, object]]] = [[] for _ in range(NUM_STREAMS)]
        started = [threading.Event() for _ in range(NUM_STREAMS)]

        def stream(i: int) -> None:
            body = {"model": model, "prompt": f"Story number {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        started[i].set()
                        data = line.removeprefix("data: ")
                        events[i].append({"done": True} if data == "[DONE]" else json.loads(data))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        proc.send_signal(signal.SIGTERM)

        # While draining, the server still answers, but refuses new work.
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=2).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["message"]
        assert all(t.is_alive() for t in threads), "the streams ended before the drain could be seen"

        for t in threads:
            t.join(60)
        assert proc.wait(timeout=60) == 0
        for stream_events in events:
            assert stream_events[-1] == {"done": True}
            assert stream_events[-2]["usage"]["completion_tokens"] == MAX_TOKENS  # type: ignore[index]
            assert not any("error" in e for e in stream_events)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    output = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in output, output
