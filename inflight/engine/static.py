"""Static batching as a policy of the same engine, so comparisons are honest.

Classic static serving: gather a batch (up to `max_batch_size`) only when the previous one is
done, reserve each request's KV for its maximum length up front, prefill the batch together,
decode until its slowest member finishes, then release everything. A finished request's slot
idles until then; those idle slots and the prompt padding a padded batch would compute are
counted as wasted tokens. inflight does not actually compute the padding, so the static
baseline here is, if anything, faster than a real padded implementation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from inflight.config import SchedulerConfig
from inflight.engine.block_manager import BlockManager
from inflight.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from inflight.request import Request, RequestStatus


class StaticScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(config, block_manager, clock)
        self._batch: list[Request] = []

    def schedule(self) -> SchedulerOutput:
        out = self.new_output()
        if not self._batch:
            self._admit_batch(out)
            return out
        for request in self.running:
            num_new = request.num_tokens - request.num_computed_tokens
            out.scheduled.append(ScheduledRequest(
                request, request.num_computed_tokens, num_new,
                self.block_manager.block_table(request.request_id),
            ))
        out.num_wasted_tokens = len(self._batch) - len(self.running)
        return out

    def _admit_batch(self, out: SchedulerOutput) -> None:
        """The whole batch is prefilled in one step; the token budget does not split it."""
        bm = self.block_manager
        while self.waiting and len(self._batch) < self.config.max_batch_size:
            request = self.waiting[0]
            if not bm.can_allocate(request, request.max_num_tokens):
                break
            bm.allocate_slots(request, request.max_num_tokens)
            self.waiting.popleft()
            self.start_running(request, 0)
            self._batch.append(request)
            out.scheduled.append(ScheduledRequest(
                request, 0, request.num_tokens, bm.block_table(request.request_id)
            ))
        if out.scheduled:
            longest = max(s.num_new_tokens for s in out.scheduled)
            out.num_wasted_tokens = sum(longest - s.num_new_tokens for s in out.scheduled)

    def release_blocks(self, request: Request) -> None:
        """A batch's blocks are freed together, when its last member ends."""
        if request not in self._batch:
            self.block_manager.free(request.request_id)
            return
        if all(r.status is RequestStatus.FINISHED for r in self._batch):
            for member in self._batch:
                self.block_manager.free(member.request_id)
            self._batch.clear()
