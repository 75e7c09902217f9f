"""Soak with chaos: thousands of short requests at about twice the server's capacity, with
clients that disconnect mid-stream and invalid requests mixed in. Then the must-conditions:
no 5xx, no request lost, KV blocks back to idle, resident memory grown < 5%.

    .venv/bin/python benchmarks/soak.py                     # spawns `inflight serve`, ~2-3 min on 2 cores
    .venv/bin/python benchmarks/soak.py --requests 300      # a smoke run
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 12345 --rate 20

Phases: start the server (unless --url), warm up and measure capacity (completed requests/s
with a closed loop as wide as the batch), then send --requests at --overload x capacity with
Poisson arrivals, wait for the server to idle, and check. Exits 1 if a must-condition fails.
See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from httpx_sse import EventSource
from prometheus_client.parser import text_string_to_metric_families
from serving import start_serve, stop

KINDS = ("complete", "stream", "chat", "disconnect", "invalid")
ADMITTED_OUTCOMES = ("success", "error", "aborted", "shutdown")  # the server's count of admitted requests
WORDS = ("river stone lantern quiet engine market winter paper garden signal orbit copper meadow "
         "harbor thunder violet ladder cinder maple echo").split()


@dataclass(slots=True)
class Outcome:
    kind: str
    result: str  # completed | rejected | aborted | refused | failed | lost
    status: int | None = None
    ttft_s: float | None = None
    detail: str = ""


# --- the server --------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    return start_serve(["--max-batch-size", str(args.max_batch_size),
                        "--max-waiting-requests", str(args.max_waiting_requests),
                        "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
                        "--max-body-bytes", str(args.max_body_bytes), "--log-level", "warning"],
                       log_path, timeout_s=180)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def scrape(url: str) -> dict[tuple[str, str], float]:
    """Samples by (name, the value of its one label or ""), from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name.removeprefix("inflight:"), next(iter(s.labels.values()), "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def wait_idle(url: str, timeout_s: float) -> dict[tuple[str, str], float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        if m[("num_requests_running", "")] == 0 and m[("num_requests_waiting", "")] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# --- requests ----------------------------------------------------------------------------------


def make_body(kind: str, model: str, rng: np.random.Generator, args: argparse.Namespace) -> dict[str, Any] | bytes:
    prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))
    body: dict[str, Any] = {"model": model, "max_tokens": int(rng.integers(args.min_tokens, args.max_tokens + 1)),
                            "ignore_eos": True, "temperature": float(rng.choice([0.0, 0.8]))}
    if kind == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}], "stream": bool(rng.integers(2)),
                "stream_options": {"include_usage": True}}
    if kind != "invalid":
        return {**body, "prompt": prompt, "stream": kind in ("stream", "disconnect"),
                "stream_options": {"include_usage": True}}
    bad: list[dict[str, Any] | bytes] = [
        b'{"model": "' + model.encode() + b'", "prompt": ',  # malformed JSON
        {**body, "model": "no-such-model", "prompt": prompt},  # 404
        {**body, "prompt": prompt, "max_tokens": 0},
        {**body, "prompt": prompt, "temperature": -1},
        {**body, "prompt": [1] * (args.max_model_len + 1)},  # longer than the context
        {**body, "prompt": "x" * (args.max_body_bytes + 1)},  # 413
        {**body, "prompt": prompt, "max_tokens": "many"},
    ]
    return bad[int(rng.integers(len(bad)))]


def path_of(body: dict[str, Any] | bytes) -> str:
    return "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"


async def send(client: httpx.AsyncClient, kind: str, body: dict[str, Any] | bytes,
               disconnect_after: int) -> Outcome:
    start = time.perf_counter()
    kwargs: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    try:
        async with client.stream("POST", path_of(body), **kwargs) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _refusal(kind, resp.status_code, resp.text)
            if kind == "invalid":
                return Outcome(kind, "failed", 200, detail="an invalid request was accepted")
            if not (isinstance(body, dict) and body.get("stream")):
                data = json.loads(await resp.aread())
                ok = "usage" in data and data["usage"]["completion_tokens"] == body["max_tokens"]
                return Outcome(kind, "completed" if ok else "failed", 200, detail="" if ok else str(data)[:200])
            return await _read_stream(resp, kind, start, disconnect_after, body["max_tokens"])
    except httpx.TimeoutException:
        return Outcome(kind, "lost", detail="no answer within the request timeout")
    except httpx.TransportError as exc:
        return Outcome(kind, "failed", detail=f"{type(exc).__name__}: {exc}")


def _refusal(kind: str, status: int, text: str) -> Outcome:
    if status == 429:
        return Outcome(kind, "rejected", status)
    if kind == "invalid" and status in (400, 404, 413):
        return Outcome(kind, "refused", status)
    return Outcome(kind, "failed", status, detail=text[:200])


async def _read_stream(resp: httpx.Response, kind: str, start: float, disconnect_after: int,
                       max_tokens: int) -> Outcome:
    ttft, chunks, done, usage = None, 0, False, None
    async for sse in EventSource(resp).aiter_sse():
        data = sse.data
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            return Outcome(kind, "failed", 200, ttft, detail=event["error"]["message"][:200])
        usage = event.get("usage") or usage
        if any(c.get("text") or c.get("delta", {}).get("content") for c in event.get("choices", [])):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            chunks += 1
            if kind == "disconnect" and chunks >= disconnect_after:
                return Outcome(kind, "aborted", 200, ttft)  # leaving the block closes the connection
    if done and usage is not None and usage["completion_tokens"] == max_tokens:
        return Outcome(kind, "completed", 200, ttft)
    return Outcome(kind, "lost", 200, ttft, detail=f"stream ended: done={done} usage={usage}")


# --- phases ------------------------------------------------------------------------------------


async def calibrate(url: str, model: str, args: argparse.Namespace, rng: np.random.Generator) -> float:
    """Completed requests per second with a closed loop as wide as the batch (also the warm-up)."""
    deadline = time.perf_counter() + args.calibration_s
    completed = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal completed
        while time.perf_counter() < deadline:
            outcome = await send(client, "complete", make_body("complete", model, rng, args), 0)
            if outcome.result != "completed":
                sys.exit(f"calibration request failed: {outcome}")
            completed += 1

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.max_batch_size)))
    return completed / (time.perf_counter() - start)


async def soak(url: str, model: str, rate: float, args: argparse.Namespace,
               rng: np.random.Generator) -> tuple[list[Outcome], float]:
    """Sends --requests at `rate` per second (Poisson); returns the outcomes and the send time."""
    shares = [args.complete_share, args.stream_share, args.chat_share, args.disconnect_share, args.invalid_share]
    kinds = rng.choice(KINDS, size=args.requests, p=np.array(shares) / sum(shares))
    arrivals = np.cumsum(rng.exponential(1 / rate, size=args.requests))
    limits = httpx.Limits(max_connections=args.max_in_flight, max_keepalive_connections=args.max_in_flight)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for kind, at in zip(kinds, arrivals, strict=True):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = make_body(str(kind), model, rng, args)
            tasks.append(asyncio.create_task(send(client, str(kind), body, int(rng.integers(1, 4)))))
        send_s = time.perf_counter() - start
        outcomes = await asyncio.gather(*tasks)
    return list(outcomes), send_s


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def moved(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], name: str,
          label: str = "") -> float:
    return after.get((name, label), 0.0) - before.get((name, label), 0.0)


def summarize(outcomes: list[Outcome], before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
              rss_start: int | None, rss_end: int | None) -> dict[str, Any]:
    count = {r: sum(o.result == r for o in outcomes) for r in ("completed", "rejected", "aborted", "refused",
                                                                "failed", "lost")}
    # Every request the server admitted ends in exactly one of its outcome counters; every one
    # the client saw admitted got a 200 (or a 5xx, which the server counts as an error).
    answered = sum(o.status is not None and (o.status == 200 or o.status >= 500) for o in outcomes)
    server_ended = sum(moved(before, after, "request_success_total", r) for r in ("stop", "length")) + \
        sum(moved(before, after, "request_failure_total", r) for r in ("error", "aborted", "shutdown"))
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.result in ("completed", "aborted")]
    growth = None if rss_start is None or rss_end is None else 100 * (rss_end - rss_start) / rss_start
    return {
        "sent": len(outcomes), **count,
        "5xx": sum(o.status is not None and o.status >= 500 for o in outcomes),
        "unaccounted": answered - int(server_ended),
        "kv_blocks_idle": before[("kv_cache_blocks_used", "")], "kv_blocks_end": after[("kv_cache_blocks_used", "")],
        "rss_start_mib": None if rss_start is None else round(rss_start / 2**20, 1),
        "rss_end_mib": None if rss_end is None else round(rss_end / 2**20, 1),
        "rss_growth_pct": None if growth is None else round(growth, 2),
        "ttft_p50_ms": percentile_ms(ttfts, 50), "ttft_p99_ms": percentile_ms(ttfts, 99),
        "oom": moved(before, after, "num_oom_errors_total"),
        "failed_steps": moved(before, after, "num_failed_steps_total"),
        "preemptions": moved(before, after, "num_preemptions_total"),
    }


def must_conditions(s: dict[str, Any], expected_sent: int) -> dict[str, bool]:
    return {
        f"all {expected_sent} requests sent": s["sent"] == expected_sent,
        "no 5xx": s["5xx"] == 0,
        "no request failed": s["failed"] == 0,
        "no request lost (client: no answer or a cut stream; server: unaccounted)":
            s["lost"] == 0 and s["unaccounted"] == 0,
        "KV blocks back to idle": s["kv_blocks_end"] == s["kv_blocks_idle"],
        "RSS growth < 5%": s["rss_growth_pct"] is None or s["rss_growth_pct"] < 5,
        "some overload was refused with 429": s["rejected"] > 0,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: spawn `inflight serve` on a free loopback port)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, help="arrivals per second (default: --overload x the measured capacity)")
    p.add_argument("--overload", type=float, default=2.0, help="rate as a multiple of the measured capacity")
    p.add_argument("--calibration-s", type=float, default=20.0, help="length of the warm-up/capacity phase")
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    for kind, share in zip(KINDS, (0.3, 0.3, 0.15, 0.15, 0.1), strict=True):
        p.add_argument(f"--{kind}-share", type=float, default=share, help=f"share of {kind} requests")
    p.add_argument("--max-batch-size", type=int, default=32, help="spawned server's; also the calibration width")
    p.add_argument("--max-waiting-requests", type=int, default=32, help="spawned server's: beyond it, 429")
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024)
    p.add_argument("--max-in-flight", type=int, default=256, help="client-side cap on open connections")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request unanswered for this long is lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "soak.json")
    return p.parse_args(argv)


def print_report(figures: dict[str, Any], checks: dict[str, bool], rate: float, capacity: float | None,
                 send_s: float) -> None:
    print(f"\ncapacity {capacity and round(capacity, 2)} req/s, offered {rate:.2f} req/s, "
          f"sent in {send_s:.0f} s")
    for key, value in figures.items():
        print(f"  {key:<16} {value}")
    for name, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    proc, log_path = None, Path(tempfile.mkdtemp(prefix="inflight-soak-")) / "serve.log"
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = start_server(args, log_path)
        pid = proc.pid
        print(f"server pid {pid} on {url}, log {log_path}")
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        capacity = asyncio.run(calibrate(url, model, args, rng)) if args.rate is None else None
        rate = args.rate or args.overload * capacity  # type: ignore[operator]
        before = wait_idle(url, 60)
        rss_start = rss_bytes(pid)
        print(f"capacity {capacity} req/s; soaking {args.requests} requests at {rate:.2f} req/s")
        outcomes, send_s = asyncio.run(soak(url, model, rate, args, rng))
        after = wait_idle(url, 60)
        rss_end = rss_bytes(pid)
        figures = summarize(outcomes, before, after, rss_start, rss_end)
        after_ok = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "One more:", "max_tokens": 4, "ignore_eos": True}).status_code == 200
        checks = must_conditions(figures, args.requests)
        checks["healthy afterwards (/health 200, a request completes)"] = \
            after_ok and httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        if proc is not None:
            stop(proc, 60)
    if proc is not None:
        checks["server exited 0 on SIGTERM, no traceback in its log"] = \
            proc.returncode == 0 and "Traceback" not in log_path.read_text()
    print_report(figures, checks, rate, capacity, send_s)
    failures = [o for o in outcomes if o.result in ("failed", "lost")][:10]
    for o in failures:
        print(f"  {o.result}: {o.kind} status={o.status} {o.detail}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {"command": " ".join(sys.argv), "config": config, "capacity_rps": capacity, "rate_rps": rate,
              "send_s": send_s, "figures": figures, "checks": checks,
              "by_kind": {k: {r: sum(o.kind == k and o.result == r for o in outcomes)
                              for r in ("completed", "rejected", "aborted", "refused", "failed", "lost")}
                          for k in KINDS},
              "failures": [asdict(o) for o in failures]}
    args.output.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.output}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
