"""What an engine reports about itself: one frozen snapshot, read by `/metrics`, `inflight bench`
and `inflight sim` alike, so that each counter means the same thing wherever it is shown."""

from __future__ import annotations

from dataclasses import dataclass

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
    num_oom_events: int = 0  # out-of-memory errors that failed a model step (and its requests)
    num_failed_steps: int = 0  # model steps that raised, out of memory or not
    num_prefix_query_tokens: int = 0  # prompt tokens of admitted requests
    num_prefix_hit_tokens: int = 0  # of which found in the prefix cache
    num_kv_live_tokens: int = 0  # allocated KV slots holding a token of an unfinished request
    # Tokens still to prefill: waiting requests' whole prompts (less cache hits, once admitted)
    # and the rest of running ones' prompts. The queue a new request waits behind.
    num_waiting_tokens: int = 0
    block_size: int = 16

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


def scheduler_stats(scheduler: Scheduler, num_oom_events: int = 0, num_failed_steps: int = 0) -> EngineStats:
    """The snapshot of an engine built around `scheduler`, with the step failures it counted."""
    bm = scheduler.block_manager
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_kv_blocks_used=bm.num_used_blocks,
        num_kv_blocks_total=bm.num_blocks,
        num_kv_blocks_peak=bm.peak_used_blocks,
        num_preemptions=scheduler.num_preemptions,
        num_kv_allocation_failures=bm.num_allocation_failures,
        num_oom_events=num_oom_events,
        num_failed_steps=num_failed_steps,
        num_prefix_query_tokens=scheduler.num_prefix_query_tokens,
        num_prefix_hit_tokens=scheduler.num_prefix_hit_tokens,
        num_kv_live_tokens=bm.num_live_tokens(scheduler.running),
        num_waiting_tokens=num_waiting_tokens(scheduler),
        block_size=bm.block_size,
    )
