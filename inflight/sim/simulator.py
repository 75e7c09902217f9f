"""The engine's own step loop on a virtual clock: `LLMEngine` with the production `Scheduler`
(or `StaticScheduler`) and `BlockManager`, unchanged, and `SimRunner` where the model runner
would be. Requests end at their `max_tokens`, as in an `ignore_eos` benchmark, so no model or
tokenizer is needed; every time the engine stamps (arrival, first scheduled, tokens, finished)
is read from the virtual clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from inflight.bench.local import run_engine
from inflight.bench.results import Capture
from inflight.bench.workload import BenchRequest
from inflight.config import EngineConfig
from inflight.engine.engine import EngineParts, LLMEngine
from inflight.errors import ConfigError
from inflight.perf.cost_model import CostModel
from inflight.sim.runner import SimDrafter, SimProposals, SimRunner, VirtualClock


def sim_engine(config: EngineConfig, cost_model: CostModel, gpu_memory_utilization: float = 0.9,
               acceptance_rate: float | None = None, draft_cost_model: CostModel | None = None,
               proposal_rate: float | None = None) -> LLMEngine:
    """The engine `config` describes, its steps priced by `cost_model` on a fresh virtual clock;
    the KV pool sized for the cost model's device unless `config` sets it. With speculative
    decoding a decoding request finds its full k tokens proposed with chance `proposal_rate` at
    each step (default 1), each kept with chance `acceptance_rate` once those before it were
    (required then); a draft model's passes are priced by `draft_cost_model` (required with method
    draft_model), its proposals always found."""
    cache = config.cache
    num_blocks = cache.num_kv_blocks or cost_model.num_kv_blocks(
        cache.block_size, gpu_memory_utilization, cache.kv_cache_memory_fraction, cache.kv_cache_memory_bytes)
    if config.scheduler.speculative is not None and acceptance_rate is None:
        raise ConfigError("speculative decoding in the simulator needs an acceptance rate: the workload's "
                          "acceptance_rate or --acceptance-rate (the chance a proposed token is kept once those "
                          "before it were)")
    clock = VirtualClock()
    parts = EngineParts(SimRunner(cost_model, clock, acceptance_rate), num_blocks, cost_model.model.architecture,
                        cost_model.model, clock=clock, check_token_ids=False, step_time_model=cost_model)
    engine = LLMEngine(config, parts=parts)
    if engine.speculator is not None:
        engine.speculator.proposer = SimProposals(1.0 if proposal_rate is None else proposal_rate)
        if engine.speculator.config.method == "draft_model":
            if draft_cost_model is None:
                raise ConfigError("a simulated draft model needs its shapes (the draft's cost model)")
            engine.speculator.drafter = SimDrafter(draft_cost_model, clock)
    return engine


def schedules_ahead(engine: LLMEngine) -> bool:
    """Whether the simulated engine's profile overlaps scheduling with the device's work, and so
    forms each step's batch while the step before it runs."""
    runner = engine.runner
    return isinstance(runner, SimRunner) and runner.cost_model.engine.overlap_scheduling


def run_simulation(engine: LLMEngine, requests: Sequence[BenchRequest],
                   max_concurrency: int | None = None) -> Capture:
    """Runs the workload through `inflight bench`'s own in-process driver (each request added
    when its arrival time comes, between steps; at most `max_concurrency` in the engine), in
    virtual time, and returns the same measurements. An engine profile that overlaps scheduling
    takes a request one step later: the next batch was formed while the current step ran."""
    if not isinstance(engine.clock, VirtualClock):
        raise ConfigError("run_simulation needs an engine on a virtual clock (sim_engine)")
    return run_engine(engine, requests, max_concurrency, progress=False, schedules_ahead=schedules_ahead(engine))
