"""The priority policy (inflight/engine/priority.py) on the engine's own loop with a fake runner:
order, preemption of the least urgent, aging, exact FCFS at equal priorities; then one real
server, where urgent requests get into a full batch within a step or two."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import Driver, expected_tokens, make_request, workloads

from inflight import EngineConfig, LLMEngine
from inflight.config import SchedulerConfig, SchedulingPolicy
from inflight.errors import InvalidRequestError
from inflight.request import RequestStatus

PRIORITY = SchedulingPolicy.PRIORITY


def _trace(d: Driver) -> list[tuple[tuple[str, int, int], ...]]:
    return [tuple((s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled) for out in d.steps]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, max_batch_size=st.integers(1, 6), max_num_tokens=st.integers(8, 96),
       num_blocks=st.integers(10, 48), chunked=st.booleans())
def test_equal_priorities_schedule_exactly_as_fcfs(workload, max_batch_size, max_num_tokens, num_blocks, chunked):
    """Same steps, same preemptions, same tokens: with nobody more urgent than anybody, the
    priority policy is FCFS (and its aging never triggers)."""
    config = SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_model_len=4096,
                             enable_chunked_prefill=chunked, priority_max_bypass=1)
    runs = []
    for policy in (SchedulingPolicy.CONTINUOUS, PRIORITY):
        d = Driver(config, num_blocks, 4, policy=policy)
        pending = sorted(((arrival, i, make_request(i, p, o, n=min(n, max_batch_size)))
                          for i, (p, o, arrival, _, n) in enumerate(workload)),
                         key=lambda x: x[:2])
        step = 0
        while pending or d.scheduler.num_unfinished:
            while pending and pending[0][0] <= step:
                try:
                    d.add(pending.pop(0)[2])
                except InvalidRequestError:
                    pass
            d.step()
            step += 1
            assert step < 20_000
        runs.append((_trace(d), {r.request_id: r.output_token_ids for r in d.finished},
                     d.scheduler.num_preemptions))
    assert runs[0] == runs[1]


def _config(**overrides) -> SchedulerConfig:
    return SchedulerConfig(**{"max_batch_size": 4, "max_num_tokens": 256, "max_model_len": 4096, **overrides})


def test_waiting_requests_are_taken_by_priority_then_arrival():
    d = Driver(_config(max_batch_size=1), num_blocks=64, block_size=4, policy=PRIORITY)
    for i, priority in enumerate([2, 0, 1, 0, 2]):
        d.add(make_request(i, 8, 2, priority=priority))
    d.run()
    assert d.admission_order == ["r1", "r3", "r2", "r0", "r4"]
    assert d.scheduler.num_preemptions == 0


def _fill_batch(d: Driver, priorities: list[int], prompt_len: int = 8, out_len: int = 60) -> list:
    running = [make_request(i, prompt_len, out_len, priority=p) for i, p in enumerate(priorities)]
    for r in running:
        d.add(r)
    for _ in range(3):
        d.step()
    assert all(r.status is RequestStatus.RUNNING for r in running)
    return running


def test_an_urgent_request_preempts_the_least_urgent_when_the_batch_is_full():
    d = Driver(_config(), num_blocks=256, block_size=4, policy=PRIORITY)
    running = _fill_batch(d, [1, 3, 2, 3])
    urgent = make_request(9, 8, 3, priority=0)
    d.add(urgent)
    out = d.step()
    assert any(s.request is urgent for s in out.scheduled), "the urgent request waited for a free slot"
    assert out.preempted == [running[3]], "the victim is the least urgent, the latest among equals"
    assert d.scheduler.num_preemptions == 1 and running[3].num_preemptions == 1
    # Equally urgent requests do not preempt: a second priority-3 request waits its turn.
    same = make_request(10, 8, 3, priority=3)
    d.add(same)
    assert not d.step().preempted and same.status is RequestStatus.WAITING
    d.run()
    for r in [*running, urgent, same]:
        assert r.output_token_ids == expected_tokens(r), "preemption changed the tokens"
    assert d.bm.num_used_blocks == 0


def test_an_urgent_request_preempts_for_kv_blocks():
    """A pool full of low-priority requests' blocks (and batch slots to spare): the urgent
    request's prompt gets the blocks of the least urgent, not a wait for one to finish."""
    d = Driver(_config(max_batch_size=8), num_blocks=40, block_size=4, policy=PRIORITY)
    running = _fill_batch(d, [4, 5, 4], prompt_len=48, out_len=40)
    assert d.bm.num_blocks - d.bm.num_used_blocks < 12
    urgent = make_request(9, 48, 2, priority=0)
    d.add(urgent)
    out = d.step()
    assert any(s.request is urgent for s in out.scheduled)
    assert out.preempted and out.preempted[0] is running[1]
    d.run()
    assert urgent.output_token_ids == expected_tokens(urgent)
    assert all(r.output_token_ids == expected_tokens(r) for r in running)


def _starve(max_bypass: int, num_urgent: int) -> list[str]:
    """One batch slot, a low-priority request waiting, and an urgent one always waiting too."""
    d = Driver(_config(max_batch_size=1, priority_max_bypass=max_bypass), num_blocks=128, block_size=4,
               policy=PRIORITY)
    d.add(make_request(0, 4, 2, priority=0))
    d.step()
    d.add(make_request(1, 4, 2, priority=9))
    sent = 1
    while d.scheduler.num_unfinished:
        if sent < num_urgent and not any(r.priority == 0 for r in d.scheduler.waiting):
            sent += 1
            d.add(make_request(100 + sent, 4, 2, priority=0))
        d.step()
    return d.admission_order


def test_aging_serves_a_request_after_a_bounded_number_of_bypasses():
    order = _starve(max_bypass=3, num_urgent=12)
    # Overtaken by three urgent requests, then served next, ahead of the urgent ones still coming.
    assert order.index("r1") == 4, order
    # Without aging to speak of, the same stream keeps it waiting until the urgent ones stop.
    assert _starve(max_bypass=10_000, num_urgent=12)[-1] == "r1"


def test_priority_needs_the_priority_policy(make_llm):
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match="scheduling_policy=priority"):
        llm.generate(["hi"], priority=1)
    assert not llm.engine.has_unfinished()


def test_offline_api_takes_a_priority_per_prompt(make_llm):
    from inflight import SamplingParams

    llm = make_llm(scheduling_policy="priority", max_batch_size=1)
    outs = llm.generate(["one", "two", "three"], SamplingParams(max_tokens=2, temperature=0),
                        priority=[5, 0, 1])
    first = {o.request_id: o.timings.first_scheduled for o in outs}
    ids = [o.request_id for o in outs]
    assert first[ids[1]] < first[ids[2]] < first[ids[0]]


def test_urgent_requests_enter_a_full_batch_on_a_server(loaded):
    """Four long low-priority streams fill the batch; two urgent requests sent then start within
    a couple of steps (preempting), finish long before the low ones, and every request ends."""
    from inflight.server.config import ServerConfig
    from inflight.server.launcher import serve_in_thread

    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=256, max_batch_size=4, scheduling_policy="priority"),
                       loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        def body(priority: int, max_tokens: int) -> dict:
            return {"model": engine.model_name, "prompt": "Tell me a long story:", "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0, "priority": priority}

        async def scenario() -> tuple[list[httpx.Response], list[httpx.Response], float]:
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as http:
                low = [asyncio.create_task(http.post("/v1/completions", json=body(5, 96))) for _ in range(4)]
                while sum(1 for r in engine.scheduler.running if r.priority == 5) < 4:
                    await asyncio.sleep(0.01)
                steps_before = len(engine.step_records)
                urgent = await asyncio.gather(*(http.post("/v1/completions", json=body(0, 4)) for _ in range(2)))
                steps_taken = len(engine.step_records) - steps_before
                done = await asyncio.gather(*low)
                return urgent, done, steps_taken

        urgent, low, steps_taken = asyncio.run(scenario())
        assert all(r.status_code == 200 for r in urgent + low)
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in urgent)
        assert all(r.json()["usage"]["completion_tokens"] == 96 for r in low)
        # 4 tokens each: started within a step or two of arriving, not after the 96-token streams.
        assert steps_taken <= 24, steps_taken
        assert engine.stats().num_preemptions >= 2
        refused = httpx.post(running.url + "/v1/completions", json={**body(1, 2), "priority": 2**40}, timeout=30)
        assert refused.status_code == 400
    assert engine.block_manager.num_used_blocks == 0


def test_a_priority_on_an_fcfs_server_is_a_400(loaded):
    from inflight.server.config import ServerConfig
    from inflight.server.launcher import serve_in_thread

    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        r = httpx.post(running.url + "/v1/chat/completions", timeout=30, json={
            "model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "priority": 3})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
        ok = httpx.post(running.url + "/v1/chat/completions", timeout=30, json={
            "model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "priority": 0})
        assert ok.status_code == 200
