"""Iteration-level scheduling: after every step, decide again which requests compute how many
tokens, under `max_batch_size`, `max_num_tokens` and the free KV blocks.

There are no prefill or decode phases: each request has `num_computed_tokens` and
`num_tokens`, and each step hands out tokens so the first catches up with the second. A step
can therefore mix decodes with prefill chunks. Running requests are served first, decodes
before prefill chunks (stall-free), then waiting requests in arrival order. Pure Python.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from inflight.config import SchedulerConfig
from inflight.engine.block_manager import BlockManager
from inflight.engine.speculative import Speculator
from inflight.errors import InvalidRequestError
from inflight.perf.cost_model import SeqWork
from inflight.request import FinishReason, Request, RequestStatus

# Free blocks kept back when admitting, so that running requests can grow for a while before
# the pool runs dry and forces a preemption.
_ADMISSION_WATERMARK = 0.01


def batch_slots(request: Request) -> int:
    """Batch slots a request takes: with n > 1 before its fork, its samples' too."""
    return request.sampling_params.n if request.awaits_fork else 1


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `num_new_tokens` tokens starting at
    `start`, with KV in `block_table`."""

    request: Request
    start: int
    num_new_tokens: int
    block_table: list[int]
    # Speculative decoding: tokens proposed after the request's last known one, computed in this
    # step too (counted in `num_new_tokens`); the model keeps those it agrees with.
    spec_token_ids: list[int] = field(default_factory=list)
    # Whether this step reaches the request's last known token, so that it yields a new one;
    # fixed when the step is scheduled (the request grows by that token afterwards).
    samples_next_token: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples_next_token = self.end == self.request.num_tokens + len(self.spec_token_ids)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """A decode computes one generated token; a prompt's tokens, one or many (a chunk of one
        token included), are prefill. The one meaning: step records count by it, the runner
        packs decodes first by it, and attention reads them in its batched decode call."""
        return self.num_new_tokens == 1 and self.start >= self.request.num_prompt_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Positions whose next-token distribution the step computes: the last known token's and
        each proposed token's, or none for a prompt chunk short of its end."""
        return 1 + len(self.spec_token_ids) if self.samples_next_token else 0


@dataclass(slots=True)
class SchedulerOutput:
    """Plain data describing one step; the runner turns it into tensors."""

    step_id: int
    scheduled: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)
    num_wasted_tokens: int = 0
    # KV blocks to copy (source, destination) before the forward pass: copy on write of a
    # block that forked samples share.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        """A generated token's computation per decoding request (one that verifies proposals too)."""
        return sum(1 for s in self.scheduled if s.is_decode or s.spec_token_ids)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens verified in this step."""
        return sum(len(s.spec_token_ids) for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens - self.num_spec_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def work(self) -> tuple[SeqWork, ...]:
        """Per scheduled request, in order, what a cost model needs of the step."""
        return tuple(SeqWork(s.num_new_tokens, s.end, s.num_sampled_rows) for s in self.scheduled)


class Scheduler:
    """The continuous-batching policy, first come first served. Another policy subclasses it and
    overrides its hooks: `schedule()`; `next_waiting()` and `take_waiting()`, which choose the
    waiting request admitted next; `pick_victim()`, which chooses whom to preempt; and, where it
    holds KV blocks past a request's end, `release_blocks()`. It builds each step with
    `new_output()` and seats a request with `start_running()` (`StaticScheduler` and
    `PriorityScheduler` do)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock` stamps when requests are first scheduled and when they finish."""
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of admitted requests
        self.prefix_cache_hits = 0  # of which found in the prefix cache
        self._step_id = 0
        self._watermark_blocks = int(_ADMISSION_WATERMARK * block_manager.num_blocks)
        self._last_preemption_step = -(10**9)
        # Speculative decoding's proposals and lengths (set by the engine when configured).
        self.speculator: Speculator | None = None

    # --- requests in and out --------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises InvalidRequestError for a request that could never be served."""
        cfg, bm = self.config, self.block_manager
        total = num_prompt_tokens + max_tokens
        if total > cfg.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len ({cfg.max_model_len})"
            )
        if bm.num_blocks_for(total) > bm.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens cannot fit in the KV cache "
                f"({bm.num_blocks} blocks of {bm.block_size} tokens)"
            )
        if not cfg.enable_chunked_prefill and num_prompt_tokens > cfg.max_num_tokens:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) exceeds max_num_tokens ({cfg.max_num_tokens}) "
                "and chunked prefill is off"
            )

    def add_request(self, request: Request) -> None:
        self.check_admissible(request.num_prompt_tokens, request.max_tokens)
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (stop, length, abort, error) and releases its KV blocks."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timings.finished = self.clock()
        self.release_blocks(request)
        if self.speculator is not None:
            self.speculator.forget(request)

    def release_blocks(self, request: Request) -> None:
        """Hook, called once when `request` has finished: frees its KV blocks."""
        self.block_manager.free(request.request_id)

    # --- one step -------------------------------------------------------------------------------

    def new_output(self) -> SchedulerOutput:
        """An empty output for the next step (step ids count from 1)."""
        self._step_id += 1
        return SchedulerOutput(step_id=self._step_id, scheduled=[])

    def step_token_budget(self) -> int:
        """Hook: tokens this step may compute (here `max_num_tokens`; the SLO policy's follows its
        TBT target)."""
        return self.config.max_num_tokens

    def observe_step(self, work: tuple[SeqWork, ...], duration_s: float) -> None:
        """Hook: a step just ran, `work` as `SchedulerOutput.work()` gives it, in `duration_s`."""

    def schedule(self) -> SchedulerOutput:
        out = self.new_output()
        budget = self._schedule_running(out, self.step_token_budget())
        if not out.preempted:  # no admission while the pool is short
            self._admit(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first, then unfinished prefills, each in admission order.
        remaining = {id(r): r.num_tokens - r.num_computed_tokens for r in self.running}
        order = sorted(self.running, key=lambda r: remaining[id(r)] > 1)
        drafts = {}
        if self.speculator is not None:  # its own time, a draft model's passes aside (they are work)
            started = time.perf_counter()
            drafts = self._drafts(order, remaining, budget)
            spent, self.speculator.draft_wall_s = time.perf_counter() - started - self.speculator.draft_wall_s, 0.0
            self.speculator.stats.overhead_s += spent
        scheduled_ids: set[int] = set()
        bm = self.block_manager
        for request in order:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(remaining[id(request)], budget)
            draft = drafts.get(request, [])
            # Proposals only where they fit the budget and the free blocks: never a preemption for one.
            if draft and (num_new + len(draft) > budget
                          or not bm.can_allocate(request, request.num_computed_tokens + num_new + len(draft))):
                draft = []
            if not self._grow(request, num_new + len(draft), scheduled_ids, out):
                continue
            out.scheduled.append(ScheduledRequest(
                request, request.num_computed_tokens, num_new + len(draft), bm.block_table(request.request_id),
                spec_token_ids=draft,
            ))
            scheduled_ids.add(id(request))
            budget -= num_new + len(draft)
        return budget

    def _drafts(self, order: list[Request], remaining: dict[int, int], budget: int) -> dict[Request, list[int]]:
        """The proposed tokens each decoding request verifies this step, as many as the
        speculator chooses within what the budget leaves after every running request's own
        tokens (decodes and prompt chunks go first) and the prompts of the waiting requests the
        batch has slots for (speculation never delays a request's first token by taking its
        prefill's budget)."""
        speculator = self.speculator
        assert speculator is not None
        eligible = [r for r in order if remaining[id(r)] == 1 and r.num_output_tokens > 0]
        if not eligible:
            return {}
        batch, left = [], budget
        for request in [*eligible, *(r for r in order if remaining[id(r)] != 1 or r.num_output_tokens == 0)]:
            n = min(remaining[id(request)], left)
            if n == 0:
                break
            left -= n
            computed = request.num_computed_tokens + n
            batch.append(SeqWork(n, computed, int(computed == request.num_tokens)))
        slots = self.free_batch_slots()
        for request in self.waiting:
            if slots <= 0 or left <= 0:
                break
            left -= request.num_tokens - request.num_computed_tokens
            slots -= batch_slots(request)
        if left <= 0:
            return {}
        # First as if every eligible request had a full proposal: where even that does not pay (a
        # saturated batch), no proposal is looked for at all.
        full = {r: [0] * speculator.max_length(r) for r in eligible}
        if speculator.drafter is not None:  # proposals that cost time: lengths chosen first
            return speculator.draft(speculator.lengths(full, batch, left))
        if not speculator.pays(full, batch, left):
            speculator.declined(eligible)
            return {}
        proposals = {r: speculator.propose(r) for r in eligible}
        # The drafting requests' decodes first, in their order; the others' work stays in the step.
        batch = ([w for r, w in zip(eligible, batch, strict=False) if proposals[r]]
                 + [w for r, w in zip(eligible, batch, strict=False) if not proposals[r]] + batch[len(eligible):])
        proposals = {r: draft for r, draft in proposals.items() if draft}
        if not proposals:
            return {}
        lengths = speculator.lengths(proposals, batch, left)
        return {r: draft[:lengths[r]] for r, draft in proposals.items() if lengths[r]}

    def _grow(self, request: Request, num_new: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Makes room for `num_new` more tokens of a running request, preempting while the
        pool is short. False if the request itself had to be preempted."""
        bm = self.block_manager
        while not bm.allocate_slots(request, request.num_computed_tokens + num_new):
            victim = self.pick_victim(request, scheduled_ids)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def pick_victim(self, request: Request, scheduled_ids: set[int]) -> Request:
        """The most recently admitted running request not yet scheduled in this step, the
        requester included. A re-admitted request keeps the rank of its first admission
        (running requests are ranked by arrival): ranked by its latest admission instead, an
        old request that was preempted once would be the next victim every time it returns."""
        others = [r for r in self.running if id(r) not in scheduled_ids and r is not request]
        return max([*others, request], key=lambda r: r.arrival_time)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._last_preemption_step = self._step_id
        # Ahead of every waiting request, and of requests preempted earlier in this step,
        # which were admitted later than this one.
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def free_batch_slots(self) -> int:
        """Batch slots neither running nor held for the samples a running prompt will fork."""
        return self.config.max_batch_size - sum(batch_slots(r) for r in self.running)

    def _under_pressure(self) -> bool:
        """Whether admission leaves room for the running requests to reach their maximum length:
        shortly after a preemption, or always under guaranteed_no_evict."""
        return (self.config.guaranteed_no_evict
                or self._step_id - self._last_preemption_step <= self.config.preemption_cooldown_steps)

    def _outstanding_growth(self) -> int:
        """Blocks the running requests still need to reach their maximum length."""
        bm = self.block_manager
        return sum(max(0, bm.num_blocks_for(r.max_num_tokens) - len(bm.block_table(r.request_id)))
                   for r in self.running)

    def next_waiting(self) -> Request:
        """Hook: the waiting request to admit next (here the head of the queue)."""
        return self.waiting[0]

    def take_waiting(self, request: Request) -> None:
        """Hook: takes `request`, just admitted, off the waiting queue."""
        assert self.waiting[0] is request
        self.waiting.popleft()

    def _admission(self, request: Request, budget: int, reserve: int,
                   pressure: bool) -> tuple[list[int], int, int, int] | None:
        """How `request` would start within `budget` tokens, keeping `reserve` blocks free:
        (cached blocks, cached tokens, tokens to compute, blocks it may still grow by), or None
        if it cannot start now."""
        cfg, bm = self.config, self.block_manager
        # A request that wants its prompt's log-probabilities computes every prompt position.
        hits = [] if request.needs_prompt_logits else bm.get_computed_blocks(request)
        num_cached = len(hits) * bm.block_size
        num_new = request.num_tokens - num_cached
        if num_new > budget:
            # Without chunked prefill a prompt runs whole or waits; a preempted request
            # whose recompute can never fit one step is chunked regardless.
            if not cfg.enable_chunked_prefill and num_new <= cfg.max_num_tokens:
                return None
            num_new = budget
        growth = 0
        if pressure:
            growth = bm.num_blocks_for(request.max_num_tokens) - bm.num_blocks_for(num_cached + num_new)
        if not bm.can_allocate(request, num_cached + num_new, hits, reserve=reserve + growth):
            return None
        return hits, num_cached, num_new, growth

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        # Shortly after a preemption, admit only what can run to its end next to the running
        # requests' worst-case growth, so the pool is not overcommitted into the next one.
        pressure = self._under_pressure()
        reserve = self._outstanding_growth() if pressure else self._watermark_blocks
        while self.waiting and budget > 0 and self.free_batch_slots() > 0:
            request = self.next_waiting()
            if batch_slots(request) > self.free_batch_slots():
                break  # its samples will need their batch slots next to it
            admission = self._admission(request, budget, reserve, pressure)
            if admission is None:
                break
            hits, num_cached, num_new, growth = admission
            reserve += growth
            bm.allocate_slots(request, num_cached + num_new, hits)
            self.take_waiting(request)
            self.start_running(request, num_cached)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            out.scheduled.append(ScheduledRequest(request, num_cached, num_new, bm.block_table(request.request_id)))
            budget -= num_new

    def start_running(self, request: Request, num_cached: int) -> None:
        """Moves a request just taken off `waiting` into the running batch, its first
        `num_cached` tokens already in its KV blocks."""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = num_cached
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = self.clock()
        self.running.append(request)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Seats `children`, the other samples of `parent`'s prompt, just after the step that
        computed the prompt: each shares the blocks of all prompt tokens but the last, which
        it computes itself for its own first token (writing a private copy of that block)."""
        start = parent.num_prompt_tokens - 1
        for child in children:
            self.block_manager.fork(parent, child, start)
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = child.num_cached_tokens = start
            child.timings.first_scheduled = parent.timings.first_scheduled
            self.running.append(child)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Advances each scheduled request by the tokens computed and appends its new tokens: one,
        or, where proposed tokens were verified, those kept and one more. The KV of proposed
        tokens not kept is void: the request's computed tokens end before them, and the blocks
        past its new length go back to the pool."""
        for s in out.scheduled:
            request = s.request
            tokens = sampled.get(request.request_id, [])
            proposed = len(s.spec_token_ids)
            if proposed:
                accepted = len(tokens) - 1
                assert 0 <= accepted <= proposed and tokens[:accepted] == s.spec_token_ids[:accepted]
                request.num_computed_tokens = s.end - proposed + accepted
                if self.speculator is not None:
                    started = time.perf_counter()
                    self.speculator.observe(request, proposed, accepted)
                    self.speculator.stats.overhead_s += time.perf_counter() - started
            else:
                request.num_computed_tokens = s.end
            request.output_token_ids.extend(tokens)
            if proposed:
                self.block_manager.trim(request, request.num_tokens)
            self.block_manager.cache_full_blocks(request)
