"""The simulator's model runner: it takes the scheduler's plain-data step where `ModelRunner`
would, computes nothing, advances a virtual clock by the cost model's step time and returns a
token for every request that reached its last known token."""

from __future__ import annotations

from inflight.engine.runner import RunnerTimings
from inflight.engine.scheduler import SchedulerOutput
from inflight.perf.cost_model import CostModel
from inflight.request import TokenLogprobs

# Any id will do: output tokens only feed the prefix cache's chained block hashes, which start
# from each request's own prompt.
SIM_TOKEN = 0


class VirtualClock:
    """Seconds since the start of the simulated run; called, it reads like `time.perf_counter`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    wait_until = advance_to  # what a driver does between arrivals: no time is spent waiting


class SimRunner:
    """`LLMEngine`'s runner in the simulator: the step's whole cost counts as its forward pass."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.last_timings = RunnerTimings()
        self.last_logprobs: dict[str, list[TokenLogprobs]] = {}  # the simulator has no distribution
        self.last_prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        batch = out.work()
        step_s = self.cost_model.step_time(batch)
        self.clock.advance(step_s)
        self.last_timings = RunnerTimings(forward_s=step_s)
        return {s.request.request_id: [SIM_TOKEN] for s in out.scheduled if s.samples_next_token}
