"""The HTTP target: streams `/v1/completions` (or `/v1/chat/completions`, for a dataset's chat
records) from an OpenAI-compatible server, sending each request at its arrival time, and
samples the server's Prometheus `/metrics` meanwhile.

Tokens are timed by stream chunks (each chunk that carries a choice is at least one token);
the final usage chunk (`stream_options.include_usage`) gives the exact output count, and the
prompt's as the server counted it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse
from tqdm import tqdm

from inflight.bench.metrics import EngineCounters, KvSample, RequestResult
from inflight.bench.results import Capture
from inflight.bench.server_metrics import (
    DIALECTS,
    SLOTS_PATH,
    Dialect,
    ExpositionError,
    Reading,
    kv_usage_from_slots,
    parse_exposition,
    recognize,
)
from inflight.bench.workload import BenchRequest
from inflight.errors import InflightError


class ServerError(InflightError):
    """The server could not be reached or does not speak the expected API."""


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
    """Polls /metrics every `interval_s`; reads each scrape through the engine's dialect (named,
    or recognized from the first scrape), keeps a KvSample per scrape and the first and last
    readings for the counters, and times itself (the scrape and the parsing, client-side)."""

    client: httpx.AsyncClient
    t0: float
    interval_s: float
    dialect: Dialect | None = None
    samples: list[KvSample] = field(default_factory=list)
    first: Reading | None = None
    last: Reading | None = None
    exposed: set[str] = field(default_factory=set)
    available: bool = True
    problem: str | None = None
    costs_s: list[float] = field(default_factory=list)  # each scrape's wall time: the server's answer and ours
    cpu_s: list[float] = field(default_factory=list)  # the client CPU of parsing and reading each
    bytes_read: int = 0
    slots_usable: bool = True
    kv_usage_from: str | None = None  # where the KV usage came from, when not /metrics

    async def scrape(self) -> None:
        started = time.perf_counter()
        try:
            response = await self.client.get("/metrics")
            response.raise_for_status()
            parsing = time.thread_time()  # the client's CPU from here on: parsing and reading
            # Once the engine is known, only the families its dialect reads are parsed.
            series = parse_exposition(response.text, self.dialect.sample_names() if self.dialect else None)
        except (httpx.HTTPError, ExpositionError) as exc:
            self.available, self.problem = False, f"/metrics: {exc}"
            return
        self.bytes_read += len(response.content)
        self.dialect = self.dialect or recognize(series)
        if self.dialect is None:  # an engine's names may appear only once it has served a request
            self.problem = "/metrics has none of the names of a known engine (name it: --server-kind)"
            return
        self.problem = None
        reading = self.dialect.read(series)
        self.exposed.update(reading.exposed)
        self.cpu_s.append(time.thread_time() - parsing)
        if reading.kv_usage is None and self.dialect.kind == "llama.cpp" and self.slots_usable:
            reading = dataclasses.replace(reading, kv_usage=await self._kv_usage_from_slots())
        self.first = self.first or reading
        self.last = reading
        if reading.kv_usage is not None:
            live = reading.kv_live
            self.samples.append(KvSample(time.perf_counter() - self.t0, 100.0 * reading.kv_usage,
                                         int(reading.running or 0), int(reading.waiting or 0),
                                         100.0 * live if live is not None and reading.kv_usage > 0 else None))
        self.costs_s.append(time.perf_counter() - started)

    async def _kv_usage_from_slots(self) -> float | None:
        """llama-server without KV metrics: the usage its /slots shows (`kv_usage_from_slots`)."""
        try:
            response = await self.client.get(SLOTS_PATH)
            response.raise_for_status()
            usage = kv_usage_from_slots(response.json())
        except (httpx.HTTPError, ValueError):
            usage = None
        if usage is None:
            self.slots_usable = False
            return None
        self.bytes_read += len(response.content)
        self.exposed.add("kv_usage")
        self.kv_usage_from = f"{SLOTS_PATH}: tokens held / context, over the slots"
        return usage

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.available:
            await self.scrape()
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    def counters(self) -> EngineCounters:
        if self.first is None or self.last is None:
            return EngineCounters()
        first, last = self.first.counters, self.last.counters

        def rise(name: str) -> int | None:
            return int(last[name] - first.get(name, 0.0)) if name in last else None

        # A server's peak gauge covers its whole life; it speaks for this run only if it rose.
        peak = None
        if self.last.kv_peak is not None and self.last.kv_peak > (self.first.kv_peak or 0.0):
            peak = 100.0 * self.last.kv_peak
        return EngineCounters(kv_peak_perc=peak, num_preemptions=rise("preemptions"),
                              num_oom_errors=rise("oom_errors"),
                              num_kv_allocation_failures=rise("kv_allocation_failures"),
                              num_server_failed_requests=rise("failed_requests"),
                              spec_num_drafts=rise("spec_drafts"), spec_num_draft_tokens=rise("spec_draft_tokens"),
                              spec_num_accepted_tokens=rise("spec_accepted_tokens"),
                              spec_num_lookups=rise("spec_lookups"), spec_num_found=rise("spec_found"))

    def describe(self, duration_s: float) -> dict[str, Any]:
        """What the sampling read and what it cost: scrapes, their mean and max wall time (the
        server's answer included: waited for, not spent, by the client, which goes on streaming),
        and the client's CPU for parsing and reading them, also as a share of the run."""
        costs = self.costs_s
        return {
            "server_kind": self.dialect.kind if self.dialect else None,
            "names_from": self.dialect.source if self.dialect else None,
            "exposed": sorted(self.exposed),
            "kv_usage_from": self.kv_usage_from or ("/metrics" if "kv_usage" in self.exposed else None),
            "problem": self.problem,
            "interval_s": self.interval_s,
            "scrapes": len(costs),
            "scrape_mean_ms": round(1000 * sum(costs) / len(costs), 3) if costs else None,
            "scrape_max_ms": round(1000 * max(costs), 3) if costs else None,
            "parse_cpu_mean_ms": round(1000 * sum(self.cpu_s) / len(self.cpu_s), 3) if self.cpu_s else None,
            "cpu_share": round(sum(self.cpu_s) / max(duration_s, 1e-9), 5),
            "bytes_per_scrape": self.bytes_read // len(costs) if costs else None,
        }


async def _stream_one(client: httpx.AsyncClient, model: str, request: BenchRequest, t0: float,
                      slots: asyncio.Semaphore | None, bar: tqdm) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
    if slots is not None:
        await slots.acquire()
    body: dict[str, Any] = {
        "model": model, "max_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    # A dataset's prompt goes as text (chat messages or a string) for the server to tokenize;
    # a generated one as the token ids it was cut to.
    endpoint = "/v1/chat/completions" if request.messages is not None else "/v1/completions"
    if request.messages is not None:
        body["messages"] = list(request.messages)
    else:
        body["prompt"] = request.prompt if request.send_text else request.prompt_token_ids
    if request.priority:  # vLLM's field too; sent only where the workload has classes
        body["priority"] = request.priority
    sent = time.perf_counter()
    token_times: list[float] = []
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    status: int | None = None
    try:
        async with aconnect_sse(client, "POST", endpoint, json=body) as source:
            status = source.response.status_code
            if status != 200:
                text = (await source.response.aread()).decode(errors="replace")
                error = f"HTTP {status}: {text[:300]}"
            else:
                async for event in source.aiter_sse():
                    if event.data == "[DONE]":
                        break
                    chunk = json.loads(event.data)
                    if "error" in chunk:
                        err = chunk["error"]
                        error = str(err.get("message", err) if isinstance(err, dict) else err)
                        break
                    if _carries_token(chunk):
                        token_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        usage_tokens = int(chunk["usage"]["completion_tokens"])
                        prompt_tokens = chunk["usage"].get("prompt_tokens")
    except (httpx.HTTPError, SSEError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if slots is not None:
            slots.release()
    finished = time.perf_counter()
    bar.update()
    num_tokens = usage_tokens if usage_tokens is not None else len(token_times)
    if error is None and not token_times:
        error = "the stream ended without a token"
    # The server's count of the prompt where it gives one: for text, its tokenizer is the one that counts.
    prompt_len = int(prompt_tokens) if isinstance(prompt_tokens, int) else request.prompt_len
    return RequestResult.from_token_times(
        request.index, prompt_len, request.output_len, sent - t0,
        [t - t0 for t in token_times], finished - t0, num_tokens, error, request.priority, status,
    )


def _carries_token(chunk: dict[str, Any]) -> bool:
    """A chunk with a choice carries a token, unless it is a bare finish marker (empty text
    with a finish_reason), which some servers send after the last token. A chat chunk carries
    one when its delta has content (or reasoning, or a tool call): the first, with the role
    alone, does not."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    or delta.get("tool_calls"))
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def run_http_async(url: str, requests: Sequence[BenchRequest], model: str | None = None,
                         max_concurrency: int | None = None, progress: bool = True,
                         metrics_interval_s: float = 0.5, timeout_s: float = 600.0, server_kind: str = "auto",
                         metrics_url: str | None = None, num_warmups: int = 0,
                         transport: httpx.AsyncBaseTransport | None = None) -> tuple[Capture, dict[str, Any]]:
    """`server_kind`: the engine whose metric names to read (`server_metrics.SERVER_KINDS`), or
    "auto" to recognize it; `metrics_url`: where its `/metrics` is served when not beside the API
    (Triton's metrics port, 8002 by default); `num_warmups`: requests sent one after another
    before the timed run and left out of it (the workload's first ones, at most 8 output tokens:
    a server's first requests carry one-time costs); `transport` replaces the network (tests use
    httpx.MockTransport)."""
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, transport=transport))
        scraped = client if not metrics_url else await stack.enter_async_context(
            httpx.AsyncClient(base_url=metrics_url, timeout=httpx.Timeout(30.0, connect=10.0), transport=transport))
        model = model or await resolve_model_name(client)
        warmups = [await _stream_one(client, model, dataclasses.replace(r, output_len=min(r.output_len, 8),
                                                                        arrival_s=0.0), time.perf_counter(),
                                     None, tqdm(disable=True))
                   for r in list(requests)[:num_warmups]]
        dialect = None if server_kind == "auto" else DIALECTS[server_kind]
        sampler = _MetricsSampler(scraped, time.perf_counter(), metrics_interval_s, dialect)
        await sampler.scrape()  # the counters' starting values
        sampler.samples.clear()
        sampler.costs_s.clear()
        sampler.cpu_s.clear()
        sampler.bytes_read = 0
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
    info = {"url": url, "metrics_url": metrics_url or url, "served_model_name": model,
            "warmups": {"requests": len(warmups), "failed": sum(not w.ok for w in warmups)},
            "metrics_available": sampler.first is not None,
            "metrics": sampler.describe(duration)}
    results = sorted(results, key=lambda r: r.index)
    return Capture(results, duration, sampler.samples, sampler.counters()), info


def run_http(url: str, requests: Sequence[BenchRequest], **kwargs: Any) -> tuple[Capture, dict[str, Any]]:
    """Runs the workload against a server; returns the capture and what is known of the server."""
    return asyncio.run(run_http_async(url, requests, **kwargs))
