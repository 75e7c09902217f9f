"""The in-process target: drives an `LLMEngine` through its offline API, adding each request
when its arrival time comes, as a server's loop would, and timing tokens as the steps return."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from tqdm import tqdm

from inflight.bench.metrics import EngineCounters, RequestResult
from inflight.bench.results import Capture
from inflight.bench.timeline import StepRecorder
from inflight.bench.workload import BenchRequest
from inflight.engine.engine import LLMEngine
from inflight.engine.output import RequestOutput
from inflight.errors import InflightError
from inflight.request import SamplingParams


def bench_params(request: BenchRequest) -> SamplingParams:
    """Greedy, with the output length forced: the workload fixes every request's length."""
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)


def warm_up(engine: LLMEngine) -> None:
    """One tiny request first, so one-time costs (allocator, kernels) stay out of the run."""
    prompt = [(1000 + i) % engine.model_config.vocab_size for i in range(32)]  # ids any vocabulary has
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       request_id="bench-warmup")
    while engine.has_unfinished():
        engine.step()
    engine.reset_kv_peak()


@dataclass(slots=True)
class _Live:
    request: BenchRequest
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0


class RequestDriver:
    """Adds requests as they arrive (under an optional concurrency cap) and collects their
    tokens as steps return; what a server's loop and its clients would do together."""

    def __init__(self, engine: LLMEngine, requests: Sequence[BenchRequest], t0: float,
                 max_concurrency: int | None, bar: tqdm, schedules_ahead: bool = False) -> None:
        self.engine = engine
        self.t0 = t0
        self.cap = max_concurrency
        self.bar = bar
        # An engine that overlaps its scheduling forms step k+1's batch while step k runs, so a
        # request that arrives during step k joins step k+2 (the simulator's overlap profiles).
        self.schedules_ahead = schedules_ahead
        self.last_step_start: float | None = None
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        # Times at which a concurrency slot became free, earliest first (a FIFO semaphore).
        self.free_slots: deque[float] = deque([t0] * max_concurrency) if max_concurrency else deque()
        self.live: dict[str, _Live] = {}
        self.results: dict[int, RequestResult] = {}
        self.num_tokens = 0  # output tokens collected, of every request

    def next_arrival(self) -> float | None:
        return self.t0 + self.pending[0].arrival_s if self.pending else None

    def admit_arrived(self, now: float) -> None:
        """Adds the requests that the next step can take (`admission_cutoff`)."""
        cutoff = self.admission_cutoff(now)
        while self.pending and self.t0 + self.pending[0].arrival_s <= cutoff and (not self.cap or self.free_slots):
            request = self.pending.popleft()
            # Stamped at its scheduled time (or when a slot freed): waiting for a step counts.
            sent = max(self.t0 + request.arrival_s, self.free_slots.popleft() if self.cap else self.t0)
            state = _Live(request, sent)
            try:
                self.engine.add_request(request.prompt_token_ids, bench_params(request),
                                        request_id=f"bench-{request.index}", arrival_time=sent,
                                        priority=request.priority)
            except InflightError as exc:
                self._finish(state, now, None, str(exc))
                continue
            self.live[f"bench-{request.index}"] = state

    def admission_cutoff(self, now: float) -> float:
        """The latest arrival the next step can take: now, or, for an engine that schedules a
        step ahead and is busy, the start of the step that just ran (when the batch was formed)."""
        if self.schedules_ahead and self.live and self.last_step_start is not None:
            return self.last_step_start
        return now

    def step(self) -> list[RequestOutput]:
        """One engine step, its tokens collected."""
        clock = self.engine.clock
        started = clock()
        outputs = self.engine.step()
        self.last_step_start = started
        self.collect(outputs, clock())
        return outputs

    def collect(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            state = self.live.get(out.request_id)
            if state is None:
                continue
            if out.new_token_ids:
                state.token_times.append(now)
                state.num_tokens += len(out.new_token_ids)
                self.num_tokens += len(out.new_token_ids)
            if out.finished:
                del self.live[out.request_id]
                self._finish(state, now, now, out.error)

    def _finish(self, state: _Live, now: float, finished: float | None, error: str | None) -> None:
        t0 = self.t0
        self.results[state.request.index] = RequestResult.from_token_times(
            state.request.index, state.request.prompt_len, state.request.output_len, state.sent_at - t0,
            [t - t0 for t in state.token_times], None if finished is None else finished - t0,
            state.num_tokens, error, state.request.priority,
        )
        if self.cap:
            self.free_slots.append(now)
        self.bar.update()


# Consecutive steps that schedule nothing while requests wait: the configuration cannot serve them.
MAX_IDLE_STEPS = 10_000


def run_engine(engine: LLMEngine, requests: Sequence[BenchRequest], max_concurrency: int | None = None,
               progress: bool = True, label: str = "", schedules_ahead: bool = False) -> Capture:
    """Runs the workload on `engine` and returns what was measured, on the engine's clock: wall
    time for `inflight bench`, virtual time for `inflight sim` (which calls this too). With
    `max_concurrency`, at most that many requests are in the engine at once; a request that
    waits for a slot is sent (and its latency counted from) when one frees up. With
    `schedules_ahead` (a simulated engine that overlaps scheduling), a request that arrives
    while a step runs misses the next one, whose batch was formed when that step began."""
    steps = engine_steps(engine, requests, max_concurrency, progress, label, schedules_ahead)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def engine_steps(engine: LLMEngine, requests: Sequence[BenchRequest], max_concurrency: int | None = None,
                 progress: bool = True, label: str = "",
                 schedules_ahead: bool = False) -> Generator[float, None, Capture]:
    """`run_engine` one step at a time: each `next()` admits what has arrived and runs one engine
    step (or waits for the next arrival) and yields how far the workload has come (the share of
    its output tokens collected; every request asks for `output_len` tokens); the generator
    returns the Capture. `run_lockstep` interleaves several of these by that progress."""
    clock = engine.clock
    engine.reset_kv_peak()
    before = engine.stats()
    index_of = {f"bench-{r.index}": r.index for r in requests}
    t0 = clock()
    recorder = StepRecorder(t0, engine.block_manager.num_blocks, index_of, engine.block_manager.block_size)
    engine.step_observers.append(recorder)
    bar = tqdm(total=len(requests), desc=label or "bench", unit="req", file=sys.stderr,
               disable=not progress, leave=False)
    driver = RequestDriver(engine, requests, t0, max_concurrency, bar, schedules_ahead)
    idle_steps = 0
    total_tokens = max(1, sum(r.output_len for r in requests))
    try:
        while driver.pending or driver.live:
            driver.admit_arrived(clock())
            if driver.live:
                driver.step()
                idle_steps = 0 if engine.step_records[-1].num_requests else idle_steps + 1
                if idle_steps > MAX_IDLE_STEPS:
                    raise InflightError(f"the scheduler made no progress for {MAX_IDLE_STEPS} steps "
                                        "with requests waiting")
            elif (arrival := driver.next_arrival()) is not None:
                clock.wait_until(arrival)
            yield driver.num_tokens / total_tokens
    finally:
        bar.close()
        engine.step_observers.remove(recorder)
    results = driver.results
    duration = max((r.arrival_s + (r.e2e_s or 0.0) for r in results.values()), default=0.0)
    counters = EngineCounters.between(before, engine.stats())
    ordered = [results[r.index] for r in sorted(requests, key=lambda r: r.index)]
    return Capture(ordered, duration, recorder.samples, counters, recorder.timeline)


class TurnClock:
    """An engine's clock when several engines take turns on one host (`run_lockstep`): wall time
    that runs only during this engine's turns (`with clock.turn(): ...`), so that its steps, its
    requests' latencies and its run's duration count its own work alone. Waiting for an arrival
    jumps ahead at once: an idle engine would only have slept."""

    def __init__(self) -> None:
        self._elapsed = 0.0  # over the turns that have ended, plus the jumps
        self._since: float | None = None  # when the current turn began

    def __call__(self) -> float:
        return self._elapsed + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def wait_until(self, t: float) -> None:
        self._elapsed += max(0.0, t - self())

    @contextmanager
    def turn(self) -> Iterator[None]:
        if self._since is not None:
            raise RuntimeError("this clock's turn has already begun")
        self._since = time.perf_counter()
        try:
            yield
        finally:
            self._elapsed += time.perf_counter() - self._since
            self._since = None
