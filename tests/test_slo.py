"""The SLO policy, in the simulator (the production scheduler on a virtual clock, its steps priced
by the cost model, which is then also the policy's exact predictor) and on the real engine: the
budget keeps steps under the TBT target, late requests yield to those that can still make their
deadline, --reject-late refuses the hopeless on arrival (429 with Retry-After over HTTP), and the
predictor's online correction follows the machine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from inflight import EngineConfig
from inflight.bench.metrics import RequestSLO
from inflight.bench.workload import BenchRequest
from inflight.config import SchedulerConfig
from inflight.engine.slo import MIN_PREFILL_CHUNK, LateRequestError, StepTimePredictor
from inflight.errors import ConfigError
from inflight.perf.cost_model import CostModel, SeqWork
from inflight.perf.profiles import BUILTIN_ENGINES, BUILTIN_HARDWARE
from inflight.perf.shapes import BUILTIN_MODELS
from inflight.sim.simulator import run_simulation, sim_engine

# Without CUDA graphs every step launches its layers alike. With them, a decode batch sized to the
# TBT target replays a graph, and the minimum prefill chunk beside it (progress for the waiting
# prompt) makes the step eager: over the target by the launch cost (docs/simulator.md, Limits).
EAGER = dataclasses.replace(BUILTIN_ENGINES["vllm"], cuda_graphs=False)
COST = CostModel(BUILTIN_MODELS["llama-3-8b"], BUILTIN_HARDWARE["h100"], engine=EAGER)


def workload(rate: float, n: int = 300, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return [BenchRequest(i, [7] * int(rng.integers(200, 3000)), "", int(rng.integers(50, 300)), float(arrivals[i]))
            for i in range(n)]


def simulate(requests: list[BenchRequest], **options: object):  # type: ignore[no-untyped-def]
    engine = sim_engine(EngineConfig.from_kwargs(None, num_kv_blocks=20_000, max_num_tokens=8192,
                                                 max_batch_size=256, max_model_len=4096, **options), COST)
    return engine, run_simulation(engine, requests)


def test_the_budget_keeps_steps_under_the_tbt_target() -> None:
    requests = workload(100.0)
    engine, capture = simulate(requests, scheduling_policy="slo", tbt_slo_ms=25)
    assert max(r.duration_s for r in engine.step_records) <= 0.025 * 1.02  # within rounding of the target
    assert all(r.ok for r in capture.results)
    fixed, _ = simulate(requests)  # FCFS at the same max_num_tokens and max_batch_size
    assert max(r.duration_s for r in fixed.step_records) > 0.025 * 2


def test_goodput_past_saturation_beats_fcfs() -> None:
    slo = RequestSLO(max_ttft_ms=500, max_tpot_ms=25)
    requests = workload(100.0)  # past saturation: FCFS grows the batch until every stream is slow
    _, fcfs = simulate(requests)
    _, policy = simulate(requests, scheduling_policy="slo", ttft_slo_ms=500, tbt_slo_ms=25)
    met_fcfs = sum(slo.is_met(r) for r in fcfs.results)
    met_slo = sum(slo.is_met(r) for r in policy.results)
    assert met_slo > 2 * met_fcfs, (met_slo, met_fcfs)
    assert all(r.ok for r in policy.results)  # late requests are served too, after the others


def test_reject_late_refuses_on_arrival_what_cannot_start_in_time() -> None:
    engine, capture = simulate(workload(150.0), scheduling_policy="slo", ttft_slo_ms=500, tbt_slo_ms=25,
                               reject_late=True)
    refused = [r for r in capture.results if not r.ok]
    assert refused and all("TTFT target" in (r.error or "") for r in refused)
    assert engine.scheduler.num_rejected_late == len(refused)  # type: ignore[attr-defined]
    served = [r for r in capture.results if r.ok]
    slo = RequestSLO(max_ttft_ms=500, max_tpot_ms=25)
    assert sum(slo.is_met(r) for r in served) > 0.8 * len(served)


def test_the_predictor_follows_measured_steps() -> None:
    predictor = StepTimePredictor(COST)
    batch = [SeqWork(1, 500, True)] * 16 + [SeqWork(256, 256, True)]
    base = predictor(batch)
    for _ in range(40):
        predictor.observe(batch, 2 * base)  # this machine runs steps twice as slow as the profile says
    assert predictor.correction == pytest.approx(2.0)
    assert predictor(batch) == pytest.approx(2 * base)


def test_the_budget_shrinks_on_a_slower_machine() -> None:
    engine = sim_engine(EngineConfig.from_kwargs(None, num_kv_blocks=20_000, max_num_tokens=8192,
                                                 scheduling_policy="slo", tbt_slo_ms=40), COST)
    scheduler = engine.scheduler
    fast = scheduler._budget()  # type: ignore[attr-defined]
    for _ in range(40):
        scheduler.observe_step(((512, 512, True),), 3 * COST.step_time([SeqWork(512, 512, True)]))
    slow = scheduler._budget()  # type: ignore[attr-defined]
    assert MIN_PREFILL_CHUNK <= slow < fast <= 8192


@pytest.mark.parametrize(("options", "message"), [
    ({"scheduling_policy": "slo"}, "needs a target"),
    ({"scheduling_policy": "slo", "tbt_slo_ms": 50, "enable_chunked_prefill": False}, "chunked prefill"),
    ({"reject_late": True, "ttft_slo_ms": 100}, "reject_late needs"),
    ({"scheduling_policy": "slo", "tbt_slo_ms": -1}, "tbt_slo_ms must be > 0"),
])
def test_slo_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**options)  # type: ignore[arg-type]


def test_late_request_error_is_an_overload_with_a_retry_time() -> None:
    err = LateRequestError("late", retry_after_s=2.5)
    from inflight.errors import EngineOverloadedError

    assert isinstance(err, EngineOverloadedError) and err.retry_after_s == 2.5


# --- the real engine and the server ------------------------------------------------------------------


def test_on_the_real_engine_the_tokens_are_fcfs_and_the_correction_is_fitted(make_llm) -> None:  # type: ignore[no-untyped-def]
    from inflight import SamplingParams

    prompts = ["The capital of France is", "Once upon a time", "List three uses of a paperclip:\n1."]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fcfs = [o.token_ids for o in make_llm().generate(prompts, params)]
    llm = make_llm(scheduling_policy="slo", tbt_slo_ms=200, ttft_slo_ms=5000)
    assert [o.token_ids for o in llm.generate(prompts, params)] == fcfs
    predictor = llm.engine.scheduler.predictor  # type: ignore[attr-defined]
    assert len(predictor._ratios) > 0 and predictor.correction > 0


def test_reject_late_is_a_429_with_retry_after(loaded) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from inflight import LLMEngine
    from inflight.server.config import ServerConfig
    from inflight.server.launcher import serve_in_thread

    # A TTFT target no prefill can meet: every request is late on arrival.
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64, scheduling_policy="slo", ttft_slo_ms=0.01,
                                                reject_late=True), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as server:
        resp = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": server.engine.model_name, "prompt": "Hello there", "max_tokens": 4})
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "late" and int(resp.headers["retry-after"]) >= 1
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert "inflight:requests_rejected_late_total 1.0" in metrics
        assert server.engine.num_active == 0


def test_the_server_counts_the_requests_meeting_its_targets(loaded) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from inflight import LLMEngine
    from inflight.server.config import ServerConfig
    from inflight.server.launcher import serve_in_thread

    def good_count(url: str) -> float:
        line = next(x for x in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                    if x.startswith("inflight:requests_meeting_slo_total"))
        return float(line.split()[-1])

    # Targets any request here meets (generous), then ones none can (a TTFT of 1 microsecond).
    for ttft_ms, expected in ((60_000, 2.0), (0.001, 0.0)):
        engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64, ttft_slo_ms=ttft_ms, tbt_slo_ms=60_000), loaded)
        with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as server:
            for _ in range(2):
                resp = httpx.post(server.url + "/v1/completions", timeout=30, json={
                    "model": server.engine.model_name, "prompt": "Hello there", "max_tokens": 4})
                assert resp.status_code == 200
            assert good_count(server.url) == expected



def test_waiting_requests_go_by_priority_then_slack_with_late_ones_last() -> None:
    from inflight.request import Request, SamplingParams

    engine = sim_engine(EngineConfig.from_kwargs(None, num_kv_blocks=1000, scheduling_policy="slo",
                                                 ttft_slo_ms=1000, tbt_slo_ms=50), COST)
    scheduler = engine.scheduler
    now = engine.clock()
    params = SamplingParams(max_tokens=8)

    def waiting(rid: str, age_s: float, prompt: int, priority: int = 0) -> Request:
        r = Request(rid, [7] * prompt, params, priority=priority, arrival_time=now - age_s)
        scheduler.add_request(r)
        return r

    late = waiting("late", 5.0, 100)  # its deadline passed long ago
    early = waiting("early", 0.1, 100)  # most slack
    tight = waiting("tight", 0.8, 100)  # arrived earlier: less slack than `early`
    assert scheduler.next_waiting() is tight
    scheduler.take_waiting(tight)
    assert scheduler.next_waiting() is early
    scheduler.take_waiting(early)
    assert scheduler.next_waiting() is late  # served once nobody who can still make it waits
    urgent = waiting("urgent", 0.0, 100, priority=-1)
    assert scheduler.next_waiting() is urgent  # priority above deadline
