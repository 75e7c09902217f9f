"""What an engine reports about itself: one frozen snapshot, read by `/metrics`, `inflight bench`
and `inflight sim` alike, so that each counter means the same thing wherever it is shown, and
the Prometheus series each of its fields is exported as (`METRICS`): one name from the engine
to `/metrics`, vLLM's where vLLM has the series."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from inflight.engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_peak: int = 0  # since the engine started, or since `reset_kv_peak()`
    num_preemptions: int = 0  # requests whose KV was freed, to be recomputed
    # Times a running request found no free KV block; each ends in a preemption, never in a failure.
    num_kv_allocation_failures: int = 0
    num_oom_errors: int = 0  # out-of-memory errors that failed a model step (and its requests)
    num_failed_steps: int = 0  # model steps that raised, out of memory or not
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests looked up (vLLM's name)
    prefix_cache_hits: int = 0  # of which found in the prefix cache (vLLM's name)
    num_kv_live_tokens: int = 0  # allocated KV slots holding a token of an unfinished request
    # Tokens still to prefill: waiting requests' whole prompts (less cache hits, once admitted)
    # and the rest of running ones' prompts. The queue a new request waits behind.
    num_waiting_tokens: int = 0
    block_size: int = 16
    # Speculative decoding (vLLM's spec_decode counters): verifying steps of a request, the tokens
    # they proposed, those kept, and of those how many at each position of a proposal.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_num_lookups: int = 0  # proposals looked up (n-gram, suffix), and found (`SpecStats`)
    spec_num_found: int = 0
    spec_overhead_s: float = 0.0  # the scheduler's own seconds on speculation (`SpecStats.overhead_s`)

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0

    @property
    def kv_live_token_share(self) -> float:
        """Of the allocated KV slots, the share holding live tokens (1.0 with nothing allocated)."""
        slots = self.num_kv_blocks_used * self.block_size
        return self.num_kv_live_tokens / slots if slots else 1.0

    @property
    def kv_cache_peak_usage(self) -> float:
        return self.num_kv_blocks_peak / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0


def num_waiting_tokens(scheduler: Scheduler) -> int:
    """Tokens still to prefill: all of each waiting request's, and those of each running one
    beyond the one token a decode step computes."""
    waiting = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
    return waiting + sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in scheduler.running)


def scheduler_stats(scheduler: Scheduler, num_oom_errors: int = 0, num_failed_steps: int = 0) -> EngineStats:
    """The snapshot of an engine built around `scheduler`, with the step failures it counted."""
    bm = scheduler.block_manager
    spec = scheduler.speculator.stats if scheduler.speculator is not None else None
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_kv_blocks_used=bm.num_used_blocks,
        num_kv_blocks_total=bm.num_blocks,
        num_kv_blocks_peak=bm.peak_used_blocks,
        num_preemptions=scheduler.num_preemptions,
        num_kv_allocation_failures=bm.num_allocation_failures,
        num_oom_errors=num_oom_errors,
        num_failed_steps=num_failed_steps,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        num_kv_live_tokens=bm.num_live_tokens(scheduler.running),
        num_waiting_tokens=num_waiting_tokens(scheduler),
        block_size=bm.block_size,
        spec_num_drafts=spec.num_drafts if spec else 0,
        spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        spec_accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
        spec_num_lookups=spec.num_lookups if spec else 0,
        spec_num_found=spec.num_found if spec else 0,
        spec_overhead_s=spec.overhead_s if spec else 0.0,
    )


METRIC_PREFIX = "inflight:"


class StatMetric(NamedTuple):
    """One `EngineStats` value as a Prometheus series: `name` without the prefix (and, for a
    counter, without the `_total` a scrape shows)."""

    name: str
    kind: Literal["gauge", "counter"]
    doc: str
    value: Callable[[EngineStats], float]

    @property
    def scraped_name(self) -> str:
        """The name as a scrape of `/metrics` shows it."""
        return METRIC_PREFIX + self.name + ("_total" if self.kind == "counter" else "")


METRICS: dict[str, StatMetric] = {m.name: m for m in [
    StatMetric("num_requests_running", "gauge", "Requests in the running batch.", lambda s: s.num_running),
    StatMetric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    StatMetric("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0..1).", lambda s: s.kv_cache_usage),
    StatMetric("kv_cache_usage_peak_perc", "gauge", "Peak fraction of KV blocks in use (0..1).",
               lambda s: s.kv_cache_peak_usage),
    StatMetric("kv_cache_live_token_perc", "gauge", "Of the KV slots in use, the fraction holding a token of an "
               "unfinished request (0..1): what paging does not waste.", lambda s: s.kv_live_token_share),
    StatMetric("kv_cache_blocks_used", "gauge", "KV blocks in use.", lambda s: s.num_kv_blocks_used),
    StatMetric("kv_cache_blocks_total", "gauge", "KV blocks in the pool.", lambda s: s.num_kv_blocks_total),
    StatMetric("num_preemptions", "counter", "Requests preempted (their KV freed, to be recomputed).",
               lambda s: s.num_preemptions),
    # A running request that cannot grow its KV is preempted, not failed: that is counted here
    # and in num_preemptions, while num_oom_errors counts only real out-of-memory failures.
    StatMetric("num_kv_allocation_failures", "counter", "Times a running request found no free KV block.",
               lambda s: s.num_kv_allocation_failures),
    StatMetric("num_oom_errors", "counter", "Out-of-memory errors that failed a model step (KV pressure "
               "preempts instead).", lambda s: s.num_oom_errors),
    StatMetric("num_failed_steps", "counter", "Engine steps that raised and failed their requests.",
               lambda s: s.num_failed_steps),
    StatMetric("prefix_cache_queries", "counter", "Prompt tokens of admitted requests looked up in the prefix "
               "cache.", lambda s: s.prefix_cache_queries),
    StatMetric("prefix_cache_hits", "counter", "Of those, tokens found in the prefix cache.",
               lambda s: s.prefix_cache_hits),
    StatMetric("spec_decode_num_drafts", "counter", "Speculative decoding: a request's proposed tokens verified "
               "in one step (one draft).", lambda s: s.spec_num_drafts),
    StatMetric("spec_decode_num_draft_tokens", "counter", "Speculative decoding: proposed tokens verified.",
               lambda s: s.spec_num_draft_tokens),
    StatMetric("spec_decode_num_accepted_tokens", "counter", "Speculative decoding: proposed tokens the model "
               "kept.", lambda s: s.spec_num_accepted_tokens),
    StatMetric("spec_decode_num_lookups", "counter", "Speculative decoding: lookups of a request's proposals "
               "in its own tokens (n-gram, suffix).", lambda s: s.spec_num_lookups),
    StatMetric("spec_decode_num_lookups_found", "counter", "Of those, the lookups that found a proposal.",
               lambda s: s.spec_num_found),
]}

# Per position of a draft (0: its first proposed token): how many were kept (vLLM's name).
SPEC_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
