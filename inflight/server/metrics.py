"""Prometheus metrics, named after vLLM's with the prefix `inflight:`.

Each app owns a private `CollectorRegistry`, so several servers can live in one process
(tests). Engine gauges and counters are read at scrape time from the snapshot the engine loop
publishes; per-token and per-request latencies are observed by a step observer, which runs in
the loop thread (prometheus_client's metrics are thread-safe); request outcomes are counted
by the HTTP handlers, which alone know how each request ended for its client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inflight.engine.output import RequestOutput, StepRecord
from inflight.engine.stats import METRIC_PREFIX, METRICS, SPEC_PER_POSITION, EngineStats
from inflight.request import FinishReason, Request

logger = logging.getLogger(__name__)

PREFIX = METRIC_PREFIX

# Buckets as vLLM's, so dashboards built for it read these the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# request_failure_total reasons, by the HTTP status a request was refused with.
_FAILURE_REASONS = {400: "invalid", 404: "invalid", 405: "invalid", 413: "invalid",
                    401: "unauthorized", 429: "overloaded", 503: "unavailable"}


class _EngineCollector:
    """Engine gauges and counters, read from the loop thread's last published snapshot."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for m in METRICS.values():
            family = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
            yield family(PREFIX + m.name, m.doc, value=m.value(s))
        if s.spec_accepted_per_position:
            per_position = CounterMetricFamily(PREFIX + SPEC_PER_POSITION, "Speculative decoding: proposed tokens "
                                               "kept, by position in the draft (0: first).", labels=["position"])
            for position, count in enumerate(s.spec_accepted_per_position):
                per_position.add_metric([str(position)], count)
            yield per_position


class ServerMetrics:
    """The server's Prometheus series. With a TTFT or TPOT target (`--ttft-slo-ms`,
    `--tbt-slo-ms`), finished requests are also counted against them: their rate is the goodput
    the server sees."""

    def __init__(self, stats: Callable[[], EngineStats], ttft_target_s: float | None = None,
                 tpot_target_s: float | None = None, cache_info: dict[str, str] | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        self.ttft_target_s, self.tpot_target_s = ttft_target_s, tpot_target_s
        self.slo_good: Counter | None = None
        if ttft_target_s is not None or tpot_target_s is not None:
            self.slo_good = Counter(
                PREFIX + "requests_meeting_slo",
                "Finished requests that met the TTFT target and the TPOT target (those set): their rate is goodput.",
                registry=registry)
        registry.register(_EngineCollector(stats))
        if cache_info:  # vLLM's info series: its labels are the KV pool's configuration, its value 1
            Gauge(PREFIX + "cache_config_info", "The KV cache's configuration, in the labels.", sorted(cache_info),
                  registry=registry).labels(**cache_info).set(1)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.", registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=registry)
        self.request_success = Counter(PREFIX + "request_success", "Requests that finished, by finish reason.",
                                       ["finished_reason"], registry=registry)
        self.request_failure = Counter(
            PREFIX + "request_failure",
            "Requests that did not finish: error, aborted (client left), shutdown, invalid, "
            "unauthorized, overloaded (429), unavailable (503).",
            ["reason"], registry=registry)
        for reason in ("error", "aborted", "shutdown", *sorted(set(_FAILURE_REASONS.values()))):
            self.request_failure.labels(reason)  # every series from the start, at 0 (a gate reads "error")
        self.rejected_late = Counter(
            PREFIX + "requests_rejected_late",
            "Requests refused on arrival (429) because they would miss the TTFT target (slo policy, --reject-late).",
            registry=registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=_ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_REQUEST_BUCKETS, registry=registry)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=_REQUEST_BUCKETS, registry=registry)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens", "Tokens computed by one engine step.",
                                          buckets=_ITERATION_BUCKETS, registry=registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- outcomes, counted by the handlers ------------------------------------------------------

    def count_success(self, reason: FinishReason) -> None:
        self.request_success.labels(reason.value).inc()

    def count_rejected_late(self) -> None:
        self.rejected_late.inc()

    def count_failure(self, reason: str) -> None:
        self.request_failure.labels(reason).inc()

    def count_refused(self, status: int) -> None:
        """A request answered with an error status before it reached the engine."""
        reason = _FAILURE_REASONS.get(status)
        if reason is None and status >= 500:
            reason = "error"
        if reason is not None:
            self.count_failure(reason)

    # --- the step observer (loop thread) --------------------------------------------------------

    def observe_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        # Metrics must never fail a step: the engine would fail the step's requests.
        try:
            self._observe_step(record, outputs)
        except Exception:
            logger.exception("metrics: step observer failed")

    def _observe_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        num_tokens = record.num_prefill_tokens + record.num_decode_tokens
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        # With speculative decoding a request may have several outputs in one step, one per token.
        per_request: dict[str, int] = {}
        for out in outputs:
            if out.new_token_ids:
                per_request[out.request_id] = per_request.get(out.request_id, 0) + 1
        seen: dict[str, int] = {}
        for out in outputs:
            if not out.new_token_ids:
                continue
            request = out.request
            t = request.timings
            self.generation_tokens.inc(len(out.new_token_ids))
            # This output's token among the request's timed tokens.
            index = len(t.token_times) - per_request[out.request_id] + seen.get(out.request_id, 0)
            seen[out.request_id] = seen.get(out.request_id, 0) + 1
            if index == 0:
                self.prompt_tokens.inc(request.num_prompt_tokens)
                if t.ttft_s is not None:
                    self.ttft.observe(t.ttft_s)
                if t.queue_s is not None:
                    self.queue_time.observe(t.queue_s)
            elif index > 0:
                self.itl.observe(t.token_times[index] - t.token_times[index - 1])
            if out.finished and t.finished is not None:
                self.e2e.observe(t.finished - t.arrival)
                if self.slo_good is not None and out.error is None and self._meets_slo(request):
                    self.slo_good.inc()

    def _meets_slo(self, request: Request) -> bool:
        t = request.timings
        if t.ttft_s is None or t.finished is None or t.first_token is None:
            return False
        if self.ttft_target_s is not None and t.ttft_s > self.ttft_target_s:
            return False
        n = request.num_output_tokens
        tpot = (t.finished - t.first_token) / (n - 1) if n > 1 else 0.0
        return self.tpot_target_s is None or tpot <= self.tpot_target_s
