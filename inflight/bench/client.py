"""The HTTP target: streams `/v1/completions` from an OpenAI-compatible server, sending each
request at its arrival time, and samples the server's Prometheus `/metrics` meanwhile.

Tokens are timed by stream chunks (each chunk that carries a choice is at least one token);
the final usage chunk (`stream_options.include_usage`) gives the exact output count.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from inflight.bench.metrics import EngineCounters, KvSample, RequestResult
from inflight.bench.results import Capture
from inflight.bench.workload import BenchRequest
from inflight.engine.stats import METRICS
from inflight.errors import InflightError

KV_USAGE, KV_LIVE, KV_PEAK, PREEMPTIONS, OOM_ERRORS, KV_ALLOCATION_FAILURES, RUNNING, WAITING = (
    METRICS[name].scraped_name for name in (
        "kv_cache_usage_perc", "kv_cache_live_token_perc", "kv_cache_usage_peak_perc", "num_preemptions",
        "num_oom_errors", "num_kv_allocation_failures", "num_requests_running", "num_requests_waiting"))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(\S+)")


class ServerError(InflightError):
    """The server could not be reached or does not speak the expected API."""


# Gauges of one pool each: behind a fleet (one series per replica) the fullest pool speaks for
# the run, as the KV watermark an SLA bounds is any one pool's. Everything else is summed.
_HIGHEST = frozenset({KV_USAGE, KV_LIVE, KV_PEAK})


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name: summed over label sets (`name{labels} value`), except the
    KV pool gauges, of which the highest is kept."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, value = match.group(1), match.group(2)
        try:
            number = float(value)
        except ValueError:
            continue
        if name in _HIGHEST:
            values[name] = max(values.get(name, number), number)
        else:
            values[name] = values.get(name, 0.0) + number
    return values


async def resolve_model_name(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach the server at {client.base_url}: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError):
        raise ServerError(f"{client.base_url}/v1/models did not list a model; pass --served-model-name") from None


@dataclass(slots=True)
class _MetricsSampler:
    """Polls /metrics; keeps the first and last scrape for counters and a KvSample per scrape."""

    client: httpx.AsyncClient
    t0: float
    interval_s: float
    samples: list[KvSample] = field(default_factory=list)
    first: dict[str, float] | None = None
    last: dict[str, float] | None = None
    available: bool = True

    async def scrape(self) -> None:
        try:
            response = await self.client.get("/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            self.available = False
            return
        values = parse_prometheus(response.text)
        self.first = self.first or values
        self.last = values
        if KV_USAGE in values:
            live = values.get(KV_LIVE)
            self.samples.append(KvSample(time.perf_counter() - self.t0, 100.0 * values[KV_USAGE],
                                         int(values.get(RUNNING, 0)), int(values.get(WAITING, 0)),
                                         100.0 * live if live is not None and values[KV_USAGE] > 0 else None))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.available:
            await self.scrape()
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    def counters(self) -> EngineCounters:
        first, last = self.first or {}, self.last or {}

        def delta(name: str) -> int | None:
            return int(last[name] - first.get(name, 0.0)) if name in last else None

        # The server's peak gauge covers its whole life; it speaks for this run only if it rose.
        peak = None
        if KV_PEAK in last and last[KV_PEAK] > first.get(KV_PEAK, 0.0):
            peak = 100.0 * last[KV_PEAK]
        return EngineCounters(kv_peak_perc=peak, num_preemptions=delta(PREEMPTIONS), num_oom_errors=delta(OOM_ERRORS),
                              num_kv_allocation_failures=delta(KV_ALLOCATION_FAILURES))


async def _stream_one(client: httpx.AsyncClient, model: str, request: BenchRequest, t0: float,
                      slots: asyncio.Semaphore | None, bar: tqdm) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
    if slots is not None:
        await slots.acquire()
    body: dict[str, Any] = {
        "model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.priority:  # vLLM's field too; sent only where the workload has classes
        body["priority"] = request.priority
    sent = time.perf_counter()
    token_times: list[float] = []
    usage_tokens: int | None = None
    error: str | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        error = str(err.get("message", err) if isinstance(err, dict) else err)
                        break
                    if _carries_token(chunk):
                        token_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        usage_tokens = int(chunk["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if slots is not None:
            slots.release()
    finished = time.perf_counter()
    bar.update()
    num_tokens = usage_tokens if usage_tokens is not None else len(token_times)
    if error is None and not token_times:
        error = "the stream ended without a token"
    return RequestResult.from_token_times(
        request.index, request.prompt_len, request.output_len, sent - t0,
        [t - t0 for t in token_times], finished - t0, num_tokens, error, request.priority,
    )


def _carries_token(chunk: dict[str, Any]) -> bool:
    """A chunk with a choice carries a token, unless it is a bare finish marker (empty text
    with a finish_reason), which some servers send after the last token."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def run_http_async(url: str, requests: Sequence[BenchRequest], model: str | None = None,
                         max_concurrency: int | None = None, progress: bool = True,
                         metrics_interval_s: float = 0.25, timeout_s: float = 600.0,
                         transport: httpx.AsyncBaseTransport | None = None) -> tuple[Capture, dict[str, Any]]:
    """`transport` replaces the network (tests use httpx.MockTransport)."""
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, transport=transport) as client:
        model = model or await resolve_model_name(client)
        sampler = _MetricsSampler(client, time.perf_counter(), metrics_interval_s)
        await sampler.scrape()  # the counters' starting values
        sampler.samples.clear()
        t0 = sampler.t0 = time.perf_counter()
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop))
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        with tqdm(total=len(requests), desc="bench", unit="req", file=sys.stderr,
                  disable=not progress, leave=False) as bar:
            results = await asyncio.gather(*(_stream_one(client, model, r, t0, slots, bar) for r in requests))
        duration = time.perf_counter() - t0
        stop.set()
        await sampling
        await sampler.scrape()
    info = {"url": url, "served_model_name": model, "metrics_available": sampler.available}
    results = sorted(results, key=lambda r: r.index)
    return Capture(results, duration, sampler.samples, sampler.counters()), info


def run_http(url: str, requests: Sequence[BenchRequest], **kwargs: Any) -> tuple[Capture, dict[str, Any]]:
    """Runs the workload against a server; returns the capture and what is known of the server."""
    return asyncio.run(run_http_async(url, requests, **kwargs))
