"""Scheduler and block manager on CPU, stepped by the engine's own loop with a fake model runner: invariants
as property tests."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inflight.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SchedulingPolicy
from inflight.engine.block_manager import NULL_BLOCK, BlockManager
from inflight.engine.engine import EngineParts, LLMEngine
from inflight.engine.runner import RunnerTimings
from inflight.engine.scheduler import Scheduler, SchedulerOutput
from inflight.engine.static import StaticScheduler
from inflight.errors import ConfigError, InvalidRequestError
from inflight.request import FinishReason, Request, RequestStatus, SamplingParams


def fake_token_at(request_id: str, position: int) -> int:
    """The 'model': a token determined by the request and its position only, repeating every 12
    positions three times in four (so that n-gram proposals find matches, and miss some)."""
    period = position % 12 if hash((request_id, position)) % 4 else position
    return hash((request_id, period)) % 1000 + 10


def fake_token(request: Request) -> int:
    """The fake model's next token for `request`."""
    return fake_token_at(request.request_id, request.num_tokens)


# What the engine needs to know of the model here: only how long a request may grow.
_FAKE_MODEL = ModelConfig("llama", vocab_size=6000, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=2, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4,
                          max_position_embeddings=1 << 20)


class _FakeRunner:
    """Stands in for the model runner: hands each step to the driver, which answers for the model."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.last_timings = RunnerTimings()
        self.last_logprobs: dict = {}
        self.last_prompt_logprobs: dict = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        return self.driver.on_step(out)


class _FakeDrafter:
    """A draft model's stand-in: the fake model's own next tokens, but one in three wrong; each
    pass priced at a small fixed time."""

    last_s = 0.0

    def __init__(self) -> None:
        self.held: set[str] = set()

    def propose(self, wanted: dict[Request, int]) -> dict[Request, list[int]]:
        self.held.update(r.request_id for r in wanted)
        return {r: [fake_token_at(r.request_id, r.num_tokens + j) + (j % 3 == 2) for j in range(n)]
                for r, n in wanted.items()}

    def cost(self, lengths) -> float:
        return 1e-5 * max((n for _, n in lengths), default=0)

    def forget(self, request_id: str) -> None:
        self.held.discard(request_id)


class Driver:
    """The engine's own step loop (`LLMEngine` with a fake runner and no tokenizer) over the real
    scheduler and block manager; checks invariants at every step."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 prefix_caching: bool = True, static: bool = False, policy: SchedulingPolicy | None = None,
                 sliding_window: int | None = None) -> None:
        policy = policy or (SchedulingPolicy.STATIC if static else SchedulingPolicy.CONTINUOUS)
        self.config = config = dataclasses.replace(config, scheduling_policy=policy)
        self.window = sliding_window
        cache = CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching)
        model = dataclasses.replace(_FAKE_MODEL, sliding_window=sliding_window)
        parts = EngineParts(_FakeRunner(self), num_blocks, "fake", model, check_token_ids=False)
        self.engine = LLMEngine(EngineConfig(cache=cache, scheduler=config), parts=parts)
        self.scheduler = self.engine.scheduler
        self.bm = self.engine.block_manager
        self.steps: list[SchedulerOutput] = []
        self.admission_order: list[str] = []
        self.finished: list[Request] = []

    def add(self, request: Request) -> None:
        self.engine.enqueue_request(request)

    def on_step(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """A step as the runner sees it: checked, recorded, and answered with fake tokens (proposed
        ones kept while they are the fake model's, then its own)."""
        self.check_step(out)
        for s in out.scheduled:
            if s.start == s.request.num_cached_tokens and s.request.request_id not in self.admission_order:
                self.admission_order.append(s.request.request_id)
        self.steps.append(out)
        answers = {}
        for s in out.scheduled:
            if s.samples_next_token:
                request, tokens = s.request, []
                for j in range(len(s.spec_token_ids) + 1):
                    tokens.append(fake_token_at(request.request_id, request.num_tokens + j))
                    if j == len(s.spec_token_ids) or tokens[-1] != s.spec_token_ids[j]:
                        break
                answers[request.request_id] = tokens
        return answers

    def step(self) -> SchedulerOutput:
        """One engine step; returns what the scheduler gave the runner (empty if nothing ran)."""
        num_steps = len(self.steps)
        outputs = self.engine.step()
        self.finished.extend(o.request for o in outputs if o.finished)
        self.bm.check_invariants()
        return self.steps[-1] if len(self.steps) > num_steps else SchedulerOutput(step_id=-1, scheduled=[])

    def check_step(self, out: SchedulerOutput) -> None:
        cfg = self.config
        assert len(out.scheduled) <= cfg.max_batch_size
        if not isinstance(self.scheduler, StaticScheduler):
            assert out.num_scheduled_tokens <= cfg.max_num_tokens
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            assert s.start == s.request.num_computed_tokens
            assert s.end <= s.request.num_tokens + len(s.spec_token_ids)
            assert not s.spec_token_ids or s.samples_next_token
            assert len(s.block_table) * self.bm.block_size >= s.end, "KV slots missing for scheduled tokens"
            # Every position the step's tokens attend to is in a held block (a window lets go of
            # the blocks before it, no others).
            first = 0 if self.window is None else max(0, s.start - self.window + 1)
            bs = self.bm.block_size
            assert all(s.block_table[p // bs] != NULL_BLOCK for p in range(first, s.end)), "a visible block released"

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return
            self.step()
        raise AssertionError("requests did not all finish")


def make_request(i: int, prompt_len: int, max_tokens: int, prefix: list[int] | None = None,
                 priority: int = 0, n: int = 1) -> Request:
    prompt = (prefix or []) + [(i * 7919 + j) % 5000 + 10 for j in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n), priority=priority)


def expected_tokens(request: Request) -> list[int]:
    """The tokens the fake model gives this request when it runs alone."""
    probe = Request(request.request_id, list(request.prompt_token_ids), request.sampling_params)
    while probe.num_output_tokens < probe.sampling_params.max_tokens:
        probe.output_token_ids.append(fake_token(probe))
    return probe.output_token_ids


workloads = st.lists(
    # prompt, output, arrival step, priority (the priority policy's), samples (n)
    st.tuples(st.integers(1, 80), st.integers(1, 40), st.integers(0, 6), st.integers(0, 3), st.integers(1, 3)),
    min_size=1, max_size=16,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads,
    max_batch_size=st.integers(1, 8),
    max_num_tokens=st.integers(8, 128),
    block_size=st.sampled_from([1, 4, 16]),
    num_blocks=st.integers(8, 64),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    shared_prefix=st.integers(0, 40),
    policy=st.sampled_from(list(SchedulingPolicy)),
    max_bypass=st.integers(1, 4),
    window=st.sampled_from([None, None, 5, 24]),
    speculate=st.sampled_from([None, None, (1, True, "ngram"), (3, True, "ngram"), (4, False, "ngram"),
                               (3, False, "suffix"), (3, True, "draft_model"), (2, False, "draft_model")]),
)
def test_scheduler_invariants(workload, max_batch_size, max_num_tokens, block_size, num_blocks,
                              chunked, prefix_caching, shared_prefix, policy, max_bypass, window, speculate):
    slo = policy is SchedulingPolicy.SLO
    chunked = chunked or slo  # the SLO policy cuts prompts by its budget
    # n-gram proposals of k tokens, their lengths chosen each step (adaptive) or all verified.
    spec = None
    if speculate is not None and policy is not SchedulingPolicy.STATIC:
        spec = {"method": speculate[2], "num_speculative_tokens": speculate[0], "adaptive": speculate[1]}
        spec.update({"model": "fake"} if speculate[2] == "draft_model" else {"prompt_lookup_min": 1})
    # Targets are read by the SLO policy only (its order and budget then follow wall-clock steps).
    config = SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                             max_model_len=4096, enable_chunked_prefill=chunked, priority_max_bypass=max_bypass,
                             ttft_slo_ms=50, tbt_slo_ms=5, speculative_config=spec)
    d = Driver(config, num_blocks, block_size, prefix_caching, policy=policy, sliding_window=window)
    drafter = None
    if d.engine.speculator is not None and speculate[2] == "draft_model":
        drafter = d.engine.speculator.drafter = _FakeDrafter()
    prefix = [3] * shared_prefix
    pending = []
    for i, (prompt_len, out_len, arrival, priority, n) in enumerate(workload):
        priority = priority if policy in (SchedulingPolicy.PRIORITY, SchedulingPolicy.SLO) else 0
        n = 1 if policy is SchedulingPolicy.STATIC else min(n, max_batch_size)
        pending.append((arrival, make_request(i, prompt_len, out_len, prefix, priority, n)))
    accepted: list[Request] = []
    arrival_order: list[str] = []
    step = 0
    while pending or d.scheduler.num_unfinished:
        for arrival, r in [p for p in pending if p[0] <= step]:
            pending.remove((arrival, r))
            try:
                d.add(r)
            except InvalidRequestError:
                continue  # can never fit this pool / budget: rejected on arrival
            accepted.append(r)
            arrival_order.append(r.request_id)
        d.step()
        step += 1
        assert step < 20_000, "requests did not all finish"

    assert all(len(r.samples) == r.sampling_params.n - 1 for r in accepted), "every prompt forks its samples"
    accepted += [sample for r in accepted for sample in r.samples]
    assert all(r.status is RequestStatus.FINISHED for r in accepted)
    assert d.bm.num_used_blocks == 0, "blocks leaked after every request ended"
    assert drafter is None or not drafter.held, "the drafter was not told a request ended"
    if policy not in (SchedulingPolicy.PRIORITY, SchedulingPolicy.SLO):
        # Admission is first-come first-served (preempted requests re-enter at the head).
        assert [r for r in d.admission_order if "#" not in r] == arrival_order
    for r in accepted:
        assert r.output_token_ids == expected_tokens(r), "preemption or chunking changed the tokens"
        if not chunked and r.num_preemptions == 0:
            first = next(s for s in d.steps for x in s.scheduled if x.request is r)
            mine = next(x for x in first.scheduled if x.request is r)
            assert mine.end == r.num_prompt_tokens, "without chunked prefill a prompt runs whole"


def test_finished_request_frees_blocks_and_waiting_request_joins_next_step():
    config = SchedulerConfig(max_batch_size=2, max_num_tokens=64, max_model_len=512)
    d = Driver(config, num_blocks=64, block_size=4)
    short, long_, waiting = make_request(0, 8, 2), make_request(1, 8, 10), make_request(2, 8, 4)
    for r in (short, long_, waiting):
        d.add(r)
    d.step()  # prefill of both: first token each
    out = d.step()  # short gets its second token and finishes at this step (k)
    assert short.is_finished and d.bm.block_table(short.request_id) == []
    assert all(s.request is not waiting for s in out.scheduled)
    nxt = d.step()  # step k+1: the waiting request is in
    assert any(s.request is waiting for s in nxt.scheduled)


def test_chunked_prefill_progresses_while_decodes_keep_moving():
    config = SchedulerConfig(max_batch_size=4, max_num_tokens=16, max_model_len=512)
    d = Driver(config, num_blocks=128, block_size=4)
    decoding = make_request(0, 4, 30)
    d.add(decoding)
    d.step()
    long_prompt = make_request(1, 100, 2)
    d.add(long_prompt)
    progress = []
    while not long_prompt.output_token_ids:
        out = d.step()
        assert any(s.request is decoding and s.is_decode for s in out.scheduled), "the decode stalled"
        progress.append(long_prompt.num_computed_tokens)
    assert progress == sorted(progress) and len(progress) > 1
    assert max(s.num_scheduled_tokens for s in d.steps) <= 16


def test_unchunked_prompt_longer_than_budget_is_rejected():
    config = SchedulerConfig(max_num_tokens=32, enable_chunked_prefill=False)
    s = Scheduler(config, BlockManager(64, 16))
    with pytest.raises(InvalidRequestError, match="max_num_tokens"):
        s.add_request(make_request(0, 40, 4))


def test_request_that_can_never_fit_is_rejected():
    s = Scheduler(SchedulerConfig(max_model_len=100), BlockManager(4, 16))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        s.add_request(make_request(0, 90, 20))
    with pytest.raises(InvalidRequestError, match="KV cache"):
        s.add_request(make_request(1, 60, 20))


def test_preemption_under_kv_pressure_then_same_tokens():
    config = SchedulerConfig(max_batch_size=8, max_num_tokens=256, max_model_len=512)
    d = Driver(config, num_blocks=12, block_size=4, prefix_caching=False)
    requests = [make_request(i, 6, 20) for i in range(6)]
    for r in requests:
        d.add(r)
    d.run()
    assert d.scheduler.num_preemptions > 0
    assert d.bm.num_allocation_failures > 0
    assert d.bm.peak_used_blocks <= 12
    for r in requests:
        assert r.output_token_ids == expected_tokens(r)


def test_prefix_cache_shares_blocks_and_skips_compute():
    config = SchedulerConfig(max_batch_size=4, max_num_tokens=512, max_model_len=512)
    d = Driver(config, num_blocks=64, block_size=4)
    prefix = list(range(100, 132))  # 8 full blocks
    first = make_request(0, 5, 3, prefix)
    d.add(first)
    d.run()
    second = make_request(1, 5, 3, prefix)
    d.add(second)
    out = d.step()
    [mine] = [s for s in out.scheduled if s.request is second]
    assert second.num_cached_tokens == 32 and mine.start == 32
    d.run()
    assert second.output_token_ids == expected_tokens(second)
    assert d.scheduler.prefix_cache_hits == 32


def test_shared_blocks_counted_by_reference():
    bm = BlockManager(16, 4)
    a = make_request(0, 0, 1, list(range(8)) + [50])
    b = make_request(1, 0, 1, list(range(8)) + [60])
    assert bm.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    hits = bm.get_computed_blocks(b)
    assert hits == bm.block_table(a.request_id)[:2]
    assert bm.allocate_slots(b, b.num_tokens, hits)
    bm.check_invariants()
    assert bm.num_used_blocks == 4  # 2 shared + 1 tail each
    bm.free(a.request_id)
    bm.free(b.request_id)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_lru_eviction_prefers_least_recently_freed():
    bm = BlockManager(4, 2)
    a = make_request(0, 0, 1, [1, 2, 3, 4, 9])
    assert bm.allocate_slots(a, 4)
    head, tail = bm.block_table(a.request_id)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    bm.free(a.request_id)
    # Free queue: the two never-used blocks, then a's tail, then a's head. A request needing
    # three blocks takes the unused ones and evicts a's tail; the shared-prefix head survives.
    c = make_request(1, 6, 1)
    assert bm.allocate_slots(c, 6)
    assert tail in bm.block_table(c.request_id) and head not in bm.block_table(c.request_id)
    bm.free(c.request_id)
    assert bm.get_computed_blocks(a) == [head]


def test_static_policy_holds_slots_until_the_batch_ends():
    config = SchedulerConfig(max_batch_size=3, max_num_tokens=64, max_model_len=512,
                             scheduling_policy="static")
    d = Driver(config, num_blocks=64, block_size=4, static=True)
    short, long_, late = make_request(0, 4, 2), make_request(1, 9, 12), make_request(2, 4, 2)
    for r in (short, long_):
        d.add(r)
    first = d.step()
    assert first.num_wasted_tokens == 9 - 4  # padding of the shorter prompt
    reserved = d.bm.num_used_blocks
    assert reserved == d.bm.num_blocks_for(4 + 2) + d.bm.num_blocks_for(9 + 12)
    d.add(late)
    idle_steps = 0
    while not long_.is_finished:
        short_was_done = short.is_finished
        out = d.step()
        assert all(s.request is not late for s in out.scheduled), "static admitted into a running batch"
        if short_was_done:
            idle_steps += 1
            assert out.num_wasted_tokens == 1
        if short.is_finished and not long_.is_finished:
            assert d.bm.num_used_blocks == reserved, "static released a slot before the batch ended"
    assert idle_steps > 0
    out = d.step()
    assert [s.request for s in out.scheduled] == [late]
    d.run()
    assert d.bm.num_used_blocks == 0


def test_abort_frees_blocks():
    config = SchedulerConfig(max_batch_size=4, max_num_tokens=64, max_model_len=512)
    d = Driver(config, num_blocks=32, block_size=4)
    r = make_request(0, 10, 50)
    d.add(r)
    d.step()
    assert d.bm.num_used_blocks > 0
    assert d.engine.abort(r.request_id)
    assert d.bm.num_used_blocks == 0 and r.finish_reason is FinishReason.ABORT


@pytest.mark.parametrize("bad", [
    {"max_batch_size": 0}, {"max_num_tokens": 0}, {"max_model_len": 1}, {"scheduling_policy": "fifo"},
])
def test_invalid_scheduler_config(bad):
    with pytest.raises(ConfigError):
        SchedulerConfig(**bad)


def _thrash_run(cooldown_steps: int, guaranteed_no_evict: bool = False) -> Driver:
    config = SchedulerConfig(max_batch_size=16, max_num_tokens=256, max_model_len=512,
                             preemption_cooldown_steps=cooldown_steps, guaranteed_no_evict=guaranteed_no_evict)
    d = Driver(config, num_blocks=64, block_size=4, prefix_caching=False)
    for i in range(24):
        d.add(make_request(i, 8, 100))
    d.run()
    assert d.bm.num_used_blocks == 0
    return d


def test_preemption_thrash_guard_cuts_recompute():
    unguarded, guarded = _thrash_run(0), _thrash_run(32)

    def figures(d: Driver) -> tuple[int, int, int]:
        recomputed = sum(s.num_scheduled_tokens for s in d.steps) - sum(r.num_tokens - 1 for r in d.finished)
        return d.scheduler.num_preemptions, max(r.num_preemptions for r in d.finished), recomputed

    (pre_u, worst_u, waste_u), (pre_g, worst_g, waste_g) = figures(unguarded), figures(guarded)
    assert pre_u > 0 and pre_g < pre_u and worst_g < worst_u and waste_g < waste_u
    for d in (unguarded, guarded):
        for r in d.finished:
            assert r.output_token_ids == expected_tokens(r)


def test_guaranteed_no_evict_never_preempts_and_holds_each_request_to_its_maximum():
    # 24 requests of 8 + 100 tokens (27 blocks of 4 each at the end) over a pool of 64 blocks:
    # optimistic admission overcommits and preempts; reserving each whole length holds 2 at once.
    d = _thrash_run(32, guaranteed_no_evict=True)
    assert d.scheduler.num_preemptions == 0 and len(d.finished) == 24
    assert max(len(s.scheduled) for s in d.steps) == 64 // 27
    for r in d.finished:
        assert r.output_token_ids == expected_tokens(r)
    assert _thrash_run(32).scheduler.num_preemptions > 0  # the same load, admitted optimistically


def test_readmitted_request_is_not_the_automatic_next_victim():
    config = SchedulerConfig(max_batch_size=8, max_num_tokens=256, max_model_len=512)
    s = Scheduler(config, BlockManager(64, 4, enable_prefix_caching=False))
    old, young = make_request(0, 8, 50), make_request(1, 8, 50)
    s.running = [young, old]  # old was preempted and re-admitted after young
    assert s.pick_victim(young, set()) is young
    assert s.pick_victim(old, set()) is young


@pytest.mark.parametrize("policy", [SchedulingPolicy.CONTINUOUS, SchedulingPolicy.PRIORITY])
def test_a_prompt_holds_batch_slots_for_the_samples_it_will_fork(policy: SchedulingPolicy) -> None:
    # A prompt of n=3 is admitted into a batch of 3; a request behind it must not take the slots
    # its samples will need once its prefill is done (the batch would hold 4).
    config = SchedulerConfig(max_batch_size=3, max_num_tokens=64, max_model_len=4096)
    d = Driver(config, num_blocks=64, block_size=4, policy=policy)
    d.add(make_request(0, 20, 4, n=3))
    d.add(make_request(1, 5, 4))
    first = d.step()
    assert [s.request.request_id for s in first.scheduled] == ["r0"]
    d.run()
    assert {r.request_id for r in d.finished} == {"r0", "r0#1", "r0#2", "r1"}
    assert max(len(s.scheduled) for s in d.steps) == 3
