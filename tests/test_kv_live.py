"""The share of allocated KV slots that hold live tokens (the seed's contrast of reserving each
request's maximum length against allocating blocks on demand): exact on hand-built states, near
100% for continuous batching and far lower for the static policy on the same burst, and reported
by the bench, the server's /metrics and the KV plot."""

from __future__ import annotations

from inflight import EngineConfig
from inflight.bench.workload import BenchRequest
from inflight.engine.block_manager import BlockManager
from inflight.perf.cost_model import CostModel
from inflight.perf.profiles import BUILTIN_HARDWARE
from inflight.perf.shapes import BUILTIN_MODELS
from inflight.request import Request, SamplingParams
from inflight.sim.simulator import run_simulation, sim_engine


def test_live_tokens_count_shared_blocks_once() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    bm.allocate_slots(a, 10)  # 3 blocks, 10 live tokens of 12 slots
    a.num_computed_tokens = 10
    assert bm.num_live_tokens([a]) == 10
    b = Request("b", list(range(10)), SamplingParams(max_tokens=4))
    bm.fork(a, b, 8)  # shares a's two full blocks
    b.num_computed_tokens = 8
    assert bm.num_used_blocks == 3 and bm.num_live_tokens([a, b]) == 10  # the shared 8 once
    bm.allocate_slots(b, 9)  # b's own third block
    b.num_computed_tokens = 9
    assert bm.num_used_blocks == 4 and bm.num_live_tokens([a, b]) == 11


def _burst(policy: str) -> tuple[float, float]:
    cm = CostModel(BUILTIN_MODELS["llama-3-8b"], BUILTIN_HARDWARE["h100"])
    engine = sim_engine(EngineConfig.from_kwargs(None, scheduling_policy=policy, num_kv_blocks=4000,
                                                 max_batch_size=32), cm)
    # Short prompts and outputs of very different lengths: what reserving the maximum wastes most.
    requests = [BenchRequest(i, [7] * (50 + 2 * i), "", 100 + 60 * (i % 6), 0.0) for i in range(48)]
    capture = run_simulation(engine, requests)
    samples = [s for s in capture.samples if s.kv_usage_perc > 0]
    mean = sum(s.kv_live_perc for s in samples) / len(samples)
    peak = max(samples, key=lambda s: s.kv_usage_perc).kv_live_perc
    return mean, peak


def test_static_reservation_wastes_what_paging_does_not() -> None:
    continuous_mean, continuous_peak = _burst("continuous")
    static_mean, static_peak = _burst("static")
    assert continuous_mean > 90 and continuous_peak > 90  # at most a partly filled last block each
    assert static_mean < 60 and static_mean < continuous_mean - 30


def test_the_server_reports_the_live_share_while_a_stream_runs(loaded) -> None:  # type: ignore[no-untyped-def]
    import httpx
    from conftest import stream_in_background

    from inflight import LLMEngine
    from inflight.server.config import ServerConfig
    from inflight.server.launcher import serve_in_thread

    def live(url: str) -> float:
        line = next(x for x in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                    if x.startswith("inflight:kv_cache_live_token_perc"))
        return float(line.split()[-1])

    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as server:
        assert live(server.url) == 1.0  # nothing allocated, nothing wasted
        thread, _ = stream_in_background(server.url + "/v1/completions", {
            "model": server.engine.model_name, "prompt": "Once upon a time", "max_tokens": 64, "stream": True,
            "ignore_eos": True})
        during = live(server.url)
        thread.join(60)
        # A 16-token block: a few prompt tokens plus the outputs so far, the last block partly filled.
        assert 0.0 < during <= 1.0
