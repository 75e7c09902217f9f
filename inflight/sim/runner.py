"""The simulator's model runner: it takes the scheduler's plain-data step where `ModelRunner`
would, computes nothing, advances a virtual clock by the cost model's step time and returns a
token for every request that reached its last known token (and, with speculative decoding, the
proposed tokens its draws keep)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from inflight.engine.runner import RunnerTimings
from inflight.engine.scheduler import SchedulerOutput
from inflight.engine.speculative import draft_passes
from inflight.perf.cost_model import CostModel
from inflight.request import Request, TokenLogprobs

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


class SimProposals:
    """The simulator's speculative proposals: k stand-in tokens, found at each lookup with chance
    `proposal_rate` (seeded draws; 1: always), as an n-gram or suffix lookup finds none where a
    request's text stops repeating itself. What the model keeps of them is the runner's draw at
    the acceptance rate."""

    def __init__(self, proposal_rate: float = 1.0, seed: int = 1) -> None:
        self.proposal_rate = proposal_rate
        self._rng = random.Random(seed)

    def __call__(self, request: Request, k: int) -> list[int]:
        if self.proposal_rate < 1 and self._rng.random() >= self.proposal_rate:
            return []
        return [SIM_TOKEN] * k


class SimDrafter:
    """A draft model in the simulator: stand-in tokens, its passes (`draft_passes`: each request
    one token behind, as after a verifying step) priced by the draft's cost model on the virtual
    clock. What the target keeps of them is the runner's draw, as for any proposer."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.last_s = 0.0

    def cost(self, lengths: Sequence[tuple[Request, int]]) -> float:
        return sum(self.cost_model.step_time(work) for work in draft_passes(lengths, lambda _: 1))

    def propose(self, wanted: dict[Request, int]) -> dict[Request, list[int]]:
        self.last_s = self.cost(list(wanted.items()))
        self.clock.advance(self.last_s)
        return {request: [SIM_TOKEN] * n for request, n in wanted.items() if n > 0}

    def forget(self, request_id: str) -> None:
        pass


class SimRunner:
    """`LLMEngine`'s runner in the simulator: the step's whole cost counts as its forward pass.
    With speculative decoding, each proposed token is kept with chance `acceptance_rate` once the
    ones before it were (seeded draws, so a run repeats)."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock, acceptance_rate: float | None = None,
                 seed: int = 0) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.acceptance_rate = acceptance_rate
        self._rng = random.Random(seed)
        self.last_timings = RunnerTimings()
        self.last_logprobs: dict[str, list[TokenLogprobs]] = {}  # the simulator has no distribution
        self.last_prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        batch = out.work()
        step_s = self.cost_model.step_time(batch)
        self.clock.advance(step_s)
        self.last_timings = RunnerTimings(forward_s=step_s)
        return {s.request.request_id: [SIM_TOKEN] * (1 + self._kept(len(s.spec_token_ids)))
                for s in out.scheduled if s.samples_next_token}

    def _kept(self, proposed: int) -> int:
        kept = 0
        while kept < proposed and self._rng.random() < (self.acceptance_rate or 0.0):
            kept += 1
        return kept
