"""The fleet's routing rules (pure Python, no Ray), its metrics merge and its ASGI bridge."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from inflight.engine.block_manager import BlockManager, block_hashes
from inflight.fleet.asgi import ForwardedRequest, ResponseStart, call_app
from inflight.fleet.metrics import MetricsBoard, merge
from inflight.fleet.routing import ReplicaLoad, RouteHint, Router, RouterConfig
from inflight.request import Request as EngineRequest
from inflight.request import SamplingParams

BS = 4


def hint(tokens: list[int]) -> RouteHint:
    return RouteHint(len(tokens), tuple(block_hashes(tokens, BS)), BS)


def load(cached: list[int] = (), free: int = 100, total: int = 100, waiting: int = 0, t: float = 1.0) -> ReplicaLoad:
    return ReplicaLoad(time=t, free_blocks=free, total_blocks=total, waiting_tokens=waiting, cached=frozenset(cached))


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_block_hashes_are_the_block_managers_keys() -> None:
    tokens = list(range(100, 123))  # 5 full blocks of 4 and 3 tokens over
    bm = BlockManager(num_blocks=16, block_size=BS)
    request = EngineRequest("r", tokens, SamplingParams(max_tokens=1))
    assert bm.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request)
    assert sorted(bm.cached_block_hashes()) == sorted(block_hashes(tokens, BS))
    assert len(block_hashes(tokens, BS)) == 5
    # The same keys in another process (the router's), whatever its address-space layout.
    code = f"from inflight.engine.block_manager import block_hashes; print(block_hashes({tokens!r}, {BS}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(other.stdout) == block_hashes(tokens, BS)
    # Chained: the same block after a different prefix has a different key.
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)[1] != block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)[1]


def test_prefix_goes_to_the_replica_holding_the_longest_prefix() -> None:
    system_a, system_b = list(range(40)), list(range(1000, 1040))
    router: Router[str] = Router(RouterConfig("prefix", seed=0), clock=Clock())
    router.report("r0", load(block_hashes(system_a, BS)))
    router.report("r1", load(block_hashes(system_b, BS)[:4]))
    router.report("r2", load())
    for _ in range(10):
        assert router.choose(["r0", "r1", "r2"], hint(system_a + [7, 7, 7, 7, 7])).ranked[0] == "r0"
        decision = router.choose(["r0", "r1", "r2"], hint(system_b))
        assert decision.ranked[0] == "r1" and decision.reason == "prefix" and decision.matched_blocks == 4


def test_prefix_passes_an_overloaded_replica_by() -> None:
    system = list(range(64))
    config = RouterConfig("prefix", max_waiting_tokens=500, min_free_kv=0.1, seed=0)
    router: Router[str] = Router(config, clock=Clock())
    router.report("hot", load(block_hashes(system, BS), waiting=600))
    router.report("cold", load())
    decision = router.choose(["hot", "cold"], hint(system))
    assert decision.reason == "balance" and decision.ranked[0] == "cold"
    # KV nearly full is overloaded too.
    router.report("hot", load(block_hashes(system, BS), free=5, waiting=0, t=2.0))
    assert router.choose(["hot", "cold"], hint(system)).ranked[0] == "cold"
    # Back under both limits, affinity wins again.
    router.report("hot", load(block_hashes(system, BS), free=50, waiting=0, t=3.0))
    assert router.choose(["hot", "cold"], hint(system)).ranked == ["hot", "cold"]


def test_routed_requests_count_until_a_later_report_shows_them() -> None:
    clock = Clock()
    router: Router[str] = Router(RouterConfig("prefix", max_waiting_tokens=100, report_lag_s=1.0, seed=0), clock)
    router.report("a", load(t=clock.now))
    router.report("b", load(t=clock.now))
    prompt = list(range(80))
    first = router.choose(["a", "b"], hint(prompt))
    assert first.reason == "balance"
    router.on_routed(first.ranked[0], hint(prompt))
    # Before any report, the same prefix follows the first request (its blocks will be cached there).
    again = router.choose(["a", "b"], hint(prompt))
    assert again.reason == "prefix" and again.ranked[0] == first.ranked[0]
    assert router.waiting_tokens(first.ranked[0]) == 80
    # A second request with that prefix adds only what is not cached there: its own 6 tokens.
    router.on_routed(first.ranked[0], hint(prompt + [1, 2, 3, 4, 5, 6]), key="second")
    assert router.waiting_tokens(first.ranked[0]) == 86
    router.on_finished(first.ranked[0], key="second")  # it has ended: it waits no more
    assert router.waiting_tokens(first.ranked[0]) == 80
    router.on_routed(first.ranked[0], hint(prompt), key="third")
    router.withdraw(first.ranked[0], "third")  # it went elsewhere after all
    assert router.waiting_tokens(first.ranked[0]) == 80
    # A report newer than the lag replaces the estimate: the prompt was prefilled and evicted.
    clock.now += 5
    router.report(first.ranked[0], load(t=clock.now))
    assert router.waiting_tokens(first.ranked[0]) == 0
    assert router.choose(["a", "b"], hint(prompt)).reason == "balance"


def test_pow2_prefers_the_less_loaded_and_round_robin_takes_turns() -> None:
    router: Router[int] = Router(RouterConfig("pow2", seed=1))
    router.report(0, load(waiting=5000))
    router.report(1, load(waiting=0))
    picks = [router.choose([0, 1]).ranked[0] for _ in range(20)]
    assert picks == [1] * 20  # with two replicas both are drawn: the lighter always wins
    router.report(2, load(waiting=0, free=10))
    counts = {r: 0 for r in range(3)}
    for _ in range(300):
        counts[router.choose([0, 1, 2]).ranked[0]] += 1
    assert counts[0] < counts[1] and counts[0] < counts[2] and counts[1] > counts[2]  # free KV breaks the tie
    rr: Router[str] = Router(RouterConfig("round-robin"))
    assert [rr.choose(["x", "y", "z"]).ranked[0] for _ in range(6)] == ["x", "y", "z"] * 2


def test_forgotten_and_unreported_replicas() -> None:
    router: Router[str] = Router(RouterConfig("prefix", seed=0))
    prompt = list(range(32))
    router.report("a", load(block_hashes(prompt, BS)))
    router.forget("a")
    assert router.matched_blocks("a", block_hashes(prompt, BS)) == 0
    assert router.choose(["a", "b"], hint(prompt)).reason == "balance"  # nobody has reported: balance
    with pytest.raises(ValueError):
        router.choose([])
    with pytest.raises(ValueError):
        RouterConfig("fastest")  # type: ignore[arg-type]
    assert ReplicaLoad.from_dict({}) is None
    assert ReplicaLoad.from_dict(load(prompt).to_dict()) == load(prompt)


def test_metrics_merge_labels_each_replica() -> None:
    text_a = b"# HELP inflight:num_requests_running r\n# TYPE inflight:num_requests_running gauge\n" \
             b"inflight:num_requests_running 3.0\n# HELP inflight:oom_total o\n# TYPE inflight:oom_total counter\n" \
             b"inflight:oom_total 1.0\n# HELP python_info p\n# TYPE python_info gauge\npython_info 1.0\n"
    text_b = text_a.replace(b"running 3.0", b"running 5.0")
    out = merge({"a1": (text_a, {"pid": "11"}), "b2": (text_b, {"pid": "22"})}).decode()
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(out) for s in f.samples}
    assert samples[("inflight:num_requests_running", "a1")] == 3.0
    assert samples[("inflight:num_requests_running", "b2")] == 5.0
    assert samples[("inflight:oom_total", "b2")] == 1.0
    assert not any(name.startswith("python") for name, _ in samples)
    info = {s.labels["replica"]: s.labels["pid"] for f in text_string_to_metric_families(out)
            if f.name == "inflight:replica_info" for s in f.samples}
    assert info == {"a1": "11", "b2": "22"} and samples[("inflight:fleet_replicas_reporting", None)] == 2
    board = MetricsBoard(max_age_s=60.0)
    board.report("a1", text_a, {"pid": "11"})
    assert board.collect() == {"a1": (text_a, {"pid": "11"})}
    board.max_age_s = -1.0  # a replica that stopped reporting drops out
    assert board.collect() == {}


def _bridge_app() -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "q": request.url.query,
                             "auth": request.headers.get("authorization")}, status_code=201)

    async def stream(request: Request) -> StreamingResponse:
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                app.state.closed = True
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream)])
    app.state.closed = False
    return app


def test_asgi_bridge_carries_requests_and_streams() -> None:
    app = _bridge_app()

    async def run() -> None:
        req = ForwardedRequest("POST", "/echo", b"x=1", (("authorization", "Bearer k"),), b"hello")
        items = [item async for item in call_app(app, req)]
        start = items[0]
        assert isinstance(start, ResponseStart) and start.status == 201 and start.media_type == "application/json"
        assert b"".join(items[1:]) == b'{"body":"hello","q":"x=1","auth":"Bearer k"}'
        # A caller that stops reading is a client that left: the stream's generator is closed.
        gen = call_app(app, ForwardedRequest("GET", "/stream", b"", (), b""))
        head = await gen.__anext__()
        assert isinstance(head, ResponseStart) and head.media_type == "text/event-stream"
        first = await gen.__anext__()
        assert first.startswith(b"data: 0")
        await gen.aclose()
        assert app.state.closed

    asyncio.run(run())


# --- the simulator's fleet ----------------------------------------------------------------------


def test_simulated_fleet_runs_the_same_rule() -> None:
    from inflight.bench.workload import load_workload
    from inflight.perf.profiles import load_hardware
    from inflight.sim.runs import SimTarget, simulate
    from inflight.sim.shapes import resolve_shapes
    from inflight.sim.tune import SearchSpace
    from inflight.sim.workload import synthetic_requests

    spec, _ = load_workload("multi-prefix", num_requests=64)
    requests = synthetic_requests(spec)
    name, shapes = resolve_shapes("llama-3-8b")
    target = SimTarget(name, shapes, load_hardware("h100"))
    # Pools that hold about four of the eight system prompts each: where a prompt lands matters.
    base = {"num_kv_blocks": 160, "block_size": 16, "max_num_tokens": 2048}
    runs = {router: simulate(target, {**base, "replicas": 2, "router": router}, requests, router)
            for router in ("prefix", "pow2", "round-robin")}
    for run in runs.values():
        assert run.metrics.num_completed == len(requests) and sum(run.options["routed"]) == len(requests)
    rates = {router: run.options["prefix_hit_rate"] for router, run in runs.items()}
    assert rates["prefix"] > rates["round-robin"] + 0.1 and rates["prefix"] > rates["pow2"] + 0.1
    assert min(runs["round-robin"].options["routed"]) == len(requests) // 2  # strictly in turn
    # One replica is the plain simulation, unchanged.
    one = simulate(target, {**base, "replicas": 1}, requests, "one")
    assert one.metrics == simulate(target, base, requests, "plain").metrics
    space = list(SearchSpace((512,), (64,), (True,), replicas=(1, 2), routers=("prefix", "pow2")))
    assert [(o["replicas"], o.get("router")) for o in space] == [(1, "prefix"), (2, "prefix"), (2, "pow2")]


def test_the_ingress_hashes_the_prompt_the_replica_computes(loaded) -> None:
    """The routing hint's tokens are the replica's: a chat rendered with its template options
    (no generation prompt, the last message continued, template kwargs), a prompt cut to its
    last truncate_prompt_tokens."""
    from inflight.fleet.ingress import prompt_tokens

    tokenizer = loaded.tokenizer
    messages = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Par"}]
    plain = tokenizer.apply_chat_template(messages, True)
    for options, expected in [
        ({}, plain),
        ({"add_generation_prompt": False}, tokenizer.apply_chat_template(messages, False)),
        ({"add_generation_prompt": False, "continue_final_message": True},
         tokenizer.apply_chat_template(messages, False, None, None, True)),
        ({"truncate_prompt_tokens": 5}, plain[-5:]),
    ]:
        body = json.dumps({"model": "m", "messages": messages, **options}).encode()
        assert prompt_tokens("/v1/chat/completions", body, tokenizer, None) == expected, options
    body = json.dumps({"model": "m", "prompt": [5, 6, 7, 8], "truncate_prompt_tokens": 2}).encode()
    assert prompt_tokens("/v1/completions", body, tokenizer, None) == [7, 8]
    assert plain != tokenizer.apply_chat_template(messages, False)  # the options change the tokens
