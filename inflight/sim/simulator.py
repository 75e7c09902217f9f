"""The engine's step loop on a virtual clock: the production `Scheduler` (or `StaticScheduler`)
and `BlockManager`, unchanged, with `SimRunner` where the model runner would be. Requests end at
their `max_tokens`, as in an `ignore_eos` benchmark, so no model is needed.

The scheduler stamps `timings.first_scheduled` and `timings.finished` with `time.perf_counter()`;
the simulator overwrites both with virtual time after each step (its clock seam), and sets the
token times itself, as `LLMEngine` does with the wall clock.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence

from inflight.bench.local import bench_params
from inflight.bench.metrics import EngineCounters, RequestResult
from inflight.bench.results import Capture
from inflight.bench.timeline import StepRecorder
from inflight.bench.workload import BenchRequest
from inflight.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulingPolicy
from inflight.engine.block_manager import BlockManager
from inflight.engine.output import RequestOutput, StepRecord
from inflight.engine.scheduler import Scheduler, SchedulerOutput
from inflight.engine.static import StaticScheduler
from inflight.engine.stats import EngineStats, scheduler_stats
from inflight.errors import EngineOverloadedError, InflightError, InvalidRequestError
from inflight.request import FinishReason, Request, SamplingParams
from inflight.sim.cost_model import CostModel
from inflight.sim.runner import SimRunner, VirtualClock

StepObserver = Callable[[StepRecord, list[RequestOutput]], None]

# Consecutive steps that schedule nothing while requests wait: the configuration cannot serve them.
_MAX_IDLE_STEPS = 10_000


def build_scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int) -> Scheduler:
    """The scheduler and block manager `LLMEngine` would build, without a model."""
    block_manager = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
    static = scheduler_config.scheduling_policy is SchedulingPolicy.STATIC
    return (StaticScheduler if static else Scheduler)(scheduler_config, block_manager)


class SimEngine:
    """`LLMEngine`'s request and step API over a virtual clock."""

    def __init__(self, config: EngineConfig, cost_model: CostModel, gpu_memory_utilization: float = 0.9) -> None:
        sched_cfg = config.scheduler
        max_len = cost_model.model.max_position_embeddings
        if sched_cfg.max_model_len > max_len:
            sched_cfg = dataclasses.replace(sched_cfg, max_model_len=max_len)
        cache = config.cache
        num_blocks = cache.num_kv_blocks or cost_model.num_kv_blocks(
            cache.block_size, gpu_memory_utilization, cache.kv_cache_memory_fraction, cache.kv_cache_memory_bytes)
        self.config = config
        self.scheduler_config = sched_cfg
        self.scheduler = build_scheduler(sched_cfg, cache, num_blocks)
        self.block_manager = self.scheduler.block_manager
        self.clock = VirtualClock()
        self.runner = SimRunner(cost_model, self.clock)
        self.step_observers: list[StepObserver] = []
        self._requests: dict[str, Request] = {}
        self._stamped: set[str] = set()  # requests whose first_scheduled is in virtual time
        self._num_idle_steps = 0

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str,
                    arrival_time: float) -> Request:
        limit = self.scheduler_config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloadedError(f"the waiting queue is full ({limit} requests); retry later")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = Request(request_id, list(prompt_token_ids), params, arrival_time=arrival_time)
        self.scheduler.add_request(request)
        self._requests[request_id] = request
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> EngineStats:
        """`LLMEngine.stats()`'s snapshot; a simulated step never fails, so no OOM events."""
        return scheduler_stats(self.scheduler)

    def step(self) -> list[RequestOutput]:
        start = self.clock.now
        out = self.scheduler.schedule()
        self._stamp_scheduled(out, start)
        sampled = self.runner.execute(out)
        outputs = self._process(out, sampled)
        self._record(out, outputs, start)
        return outputs

    def _stamp_scheduled(self, out: SchedulerOutput, now: float) -> None:
        for s in out.scheduled:
            if s.request.request_id not in self._stamped:
                s.request.timings.first_scheduled = now
                self._stamped.add(s.request.request_id)
        if out.is_empty:
            self._num_idle_steps += 1
            if self._num_idle_steps > _MAX_IDLE_STEPS:
                raise InflightError("the scheduler made no progress for 10000 steps with requests waiting")
        else:
            self._num_idle_steps = 0

    def _process(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        self.scheduler.update_from_output(out, sampled)
        now = self.clock.now
        outputs = []
        for s in out.scheduled:
            request = s.request
            token = sampled.get(request.request_id)
            if token is None:
                continue
            timings = request.timings
            timings.add_token(now)
            finish = FinishReason.LENGTH if request.num_output_tokens >= request.sampling_params.max_tokens else None
            if finish is not None:
                self.scheduler.finish(request, finish)
                timings.finished = now
                del self._requests[request.request_id]
                self._stamped.discard(request.request_id)
            outputs.append(RequestOutput(request.request_id, [token], "", finish is not None, finish, request))
        return outputs

    def _record(self, out: SchedulerOutput, outputs: list[RequestOutput], start: float) -> None:
        record = StepRecord(
            step_id=out.step_id, start_s=start, duration_s=self.clock.now - start,
            num_requests=len(out.scheduled), num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens, num_wasted_tokens=out.num_wasted_tokens,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preempted=len(out.preempted), request_ids=tuple(s.request.request_id for s in out.scheduled),
            work=out.work(),
            forward_s=self.clock.now - start,
        )
        for observer in self.step_observers:
            observer(record, outputs)


def run_simulation(engine: SimEngine, requests: Sequence[BenchRequest],
                   max_concurrency: int | None = None) -> Capture:
    """Runs the workload as `inflight bench` runs it in-process (each request added when its
    arrival time comes, between steps; at most `max_concurrency` in the engine), in virtual
    time, and returns the same measurements."""
    clock = engine.clock
    index_of = {f"bench-{r.index}": r.index for r in requests}
    recorder = StepRecorder(0.0, engine.block_manager.num_blocks, index_of)
    engine.step_observers.append(recorder)
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
    free_slots: deque[float] = deque([0.0] * max_concurrency) if max_concurrency else deque()
    live: dict[str, tuple[BenchRequest, float, list[float]]] = {}
    results: dict[int, RequestResult] = {}

    def finish(request: BenchRequest, sent: float, times: list[float], done: float | None,
               error: str | None) -> None:
        results[request.index] = RequestResult.from_token_times(
            request.index, request.prompt_len, request.output_len, sent, times, done, len(times), error)
        if max_concurrency:
            free_slots.append(clock.now)

    try:
        while pending or live:
            while pending and pending[0].arrival_s <= clock.now and (not max_concurrency or free_slots):
                request = pending.popleft()
                sent = max(request.arrival_s, free_slots.popleft() if max_concurrency else 0.0)
                try:
                    engine.add_request(request.prompt_token_ids, bench_params(request),
                                       request_id=f"bench-{request.index}", arrival_time=sent)
                except InflightError as exc:
                    finish(request, sent, [], None, str(exc))
                    continue
                live[f"bench-{request.index}"] = (request, sent, [])
            if live:
                for out in engine.step():
                    state = live.get(out.request_id)
                    if state is None:
                        continue
                    state[2].append(clock.now)
                    if out.finished:
                        del live[out.request_id]
                        finish(state[0], state[1], state[2], clock.now, out.error)
            elif pending:
                clock.advance_to(pending[0].arrival_s)
    finally:
        engine.step_observers.remove(recorder)
    duration = max((r.arrival_s + (r.e2e_s or 0.0) for r in results.values()), default=0.0)
    counters = EngineCounters.between(EngineStats(), engine.stats())
    ordered = [results[r.index] for r in sorted(requests, key=lambda r: r.index)]
    return Capture(ordered, duration, recorder.samples, counters, recorder.timeline)
