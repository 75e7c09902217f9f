"""Priority scheduling: continuous batching where urgent requests go first and may preempt.

- **Order.** A lower `priority` is more urgent (vLLM's convention; the default is 0). Waiting
  requests are taken most urgent first and, among equals, in the FCFS policy's own order
  (arrival, with preempted requests back at the front).
- **Preemption.** When the most urgent waiting request cannot start because the batch
  (`max_batch_size`) or the KV pool is full, the least urgent running request that is less
  urgent than it is preempted (its blocks freed, its tokens recomputed when it returns, counted
  in `num_preemptions`), again and again until it fits or no such request is left. When the pool
  runs short while running requests grow, the victim is likewise the least urgent one (the
  latest arrival among equals, as in FCFS).
- **Aging.** Each time a waiting request is overtaken by one behind it in FCFS order, it counts a
  bypass; after `priority_max_bypass` of them it is served as the most urgent class until it
  ends (taken first, never preempted for priority). So no request waits behind more than that
  many later ones, whatever the traffic. Counting bypasses rather than seconds keeps that bound
  independent of how fast the machine is, and leaves equal priorities exactly FCFS: there,
  nobody overtakes anybody.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from inflight.config import SchedulerConfig
from inflight.engine.block_manager import BlockManager
from inflight.engine.scheduler import Scheduler, SchedulerOutput, batch_slots
from inflight.request import FinishReason, Request


class PriorityScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(config, block_manager, clock)
        self._bypasses: dict[str, int] = {}

    def urgency(self, request: Request) -> float:
        """Lower is more urgent: the request's priority, or minus infinity once it has been
        bypassed `priority_max_bypass` times."""
        if self._bypasses.get(request.request_id, 0) >= self.config.priority_max_bypass:
            return -math.inf
        return request.priority

    def _victim_rank(self, request: Request) -> tuple[float, float]:
        return self.urgency(request), request.arrival_time

    # --- the hooks of Scheduler -----------------------------------------------------------------

    def next_waiting(self) -> Request:
        return min(self.waiting, key=self.urgency)  # the first of equals: FCFS order among them

    def take_waiting(self, request: Request) -> None:
        for ahead in self.waiting:  # all less urgent than `request`, or it would not be next
            if ahead is request:
                break
            self._bypasses[ahead.request_id] = self._bypasses.get(ahead.request_id, 0) + 1
        self.waiting.remove(request)

    def pick_victim(self, request: Request, scheduled_ids: set[int]) -> Request:
        others = [r for r in self.running if id(r) not in scheduled_ids and r is not request]
        return max([*others, request], key=self._victim_rank)

    def finish(self, request: Request, reason: FinishReason) -> None:
        super().finish(request, reason)
        self._bypasses.pop(request.request_id, None)

    # --- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = self.new_output()
        self._make_room(out)
        made_room = len(out.preempted)
        budget = self._schedule_running(out, self.step_token_budget())
        if len(out.preempted) == made_room:  # no admission while the pool is short
            self._admit(out, budget)
        return out

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempts less urgent running requests while the most urgent waiting one cannot start
        for want of a batch slot or of KV blocks."""
        if not self.waiting:
            return
        head = self.next_waiting()
        rank = self.urgency(head)
        last_preemption = self._last_preemption_step
        while not self._can_start(head):
            less_urgent = [r for r in self.running if self.urgency(r) > rank]
            if not less_urgent:
                break
            self._preempt(max(less_urgent, key=self._victim_rank), out)
        # Making room for priority is not the pool running dry: no throttle on admission after it.
        self._last_preemption_step = last_preemption

    def _can_start(self, request: Request) -> bool:
        """Whether `request` could be admitted this step: a batch slot, and KV blocks for the
        chunk it would get next to the running decodes, as `_admit` judges them."""
        if batch_slots(request) > self.free_batch_slots():
            return False
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        pressure = self._under_pressure()
        reserve = self._outstanding_growth() if pressure else self._watermark_blocks
        return self._admission(request, max(1, self.step_token_budget() - decodes), reserve, pressure) is not None
