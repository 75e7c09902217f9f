"""SLO-aware scheduling: the priority policy, with a token budget that follows the TBT target and
waiting requests ordered by their TTFT deadlines.

- **Budget.** Each step's token budget is the largest (up to `max_num_tokens`) whose predicted
  step time stays under `tbt_slo_ms`: the running decodes are counted first, and a prefill chunk
  takes what they leave (at least `MIN_PREFILL_CHUNK` tokens, so that a prompt always advances).
  Likewise the batch admits no more requests than decode together within the target.
  The prediction is the roofline cost model (`inflight.perf`) on a hardware profile, times a
  correction refitted after every step from the engine's own step times (the mean of
  measured / predicted over the last steps), so that it follows the machine it runs on.
- **Order.** Waiting requests go by urgency (priority, with the priority policy's aging), then
  by slack: the deadline (arrival + `ttft_slo_ms`) minus now minus the predicted time of the
  request's own prefill, least first. A request whose slack is already negative cannot make its
  deadline: it goes after every request that still can, so that they do (and is served after).
- **Late requests.** With `reject_late`, a request that would already miss its TTFT deadline on
  arrival, judged by the prefill work queued ahead of it at the current budget, is refused
  (`LateRequestError`, a 429 with Retry-After over HTTP) instead of taking room from those that
  can still make theirs.

Everything else (preemption for priority, aging, admission under the KV pool) is the priority
policy's; with neither target set this is the priority policy.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from inflight.config import SchedulerConfig
from inflight.engine.block_manager import BlockManager
from inflight.engine.priority import PriorityScheduler
from inflight.errors import EngineOverloadedError
from inflight.perf.cost_model import SeqWork, StepTimeModel
from inflight.request import FinishReason, Request

MIN_PREFILL_CHUNK = 16
_HISTORY = 32  # steps the correction is averaged over


class LateRequestError(EngineOverloadedError):
    """A request that can no longer meet its TTFT target; worth retrying after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StepTimePredictor:
    """Seconds of a step, from its composition: a cost model, scaled by how the engine's recent
    steps compared with it."""

    def __init__(self, cost_model: StepTimeModel) -> None:
        self.cost_model = cost_model
        self._ratios: deque[float] = deque(maxlen=_HISTORY)

    @property
    def correction(self) -> float:
        return math.fsum(self._ratios) / len(self._ratios) if self._ratios else 1.0

    def __call__(self, batch: Sequence[SeqWork]) -> float:
        return self.cost_model.step_time(batch) * self.correction

    def observe(self, batch: Sequence[SeqWork], measured_s: float) -> None:
        predicted = self.cost_model.step_time(batch)
        if predicted > 0 and measured_s > 0:
            self._ratios.append(min(10.0, max(0.1, measured_s / predicted)))

    def prefill_s(self, num_tokens: int) -> float:
        """A prefill of `num_tokens` alone."""
        return self([SeqWork(num_tokens, num_tokens, True)])


class SLOScheduler(PriorityScheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, predictor: StepTimePredictor,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(config, block_manager, clock)
        self.predictor = predictor
        self._ttft_s = config.ttft_slo_ms / 1e3 if config.ttft_slo_ms is not None else None
        self._tbt_s = config.tbt_slo_ms / 1e3 if config.tbt_slo_ms is not None else None
        self._prefill_s: dict[str, tuple[int, float]] = {}  # request id -> (tokens, predicted prefill)
        self.last_budget = config.max_num_tokens
        self._budget_step = self._limit_step = -1
        self.last_batch_limit = config.max_batch_size
        self.num_rejected_late = 0

    # --- the budget -----------------------------------------------------------------------------

    def step_token_budget(self) -> int:
        """Computed once per step (the priority policy asks again while it makes room)."""
        if self._budget_step != self._step_id:
            self._budget_step, self.last_budget = self._step_id, self._budget()
        return self.last_budget

    def _budget(self) -> int:
        cfg, target = self.config, self._tbt_s
        if target is None:
            return cfg.max_num_tokens
        decodes = [SeqWork(1, r.num_tokens, True) for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        room = cfg.max_num_tokens - len(decodes)
        if room <= MIN_PREFILL_CHUNK:
            return cfg.max_num_tokens
        # The chunk continues the furthest prompt under way, if any (its attention reads that context).
        start = max((r.num_computed_tokens for r in self.running if r.num_tokens - r.num_computed_tokens > 1),
                    default=0)

        def fits(chunk: int) -> bool:
            return self.predictor([*decodes, SeqWork(chunk, start + chunk, True)]) <= target

        low, high = MIN_PREFILL_CHUNK, room  # the largest chunk whose step fits the target
        if fits(high):
            low = high
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        return len(decodes) + low

    def free_batch_slots(self) -> int:
        """Also no more requests than decode together within the TBT target: past that, each one
        admitted would slow every running stream beyond it."""
        free = super().free_batch_slots()
        if self._tbt_s is None:
            return free
        if self._limit_step != self._step_id:
            self._limit_step, self.last_batch_limit = self._step_id, self._tbt_batch_limit()
        taken = self.config.max_batch_size - free
        return min(free, self.last_batch_limit - taken)

    def _tbt_batch_limit(self) -> int:
        """The most decodes, at the running requests' mean context, that one step takes within
        the TBT target (at least 1)."""
        assert self._tbt_s is not None
        contexts = [r.num_tokens for r in self.running] or [r.num_tokens for r in self.waiting] or [1]
        context = max(1, sum(contexts) // len(contexts))
        low, high = 1, self.config.max_batch_size
        while low < high:
            mid = (low + high + 1) // 2
            if self.predictor([SeqWork(1, context, True)] * mid) <= self._tbt_s:
                low = mid
            else:
                high = mid - 1
        return low

    def observe_step(self, work: tuple[SeqWork, ...], duration_s: float) -> None:
        if work:
            self.predictor.observe(work, duration_s)

    # --- the order ------------------------------------------------------------------------------

    def _own_prefill_s(self, request: Request) -> float:
        todo = request.num_tokens - request.num_computed_tokens
        known = self._prefill_s.get(request.request_id)
        if known is None or known[0] != todo:
            known = (todo, self.predictor.prefill_s(todo))
            self._prefill_s[request.request_id] = known
        return known[1]

    def slack_s(self, request: Request, now: float) -> float:
        """Seconds to spare before the request's TTFT deadline, its own prefill counted."""
        if self._ttft_s is None:
            return math.inf
        return request.arrival_time + self._ttft_s - now - self._own_prefill_s(request)

    def next_waiting(self) -> Request:
        if self._ttft_s is None:
            return super().next_waiting()
        now = self.clock()

        def key(r: Request) -> tuple[float, bool, float]:
            slack = self.slack_s(r, now)
            late = slack < 0 and r.num_output_tokens == 0
            return self.urgency(r), late, r.arrival_time if late else slack

        return min(self.waiting, key=key)

    def finish(self, request: Request, reason: FinishReason) -> None:
        super().finish(request, reason)
        self._prefill_s.pop(request.request_id, None)

    # --- admission of new requests --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.config.reject_late and self._ttft_s is not None:
            wait = self.predicted_ttft_s(request)
            if wait > self._ttft_s:
                self.num_rejected_late += 1
                raise LateRequestError(
                    f"the server cannot start this request within its TTFT target ({self._ttft_s * 1e3:.0f} ms; "
                    f"about {wait * 1e3:.0f} ms of queued prefill ahead); retry later", retry_after_s=wait)
        super().add_request(request)

    def predicted_ttft_s(self, request: Request) -> float:
        """The queued prefill work no later in the order than `request`, then its own, at the
        last step's budget: the steps that takes, each at the TBT target (or the predicted time)."""
        ahead = [r for r in self.waiting if self.urgency(r) <= request.priority]
        ahead += [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        tokens = sum(r.num_tokens - r.num_computed_tokens for r in ahead) + request.num_tokens
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        per_step = max(MIN_PREFILL_CHUNK, self.last_budget - decodes)
        steps = math.ceil(tokens / per_step)
        step_s = self._tbt_s if self._tbt_s is not None else self.predictor.prefill_s(per_step)
        return steps * step_s
