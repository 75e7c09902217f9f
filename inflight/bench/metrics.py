"""Per-request results and the metrics of a run, as typed records. Pure arithmetic, no I/O.

Times of a request are client-side: TTFT from its arrival (when it was sent) to its first
token, TBT (inter-token latency) the gap between consecutive token arrivals, TPOT the mean
decode time per token after the first, `(e2e - ttft) / (num_output_tokens - 1)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from inflight.engine.stats import EngineStats


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are seconds from the run's start (`*_at_s`) or
    durations (`*_s`); `token_gaps_s` holds one gap per token event after the first."""

    index: int
    prompt_len: int
    output_len: int  # requested (max_tokens)
    arrival_s: float  # when it was sent
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None
    priority: int = 0  # the class it was sent with
    http_status: int | None = None  # of the response (None: no response came)

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)  # type: ignore[operator]

    @classmethod
    def from_token_times(cls, index: int, prompt_len: int, output_len: int, arrival_s: float,
                         token_times_s: Sequence[float], finished_s: float | None,
                         num_output_tokens: int | None = None, error: str | None = None,
                         priority: int = 0, http_status: int | None = None) -> RequestResult:
        """Builds the record from the times (seconds, any common origin) at which token events
        arrived; `num_output_tokens` defaults to one token per event."""
        times = list(token_times_s)
        ttft = times[0] - arrival_s if times else None
        e2e = finished_s - arrival_s if finished_s is not None and error is None else None
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        count = len(times) if num_output_tokens is None else num_output_tokens
        return cls(index, prompt_len, output_len, arrival_s, ttft, e2e, gaps, count, error, priority, http_status)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of a latency distribution in milliseconds; all None when there are no values."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    count: int = 0

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> LatencyStats:
        if not len(values_s):
            return cls()
        ms = np.asarray(values_s, dtype=float) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99), float(ms.max()), len(ms))


@dataclass(frozen=True, slots=True)
class RequestSLO:
    """Per-request limits that make a request count towards goodput."""

    max_ttft_ms: float | None = None
    max_tpot_ms: float | None = None
    max_e2e_ms: float | None = None

    def is_met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.max_ttft_ms, r.ttft_s), (self.max_tpot_ms, r.tpot_s), (self.max_e2e_ms, r.e2e_s))
        # A one-token request has no TPOT; it meets a TPOT limit trivially.
        return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


@dataclass(frozen=True, slots=True)
class KvSample:
    """Engine state at one moment: KV usage in percent, running and waiting requests."""

    t_s: float
    kv_usage_perc: float
    num_running: int
    num_waiting: int
    # Of the allocated KV slots, the share (%) holding live tokens; None where not reported.
    kv_live_perc: float | None = None


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """What the engine itself reports over a run; None where the target could not tell (a
    server that does not expose the figure). An OOM is an out-of-memory error that failed a
    model step (`EngineStats.num_oom_errors`); KV pressure fails nothing, it preempts, and shows
    in the preemptions and allocation failures. `num_server_failed_requests`: requests a server
    itself counts as failed (in process, the failed requests are the run's own count)."""

    kv_peak_perc: float | None = None
    num_preemptions: int | None = None
    num_oom_errors: int | None = None
    num_kv_allocation_failures: int | None = None
    num_server_failed_requests: int | None = None
    # Speculative decoding: verifying steps of a request, tokens proposed, tokens kept.
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None
    spec_num_lookups: int | None = None  # proposals looked up in requests' own tokens
    spec_num_found: int | None = None  # of which found
    spec_overhead_s: float | None = None  # the engine's own seconds on speculation (in process only)

    @classmethod
    def between(cls, before: EngineStats, after: EngineStats) -> EngineCounters:
        """The counters' rise from one engine snapshot to the next, and the KV peak at the end."""
        return cls(
            kv_peak_perc=100.0 * after.kv_cache_peak_usage,
            num_preemptions=after.num_preemptions - before.num_preemptions,
            num_oom_errors=after.num_oom_errors - before.num_oom_errors,
            num_kv_allocation_failures=after.num_kv_allocation_failures - before.num_kv_allocation_failures,
            spec_num_drafts=after.spec_num_drafts - before.spec_num_drafts,
            spec_num_draft_tokens=after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            spec_num_accepted_tokens=after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            spec_num_lookups=after.spec_num_lookups - before.spec_num_lookups,
            spec_num_found=after.spec_num_found - before.spec_num_found,
            spec_overhead_s=after.spec_overhead_s - before.spec_overhead_s,
        )

    @property
    def spec_acceptance_perc(self) -> float | None:
        """Of the proposed tokens, the share (%) kept."""
        if not self.spec_num_draft_tokens or self.spec_num_accepted_tokens is None:
            return None
        return 100.0 * self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def spec_proposal_perc(self) -> float | None:
        """Of the lookups of a request's proposals in its own tokens, the share (%) that found one."""
        if not self.spec_num_lookups or self.spec_num_found is None:
            return None
        return 100.0 * self.spec_num_found / self.spec_num_lookups

    @property
    def spec_tokens_per_draft(self) -> float | None:
        """Tokens a request gained in a step that verified its proposals: those kept and its own."""
        if not self.spec_num_drafts or self.spec_num_accepted_tokens is None:
            return None
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    duration_s: float
    num_requests: int
    num_completed: int
    num_failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    ttft_ms: LatencyStats
    tbt_ms: LatencyStats
    tpot_ms: LatencyStats
    e2e_ms: LatencyStats
    num_good: int | None  # requests meeting the per-request SLO, if one was given
    goodput: float | None  # good requests / s
    kv_peak_perc: float | None
    kv_mean_perc: float | None
    num_preemptions: int | None
    num_oom_errors: int | None
    num_kv_allocation_failures: int | None = None
    # Of the allocated KV slots, the share (%) holding live tokens: time-weighted over the run's
    # samples with any block in use, and at the sample of peak usage.
    kv_live_mean_perc: float | None = None
    kv_live_at_peak_perc: float | None = None
    num_server_failed_requests: int | None = None  # as the server counts them
    num_http_5xx: int = 0  # responses with a 5xx status, as the client saw them
    spec_acceptance_perc: float | None = None  # speculative decoding: proposed tokens kept (%)
    spec_tokens_per_draft: float | None = None  # tokens a verifying step gave its request
    spec_proposal_perc: float | None = None  # lookups of proposals in requests' own tokens that found one (%)
    spec_overhead_perc: float | None = None  # the engine's own time on speculation, % of the run's


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    samples: Sequence[KvSample] = (), counters: EngineCounters = EngineCounters(),
                    slo: RequestSLO | None = None) -> BenchMetrics:
    done = [r for r in results if r.ok]
    duration = max(duration_s, 1e-9)
    num_output = sum(r.num_output_tokens for r in done)
    num_input = sum(r.prompt_len for r in done)
    num_good = sum(slo.is_met(r) for r in results) if slo is not None else None
    sampled_peak = max((s.kv_usage_perc for s in samples), default=None)
    peak = counters.kv_peak_perc
    if sampled_peak is not None:
        peak = sampled_peak if peak is None else max(peak, sampled_peak)
    return BenchMetrics(
        duration_s=duration_s,
        num_requests=len(results),
        num_completed=len(done),
        num_failed=len(results) - len(done),
        total_input_tokens=num_input,
        total_output_tokens=num_output,
        request_throughput=len(done) / duration,
        output_throughput=num_output / duration,
        total_throughput=(num_input + num_output) / duration,
        ttft_ms=LatencyStats.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tbt_ms=LatencyStats.of_seconds([g for r in done for g in r.token_gaps_s]),
        tpot_ms=LatencyStats.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        e2e_ms=LatencyStats.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
        num_good=num_good,
        goodput=None if num_good is None else num_good / duration,
        kv_peak_perc=peak,
        kv_mean_perc=time_weighted_mean([(s.t_s, s.kv_usage_perc) for s in samples]),
        num_preemptions=counters.num_preemptions,
        num_oom_errors=counters.num_oom_errors,
        num_kv_allocation_failures=counters.num_kv_allocation_failures,
        kv_live_mean_perc=time_weighted_mean(live) if (live := _live_points(samples)) else None,
        kv_live_at_peak_perc=max(with_live, key=lambda s: s.kv_usage_perc).kv_live_perc
        if (with_live := [s for s in samples if s.kv_live_perc is not None]) else None,
        num_server_failed_requests=counters.num_server_failed_requests,
        num_http_5xx=sum(r.http_status is not None and r.http_status >= 500 for r in results),
        spec_acceptance_perc=counters.spec_acceptance_perc,
        spec_tokens_per_draft=counters.spec_tokens_per_draft,
        spec_proposal_perc=counters.spec_proposal_perc,
        spec_overhead_perc=None if counters.spec_overhead_s is None else 100.0 * counters.spec_overhead_s / duration,
    )


def _live_points(samples: Sequence[KvSample]) -> list[tuple[float, float]]:
    """(time, live share) of the samples that report one: those with KV blocks in use."""
    return [(s.t_s, s.kv_live_perc) for s in samples if s.kv_live_perc is not None]


def time_weighted_mean(points: Sequence[tuple[float, float]]) -> float | None:
    """Mean of a step function sampled at (time, value) points, each value holding until the
    next point; the plain mean when the points span no time."""
    if not points:
        return None
    t = np.array([p[0] for p in points], dtype=float)
    v = np.array([p[1] for p in points], dtype=float)
    span = t[-1] - t[0]
    if len(points) == 1 or span <= 0:
        return float(v.mean())
    return float((v[:-1] * np.diff(t)).sum() / span)
