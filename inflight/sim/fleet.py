"""A fleet on a virtual clock: N simulated engines (each the real scheduler and block manager,
`inflight.sim.simulator`) behind the fleet's own routing rule (`inflight.fleet.routing.Router`,
the one `inflight serve --replicas` runs behind Ray Serve).

Time is one clock for the fleet; each engine keeps its own, the end of its last step. The
earliest event goes next: the engine whose step ends first steps again, unless a request arrives
before that; an arriving request is routed on what the router knows then (each replica's report,
refreshed every `stats_period_s` as Ray Serve would, and the requests it routed since) and joins
its replica at that replica's next step boundary.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from inflight.bench.local import MAX_IDLE_STEPS, RequestDriver
from inflight.bench.metrics import EngineCounters
from inflight.bench.results import Capture
from inflight.bench.workload import BenchRequest
from inflight.engine.block_manager import block_hashes
from inflight.engine.engine import LLMEngine
from inflight.errors import ConfigError, InflightError
from inflight.fleet.routing import ReplicaLoad, RouteHint, Router, RouterConfig
from inflight.sim.runner import VirtualClock
from inflight.sim.simulator import schedules_ahead


@dataclass(frozen=True, slots=True)
class FleetResult:
    capture: Capture  # what `inflight bench` would measure against the fleet (no KV samples)
    routed: list[int]  # requests each replica took
    prefix_hit_rate: float  # prompt tokens found in a prefix cache, of those looked up


def run_fleet(engines: Sequence[LLMEngine], requests: Sequence[BenchRequest], config: RouterConfig,
              stats_period_s: float = 1.0) -> FleetResult:
    """Runs the workload over the fleet of `engines` (from `sim_engine`) behind `config`'s rule."""
    clocks = [e.clock for e in engines]
    if not engines or not all(isinstance(c, VirtualClock) for c in clocks):
        raise ConfigError("run_fleet needs engines on virtual clocks (sim_engine)")
    fleet_clock = VirtualClock()
    router: Router[int] = Router(config, clock=fleet_clock)
    block_size = engines[0].block_manager.block_size
    before = [e.stats() for e in engines]
    bar = tqdm(total=len(requests), disable=True, file=sys.stderr)
    drivers = [RequestDriver(e, [], 0.0, None, bar, schedules_ahead(e)) for e in engines]
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    replica_of: dict[str, int] = {}
    routed = [0] * len(engines)
    last_report = [-float("inf")] * len(engines)
    idle = [0] * len(engines)
    i = 0
    while i < len(pending) or any(d.live for d in drivers):
        # A replica with routed requests it has not taken yet (it schedules a step ahead) steps too.
        busy = [k for k, d in enumerate(drivers) if d.live or d.pending]
        k = min(busy, key=lambda j: clocks[j]()) if busy else None
        arrival = pending[i].arrival_s if i < len(pending) else None
        if k is not None and (arrival is None or clocks[k]() < arrival):
            fleet_clock.advance_to(clocks[k]())
            driver = drivers[k]
            driver.admit_arrived(clocks[k]())
            before_live = set(driver.live)
            driver.step()
            idle[k] = 0 if engines[k].step_records[-1].num_requests else idle[k] + 1
            if idle[k] > MAX_IDLE_STEPS:
                raise InflightError(f"replica {k} made no progress for {MAX_IDLE_STEPS} steps")
            for request_id in before_live - set(driver.live):
                router.on_finished(replica_of.pop(request_id), request_id)
            continue
        assert arrival is not None
        request = pending[i]
        i += 1
        fleet_clock.advance_to(arrival)
        for j, engine in enumerate(engines):
            if not drivers[j].live:
                clocks[j].wait_until(arrival)  # type: ignore[attr-defined]
            if arrival - last_report[j] >= stats_period_s:
                router.report(j, ReplicaLoad.of(engine.stats(), engine.block_manager.cached_block_hashes(), arrival))
                last_report[j] = arrival
        hint = RouteHint(request.prompt_len, tuple(block_hashes(request.prompt_token_ids, block_size)), block_size)
        j = router.choose(list(range(len(engines))), hint).ranked[0]
        router.on_routed(j, hint, f"bench-{request.index}")
        routed[j] += 1
        replica_of[f"bench-{request.index}"] = j
        drivers[j].pending.append(request)
        drivers[j].admit_arrived(max(arrival, clocks[j]()))
    results = {index: r for d in drivers for index, r in d.results.items()}
    duration = max((r.arrival_s + (r.e2e_s or 0.0) for r in results.values()), default=0.0)
    counters = [EngineCounters.between(b, e.stats()) for b, e in zip(before, engines, strict=True)]
    total = EngineCounters(
        kv_peak_perc=max((c.kv_peak_perc for c in counters if c.kv_peak_perc is not None), default=None),
        num_preemptions=sum(c.num_preemptions or 0 for c in counters),
        num_oom_errors=sum(c.num_oom_errors or 0 for c in counters),
        num_kv_allocation_failures=sum(c.num_kv_allocation_failures or 0 for c in counters))
    ordered = [results[r.index] for r in sorted(requests, key=lambda r: r.index)]
    after = [e.stats() for e in engines]
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before, strict=True))
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before, strict=True))
    return FleetResult(Capture(ordered, duration, [], total, None), routed, hits / queries if queries else 0.0)
