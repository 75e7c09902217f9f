"""The simulator's model runner: it takes the scheduler's plain-data step where `ModelRunner`
would, computes nothing, advances a virtual clock by the cost model's step time and returns a
token for every request that reached its last known token."""

from __future__ import annotations

from inflight.engine.scheduler import SchedulerOutput
from inflight.sim.cost_model import CostModel, SeqWork

# Any id will do: output tokens only feed the prefix cache's chained block hashes, which start
# from each request's own prompt.
SIM_TOKEN = 0


class VirtualClock:
    """Seconds since the start of the simulated run."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class SimRunner:
    def __init__(self, cost_model: CostModel, clock: VirtualClock) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.last_step_s = 0.0

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        batch = [SeqWork(s.num_new_tokens, s.end, s.samples_next_token) for s in out.scheduled]
        self.last_step_s = self.cost_model.step_time(batch)
        self.clock.advance(self.last_step_s)
        return {s.request.request_id: SIM_TOKEN for s in out.scheduled if s.samples_next_token}
