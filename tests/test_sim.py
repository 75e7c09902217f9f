"""The simulator: the production scheduler on a virtual clock, the cost model's arithmetic,
calibration's fit, and the tuner. CPU only and fast: one test times a few real engine steps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from inflight.bench.report import read_run_file
from inflight.bench.sla import SLA, check_run
from inflight.bench.workload import load_workload, parse_workload
from inflight.cli import main
from inflight.config import EngineConfig, ModelConfig
from inflight.engine.block_manager import BlockManager
from inflight.engine.engine import LLMEngine
from inflight.engine.scheduler import Scheduler
from inflight.engine.static import StaticScheduler
from inflight.errors import ConfigError
from inflight.model.loaded import LoadedModel
from inflight.perf.cost_model import CostModel, SeqWork
from inflight.perf.profiles import (
    BUILTIN_ENGINES,
    BUILTIN_HARDWARE,
    INFLIGHT_CPU,
    EngineProfile,
    HardwareProfile,
    load_hardware,
    load_profiles,
    save_profile,
)
from inflight.perf.shapes import (
    BUILTIN_MODELS,
    experts_touched,
    num_active_linear_params,
    num_linear_params,
    num_params,
)
from inflight.sim.calibrate import StepCase, measure
from inflight.sim.fit import Sample, fit_profile, predict
from inflight.sim.runs import SimTarget, simulate
from inflight.sim.shapes import resolve_shapes
from inflight.sim.simulator import run_simulation, sim_engine
from inflight.sim.tune import SearchSpace, Tuner, tune
from inflight.sim.workload import synthetic_requests

SMALL = {
    "name": "small", "seed": 1, "num_requests": 40,
    "arrivals": {"kind": "poisson", "rate": 50.0},
    "prompt_len": {"kind": "uniform", "min": 16, "max": 400},
    "output_len": {"kind": "uniform", "min": 4, "max": 64},
}

ROOT = Path(__file__).resolve().parents[1]

# A toy decoder whose amounts are easy to write by hand: 2 layers of 2**24 linear parameters.
TOY = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=1024, intermediate_size=4096,
                  num_layers=2, num_heads=8, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                  rope_theta=1e4, max_position_embeddings=8192)
# 100 TFLOP/s, 1 TB/s; an engine with every efficiency 1 and no overhead: times are the bare roofline.
BARE = HardwareProfile("bare", "gpu", peak_flops=1e14, memory_bandwidth=1e12, memory_bytes=10e9,
                       interconnect_bandwidth=1e11, peak_flops_fp8=2e14)
FLAT = EngineProfile("flat", flops_efficiency=1, bandwidth_efficiency=1, attention_flops_efficiency=1,
                     attention_bandwidth_efficiency=1, step_overhead_s=0, request_overhead_s=0,
                     allreduce_latency_s=1e-6)


def small_requests(**changes: Any) -> list[Any]:
    return synthetic_requests(parse_workload({**SMALL, **changes}))


def h100_llama() -> SimTarget:
    name, shapes = resolve_shapes("llama-3-8b")
    return SimTarget(name, shapes, load_hardware("h100"))


# --- the production classes -----------------------------------------------------------------------


@pytest.mark.parametrize("policy, cls", [("continuous", Scheduler), ("static", StaticScheduler)])
def test_runs_the_production_scheduler_and_block_manager(policy: str, cls: type,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"schedule": 0, "allocate": 0}
    schedule, allocate = cls.schedule, BlockManager.allocate_slots

    def counting_schedule(self: Scheduler) -> Any:
        calls["schedule"] += 1
        return schedule(self)

    def counting_allocate(self: BlockManager, *args: Any) -> bool:
        calls["allocate"] += 1
        return allocate(self, *args)

    monkeypatch.setattr(cls, "schedule", counting_schedule)
    monkeypatch.setattr(BlockManager, "allocate_slots", counting_allocate)
    engine = sim_engine(EngineConfig.from_kwargs(None, scheduling_policy=policy, num_kv_blocks=400),
                        CostModel(TOY, BARE, engine=FLAT))
    assert type(engine) is LLMEngine and type(engine.scheduler) is cls
    assert type(engine.block_manager) is BlockManager and engine.block_manager is engine.scheduler.block_manager
    capture = run_simulation(engine, small_requests(arrivals={"kind": "burst"}))
    assert calls["schedule"] == len(capture.timeline.steps) and calls["allocate"] > 0
    assert all(r.ok and r.num_output_tokens == r.output_len for r in capture.results)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
    if policy == "static":
        assert sum(s.num_wasted_tokens for s in capture.timeline.steps) > 0


def test_times_are_virtual_and_consistent() -> None:
    engine = sim_engine(EngineConfig.from_kwargs(None, num_kv_blocks=400), CostModel(TOY, BARE, engine=FLAT))
    requests = small_requests()
    ids = {f"bench-{r.index}": r for r in requests}
    seen = []
    engine.step_observers.append(lambda record, outputs: seen.extend(o.request for o in outputs if o.finished))
    capture = run_simulation(engine, requests)
    assert len(seen) == len(requests)
    for request in seen:
        t = request.timings
        assert ids[request.request_id].arrival_s == t.arrival <= t.first_scheduled <= t.first_token <= t.finished
        assert t.finished <= capture.duration_s + 1e-9  # virtual seconds, not perf_counter
    steps = capture.timeline.steps
    assert all(a.t_s + a.duration_s <= b.t_s + 1e-12 for a, b in zip(steps, steps[1:], strict=False))


def test_preemption_under_a_small_pool() -> None:
    run = simulate(h100_llama(), {"num_kv_blocks": 60, "max_batch_size": 64}, small_requests(num_requests=60))
    # KV pressure preempts; nothing runs out of memory.
    assert run.metrics.num_preemptions > 0 and run.metrics.num_kv_allocation_failures > 0
    assert run.metrics.num_oom_errors == 0
    assert run.metrics.num_failed == 0 and run.metrics.kv_peak_perc == pytest.approx(100.0)


def test_guaranteed_no_evict_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(yaml.safe_dump({**SMALL, "num_requests": 60}))
    out = tmp_path / "run.json"
    # The pool of test_preemption_under_a_small_pool, which preempts when admission is optimistic.
    assert main(["sim", "--workload", str(workload), "--model", "llama-3-8b", "--hardware", "h100",
                 "--num-kv-blocks", "60", "--max-batch-size", "64", "--guaranteed-no-evict", "-o", str(out)]) == 0
    capsys.readouterr()
    _, (run,) = read_run_file(out)
    assert run.options["guaranteed_no_evict"] is True
    assert run.metrics.num_preemptions == 0 and run.metrics.num_completed == 60


def test_bench_and_sim_count_the_same_events(loaded: LoadedModel) -> None:
    """A burst through the real engine (`inflight bench` in-process) and through the simulator:
    the scheduler decides alike when every request is there from the start, and the two report
    the same preemptions, allocation failures, OOM events and KV peak."""
    from inflight.bench.local import run_engine
    from inflight.bench.workload import BenchRequest

    rng = np.random.default_rng(7)
    requests = [BenchRequest(i, [int(t) for t in rng.integers(100, 5000, int(rng.integers(40, 90)))], "",
                             int(rng.integers(20, 40)), 0.0) for i in range(10)]
    options = {"num_kv_blocks": 24, "max_batch_size": 8, "max_num_tokens": 256}
    real = LLMEngine(EngineConfig.from_kwargs(None, **options), loaded)
    real_counters = run_engine(real, requests, progress=False).counters
    sim = sim_engine(EngineConfig.from_kwargs(None, **options), CostModel(BUILTIN_MODELS["smollm2-135m"],
                                                                         BUILTIN_HARDWARE["cpu-local"]))
    sim_counters = run_simulation(sim, requests).counters
    assert real_counters == sim_counters
    assert real_counters.num_preemptions and real_counters.num_kv_allocation_failures
    assert real_counters.num_oom_errors == 0
    assert real.stats().num_kv_blocks_used == sim.stats().num_kv_blocks_used == 0


def test_shared_prefix_requests_hit_the_real_prefix_cache() -> None:
    spec = {**SMALL, "shared_prefix": {"fraction": 0.8, "num_tokens": 256},
            "arrivals": {"kind": "poisson", "rate": 2.0}}
    requests = synthetic_requests(parse_workload(spec))
    hits = {}
    for caching in (True, False):
        engine = sim_engine(EngineConfig.from_kwargs(None, num_kv_blocks=2000, enable_prefix_caching=caching),
                            CostModel(TOY, BARE, engine=FLAT))
        run_simulation(engine, requests)
        hits[caching] = engine.stats().prefix_cache_hits
    shared = sum(r.has_shared_prefix for r in requests)
    assert hits[True] >= 256 * (shared - 1) and hits[False] == 0


def test_same_spec_and_seed_give_the_same_result() -> None:
    spec, path = load_workload("mixed")
    runs = [simulate(h100_llama(), {}, synthetic_requests(spec, path.parent)).to_dict() for _ in range(2)]
    assert runs[0] == runs[1]
    other = simulate(h100_llama(), {}, synthetic_requests(spec.model_copy(update={"seed": 1}), path.parent))
    assert other.to_dict()["requests"] != runs[0]["requests"]


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in token_ids)


def test_synthetic_requests_match_the_bench_draws() -> None:
    from inflight.bench.corpus import Corpus
    from inflight.bench.workload import generate_requests

    spec = parse_workload({**SMALL, "shared_prefix": {"fraction": 0.5, "num_tokens": 32}})
    real = generate_requests(spec, Corpus(CharTokenizer()))
    fake = synthetic_requests(spec)
    assert [(r.prompt_len, r.output_len, r.arrival_s, r.has_shared_prefix) for r in real] == \
           [(r.prompt_len, r.output_len, r.arrival_s, r.has_shared_prefix) for r in fake]
    prefixed = [r.prompt_token_ids[:32] for r in fake if r.has_shared_prefix]
    assert len(prefixed) > 1 and all(p == prefixed[0] for p in prefixed)


# --- the cost model -------------------------------------------------------------------------------


def test_toy_amounts() -> None:
    assert num_linear_params(TOY) == 2**25
    assert num_params(TOY) == 2**25 + 2 * 1000 * 1024 + 5 * 1024
    assert CostModel(TOY, BARE, engine=FLAT).kv_bytes_per_token == 2 * 2 * 8 * 128 * 2  # K and V, 2 layers, bf16


def test_pure_decode_is_bandwidth_bound() -> None:
    cm = CostModel(TOY, BARE, engine=FLAT)
    cost = cm.cost(cm.work([SeqWork(1, 100, True)]))
    weight_bytes = (2**25 + 1000 * 1024) * 2  # every weight once, the LM head included, bf16
    flops = 2 * 2**25 + 2 * 1000 * 1024
    assert cost.linear_s == pytest.approx(weight_bytes / 1e12)
    assert flops / 1e14 < cost.linear_s / 50
    # Attention: the whole context read plus the new token written; its FLOPs are negligible.
    assert cost.attention_s == pytest.approx((100 + 1) * 8192 / 1e12)


def test_large_prefill_is_compute_bound() -> None:
    cm = CostModel(TOY, BARE, engine=FLAT)
    cost = cm.cost(cm.work([SeqWork(4096, 4096, True)]))
    flops = 4096 * 2 * 2**25 + 2 * 1000 * 1024
    assert cost.linear_s == pytest.approx(flops / 1e14)
    pairs = 4096 * 4097 // 2  # causal
    assert cost.attention_s == pytest.approx(pairs * 4 * 2 * 8 * 128 / 1e14)


def test_attention_time_grows_with_context() -> None:
    cm = CostModel(TOY, BARE, engine=FLAT)
    times = [cm.cost(cm.work([SeqWork(1, c, True)] * 32)).attention_s for c in (128, 1024, 8192)]
    assert times[0] < times[1] < times[2]
    assert times[2] / times[1] == pytest.approx(8193 / 1025)
    chunk = [cm.cost(cm.work([SeqWork(512, 512 + start, False)])).attention_s for start in (0, 2048)]
    assert chunk[1] > chunk[0]


def test_tensor_parallel_halves_the_work_and_adds_all_reduces() -> None:
    one, two = CostModel(TOY, BARE, engine=FLAT), CostModel(TOY, BARE, tp=2, engine=FLAT)
    batch = [SeqWork(4096, 4096, True)]
    c1, c2 = one.cost(one.work(batch)), two.cost(two.work(batch))
    assert c2.linear_s == pytest.approx(c1.linear_s / 2)
    assert c2.attention_s == pytest.approx(c1.attention_s / 2)
    all_reduce = 1e-6 + 2 * (1 / 2) * (4096 * 1024 * 2) / 1e11
    assert c1.comm_s == 0 and c2.comm_s == pytest.approx(2 * 2 * all_reduce)
    assert two.weight_bytes_per_device == pytest.approx(one.weight_bytes_per_device / 2)
    with pytest.raises(ConfigError):
        CostModel(TOY, BARE, tp=3, engine=FLAT)  # 8 heads do not split over 3 devices


def test_small_batch_matmuls_cost_a_pass_per_extra_row() -> None:
    engine = dataclasses.replace(FLAT, small_batch_max_rows=3, small_batch_row_s=0.01, gemm_step_s=0.005)
    base, cm = CostModel(TOY, BARE, engine=FLAT), CostModel(TOY, BARE, engine=engine)
    for rows, extra in ((1, 0.0), (2, 0.01), (3, 0.02), (4, 0.005), (64, 0.005)):
        batch = [SeqWork(1, 100, True)] * rows
        assert cm.step_time(batch) - base.step_time(batch) == pytest.approx(extra)


def test_overheads_and_the_sum_form() -> None:
    engine = dataclasses.replace(FLAT, step_overhead_s=1e-3, request_overhead_s=1e-5, roofline="sum")
    cm = CostModel(TOY, BARE, engine=engine)
    cost = cm.cost(cm.work([SeqWork(1, 100, True)] * 4))
    assert cost.overhead_s == pytest.approx(1e-3 + 4e-5)
    assert cost.linear_s == pytest.approx(4 * (2 * 2**25 + 2 * 1000 * 1024) / 1e14 + (2**25 + 1000 * 1024) * 2 / 1e12)
    assert cm.step_time([]) == pytest.approx(1e-3)


def test_per_layer_cost_and_cuda_graphs() -> None:
    engine = dataclasses.replace(FLAT, layer_overhead_s=10e-6, cuda_graphs=True, cuda_graph_max_batch=4,
                                 graph_layer_overhead_s=2e-6)
    cm = CostModel(TOY, BARE, engine=engine)
    launch = [cm.cost(cm.work(batch)).launch_s for batch in
              ([SeqWork(1, 100, True)] * 4, [SeqWork(1, 100, True)] * 5, [SeqWork(64, 64, True)], [])]
    # Decodes up to the captured batch replay a graph; more, or a prefill, launch eagerly; no work, no layers.
    assert launch == pytest.approx([2 * 2e-6, 2 * 10e-6, 2 * 10e-6, 0.0])
    eager = CostModel(TOY, BARE, engine=dataclasses.replace(engine, cuda_graphs=False))
    assert eager.cost(eager.work([SeqWork(1, 100, True)])).launch_s == pytest.approx(2 * 10e-6)
    deeper = CostModel(dataclasses.replace(TOY, num_layers=4), BARE, engine=engine)
    assert deeper.cost(deeper.work([SeqWork(64, 64, True)])).launch_s == pytest.approx(4 * 10e-6)


def test_all_reduce_is_zero_at_tp_1_and_grows_with_tp_and_message() -> None:
    engine = dataclasses.replace(FLAT, allreduce_latency_s=5e-6, allreduce_peer_latency_s=1e-6,
                                 allreduce_bandwidth_efficiency=0.5)

    def comm(tp: int, tokens: int) -> float:
        cm = CostModel(TOY, BARE, tp=tp, engine=engine)
        return cm.cost(cm.work([SeqWork(tokens, tokens, True)])).comm_s

    assert comm(1, 4096) == 0.0
    by_tp = [comm(tp, 256) for tp in (2, 4, 8)]
    assert by_tp[0] < by_tp[1] < by_tp[2]
    by_size = [comm(4, n) for n in (1, 64, 4096)]
    assert by_size[0] < by_size[1] < by_size[2]
    one = 5e-6 + 3 * 1e-6 + 2 * 3 / 4 * (4096 * 1024 * 2) / (1e11 * 0.5)  # tp 4: 3 peers, ring traffic
    assert comm(4, 4096) == pytest.approx(2 * 2 * one)  # two per layer, 2 layers


@pytest.mark.parametrize("name", ["vllm", "sglang", "trtllm", "inflight"])
def test_step_time_is_monotone_in_batch_context_and_tp(name: str) -> None:
    hw, engine = load_profiles("h100", name)
    seventy = BUILTIN_MODELS["llama-3-70b"]
    cm = CostModel(BUILTIN_MODELS["llama-3-8b"], hw, engine=engine)
    by_batch = [cm.step_time([SeqWork(1, 1024, True)] * b) for b in (1, 2, 8, 32, 64, 128, 256, 512, 1024)]
    assert all(a <= b for a, b in zip(by_batch, by_batch[1:], strict=False)), by_batch
    by_context = [cm.step_time([SeqWork(1, c, True)] * 64) for c in (128, 1024, 8192, 32768)]
    assert all(a < b for a, b in zip(by_context, by_context[1:], strict=False)), by_context
    prefill = [cm.step_time([SeqWork(n, n, True)]) for n in (16, 256, 2048, 8192)]
    assert all(a < b for a, b in zip(prefill, prefill[1:], strict=False)), prefill
    # More devices: less work on each, more communication.
    costs = [CostModel(seventy, hw, tp, engine=engine).cost(CostModel(seventy, hw, tp, engine=engine).work(
        [SeqWork(1, 1024, True)] * 64)) for tp in (2, 4, 8)]
    assert [c.comm_s for c in costs] == sorted(c.comm_s for c in costs) and costs[0].comm_s > 0
    assert costs[0].linear_s > costs[1].linear_s > costs[2].linear_s


def test_smooth_roofline_lies_between_max_and_sum() -> None:
    from inflight.perf.cost_model import combine

    for k in (1.5, 2.0, 4.0):
        engine = dataclasses.replace(FLAT, roofline="smooth", roofline_exponent=k)
        assert max(3.0, 4.0) < combine(3.0, 4.0, engine) < 3.0 + 4.0
        assert combine(0.0, 4.0, engine) == pytest.approx(4.0)
        assert combine(1.0, 100.0, engine) == pytest.approx(100.0, rel=1e-2)  # far from the ridge: the max
    at_ridge = [combine(1.0, 1.0, dataclasses.replace(FLAT, roofline="smooth", roofline_exponent=k)) for k in (2, 4)]
    assert at_ridge == pytest.approx([2**0.5, 2**0.25])
    with pytest.raises(ConfigError, match="roofline"):
        dataclasses.replace(FLAT, roofline="curvy")
    with pytest.raises(ConfigError, match="roofline_exponent"):
        dataclasses.replace(FLAT, roofline="smooth", roofline_exponent=0.5)


def test_overlapped_scheduling_hides_the_cpu_overhead() -> None:
    engine = dataclasses.replace(FLAT, step_overhead_s=1e-3, request_overhead_s=0.0)
    serial, overlapped = (CostModel(TOY, BARE, engine=dataclasses.replace(engine, overlap_scheduling=o))
                          for o in (False, True))
    small, large = [SeqWork(1, 100, True)], [SeqWork(4096, 4096, True)]
    device_small = serial.cost(serial.work(small)).device_s
    assert device_small < 1e-3
    assert serial.step_time(small) == pytest.approx(device_small + 1e-3)
    assert overlapped.step_time(small) == pytest.approx(1e-3)  # the CPU side is the longer
    assert overlapped.step_time(large) == pytest.approx(overlapped.cost(overlapped.work(large)).device_s)


@pytest.mark.parametrize("replicas", [1, 2])
def test_overlapped_scheduling_takes_a_request_a_step_later(replicas: int) -> None:
    """An engine that forms step k+1's batch while step k runs cannot give a request that arrives
    during step k a place before step k+2; an idle engine takes one at once. A fleet's replicas
    schedule the same way."""
    from inflight.bench.workload import BenchRequest

    # Steps of 10 ms (the CPU side; the device adds under 0.1 ms without overlap) from t = 0.
    engine = dataclasses.replace(FLAT, step_overhead_s=10e-3)
    target = SimTarget("toy", TOY, BARE, engine=engine)
    requests = [BenchRequest(0, list(range(8)), "", 40, 0.0),
                BenchRequest(1, list(range(50, 58)), "", 40, 0.001),
                BenchRequest(2, list(range(100, 108)), "", 4, 0.025)]  # during the step of [20, 30] ms
    ttft = {}
    for overlap in (False, True):
        profile = dataclasses.replace(engine, overlap_scheduling=overlap)
        # Round-robin: the first and the last to one replica, the second to the other.
        run = simulate(dataclasses.replace(target, engine=profile),
                       {"num_kv_blocks": 64, "replicas": replicas, "router": "round-robin"}, requests)
        assert run.metrics.num_completed == 3
        ttft[overlap] = [r.ttft_s for r in run.capture.results]
    # Serial: the last joins the step of [30, 40]. Overlapped: that batch was formed at 20 ms.
    assert ttft[False][2] == pytest.approx(0.015, abs=1e-3)
    assert ttft[True][2] == pytest.approx(0.025, abs=1e-3)
    # The first finds its engine idle and is taken at once either way.
    assert ttft[True][0] == pytest.approx(ttft[False][0], abs=1e-3) == pytest.approx(0.010, abs=1e-3)


def test_eight_bit_weights_and_kv_cache() -> None:
    llama = BUILTIN_MODELS["llama-3-8b"]
    h100, a100 = load_hardware("h100"), load_hardware("a100-80gb")
    bf16, fp8 = CostModel(llama, h100), CostModel(llama, h100, weight_dtype="fp8", kv_cache_dtype="fp8")
    linear = num_linear_params(llama)
    # The matmul weights in one byte; embedding, LM head and norms stay in bf16.
    assert fp8.weight_bytes_per_device == linear + (num_params(llama) - linear) * 2
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token // 2 == 2 * 32 * 8 * 128
    blocks = fp8.num_kv_blocks(16, 0.9)
    assert blocks == int((79.2 * 2**30 * 0.9 - fp8.weight_bytes_per_device) // (16 * 2 * 32 * 8 * 128))
    assert blocks > 2 * bf16.num_kv_blocks(16, 0.9)  # half the bytes per token, and more memory left
    # FP8 matmuls on H100's FP8 tensor cores; A100 has none, so its fp8 weights are only smaller.
    assert fp8.linear_peak_flops == h100.peak_flops_fp8 == pytest.approx(2 * h100.peak_flops, rel=1e-3)
    assert CostModel(llama, a100, weight_dtype="fp8").linear_peak_flops == a100.peak_flops
    assert CostModel(llama, a100, weight_dtype="int8").linear_peak_flops == a100.peak_flops_int8
    decode, prefill = [SeqWork(1, 1024, True)] * 8, [SeqWork(4096, 4096, True)]
    assert fp8.step_time(decode) < 0.7 * bf16.step_time(decode)  # weight-bound: half the bytes
    assert fp8.step_time(prefill) < 0.7 * bf16.step_time(prefill)  # compute-bound: twice the peak
    # An engine whose 8-bit matmuls reach half the share of their peak: no faster than bf16 in compute.
    halved = dataclasses.replace(BUILTIN_ENGINES["vllm"], eight_bit_flops_efficiency=0.5 * BUILTIN_ENGINES["vllm"]
                                 .flops_efficiency, roofline="max")
    slow8 = CostModel(llama, h100, engine=halved, weight_dtype="fp8")
    plain = CostModel(llama, h100, engine=dataclasses.replace(halved, eight_bit_flops_efficiency=0.0))
    linear = [cm.cost(cm.work(prefill)).linear_s for cm in (slow8, plain)]
    assert linear[0] == pytest.approx(linear[1], rel=1e-3)
    # An engine that quantizes its LM head too (inflight's int8, llama.cpp's files): the head an
    # 8-bit matmul among the rest, its weights a byte each (an untied head in place of its bf16).
    head = llama.vocab_size * llama.hidden_size
    head8 = CostModel(llama, h100, engine=dataclasses.replace(BUILTIN_ENGINES["vllm"], quantized_lm_head=True),
                      weight_dtype="fp8")
    assert head8.weight_bytes_per_device == fp8.weight_bytes_per_device - head
    rows = [SeqWork(1, 1024, True)] * 64
    assert head8.work(rows).linear_compute_s == pytest.approx(
        fp8.work(rows).linear_compute_s - 64 * 2 * head / h100.peak_flops + 64 * 2 * head / h100.peak_flops_fp8)
    assert head8.work(rows).linear_bytes == pytest.approx(fp8.work(rows).linear_bytes - head)
    with pytest.raises(ConfigError, match="unknown KV cache dtype"):
        CostModel(llama, h100, kv_cache_dtype="fp4")
    with pytest.raises(ConfigError, match="storage type"):
        CostModel(llama, h100, dtype="fp8")


def test_short_convolutions_priced_as_the_engine_keeps_them() -> None:
    """LFM2's convolving layers: no attention, in_proj and out_proj for q/k/v and o, and a
    `hidden_size` row a token in the pool beside the attending layers' K and V (the engine's
    `ModelConfig.pool_values_per_token`); a step reads the attending layers' K and V only."""
    import dataclasses as dc

    base = dc.replace(BUILTIN_MODELS["llama-3-8b"], num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                      head_dim=64, intermediate_size=8192)
    conv = (True, True, False) * 5 + (False,)  # 10 convolve, 6 attend
    lfm2 = dc.replace(base, architecture="lfm2", conv_layers=conv, conv_kernel=3)
    h100 = load_hardware("h100")
    full, short = CostModel(base, h100), CostModel(lfm2, h100)
    assert lfm2.num_attention_layers == 6 and lfm2.pool_values_per_token == 6 * 2 * 8 * 64 + 10 * 2048
    assert short.kv_bytes_per_block(16) == 16 * lfm2.pool_values_per_token * 2  # bf16
    attn = 2048 * (2048 + 2 * 512) + 2048 * 2048
    assert num_params(base) - num_params(lfm2) == 10 * (attn - 4 * 2048 * 2048)
    rows = [SeqWork(1, 1024, True)] * 8
    for (flops, read), (full_flops, full_read) in zip(short.work(rows).attention, full.work(rows).attention,
                                                      strict=True):
        assert (flops, read) == pytest.approx((full_flops * 6 / 16, full_read * 6 / 16))


def test_kv_capacity_from_memory_left_after_weights() -> None:
    h100 = load_hardware("h100")
    cm = CostModel(BUILTIN_MODELS["llama-3-8b"], h100)
    per_block = 16 * 2 * 32 * 8 * 128 * 2  # 16 tokens, K and V, 32 layers, 8 KV heads, bf16
    assert cm.kv_bytes_per_block(16) == per_block
    expected = int((79.2 * 2**30 * 0.9 - num_params(BUILTIN_MODELS["llama-3-8b"]) * 2) // per_block)
    assert cm.num_kv_blocks(16, 0.9) == expected
    seventy = BUILTIN_MODELS["llama-3-70b"]
    with pytest.raises(ConfigError, match="raise --tp"):
        CostModel(seventy, h100).num_kv_blocks(16)
    assert CostModel(seventy, h100, tp=4).num_kv_blocks(16) > 0
    cpu = CostModel(BUILTIN_MODELS["smollm2-135m"], load_hardware("cpu-local"))
    per_block = 16 * 2 * 30 * 3 * 64 * 4  # fp32 on the CPU
    assert cpu.dtype_bytes == 4 and cpu.num_kv_blocks(16, kv_cache_memory_bytes=int(62.5 * per_block)) == 62
    assert cpu.num_kv_blocks(16, kv_cache_memory_fraction=0.1) == int(0.1 * 16 * 2**30 // per_block)


def test_published_shapes() -> None:
    billions = {name: num_params(cfg) / 1e9 for name, cfg in BUILTIN_MODELS.items()}
    assert billions["llama-3-8b"] == pytest.approx(8.03, abs=0.01)
    assert billions["llama-3-70b"] == pytest.approx(70.55, abs=0.01)
    assert billions["mistral-7b"] == pytest.approx(7.24, abs=0.01)
    assert billions["qwen2.5-7b"] == pytest.approx(7.61, abs=0.01)
    assert billions["smollm2-135m"] == pytest.approx(0.1345, abs=0.001)
    assert billions["mixtral-8x7b"] == pytest.approx(46.70, abs=0.01)
    assert billions["qwen3-30b-a3b"] == pytest.approx(30.53, abs=0.01)


def test_routed_experts_cost_their_active_parameters_and_the_experts_a_step_touches() -> None:
    """Qwen3-30B-A3B (128 experts, 8 per token, published as 3.3B active): a token computes with
    its 8 experts only; a step reads the weights of the experts its tokens chose, a few at one
    token, nearly all at 64."""
    cfg = BUILTIN_MODELS["qwen3-30b-a3b"]
    embeddings = 2 * cfg.vocab_size * cfg.hidden_size
    assert (num_active_linear_params(cfg) + embeddings) / 1e9 == pytest.approx(3.35, abs=0.01)
    assert num_linear_params(cfg) > 9 * num_active_linear_params(cfg)
    assert experts_touched(cfg, 1) == 8 and 125 < experts_touched(cfg, 64) < 128
    h100 = load_hardware("h100")
    moe, dense = CostModel(cfg, h100), CostModel(BUILTIN_MODELS["llama-3-8b"], h100)
    one, many = moe.work([SeqWork(1, 100, 1)]), moe.work([SeqWork(1, 100, 1)] * 64)
    assert many.linear_bytes > 8 * one.linear_bytes  # 8 experts a layer read at one token, ~126 at 64
    assert one.linear_compute_s < dense.work([SeqWork(1, 100, 1)]).linear_compute_s / 2


def test_shapes_from_a_config_json(tmp_path: Path) -> None:
    raw = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for given in (tmp_path, tmp_path / "config.json"):
        _, shapes = resolve_shapes(str(given))
        assert shapes == dataclasses.replace(BUILTIN_MODELS["mistral-7b"], rms_norm_eps=1e-6,
                                             rope_theta=1e4, max_position_embeddings=4096)
    assert resolve_shapes("Meta-Llama-3-8B")[1] is BUILTIN_MODELS["llama-3-8b"]
    with pytest.raises(ConfigError, match="unknown model"):
        resolve_shapes("gpt-9")


def test_loader_and_simulator_read_a_config_json_alike(tmp_path: Path) -> None:
    """One parser: a multimodal config's nested decoder, newer configs' rope_parameters, and
    Qwen2's q/k/v biases come out the same for the engine's loader and the simulator."""
    from inflight.model.loader import ModelSource, load_model_config

    text = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "eos_token_id": [7, 8]}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "text_config": text}))
    engine_view = load_model_config(ModelSource(tmp_path, "hf"))
    assert resolve_shapes(str(tmp_path))[1] == engine_view
    assert engine_view.attention_bias and engine_view.rope_theta == 500000.0 and engine_view.rope_scaling is None
    assert engine_view.head_dim == 64 and engine_view.eos_token_ids == (7, 8)


def test_hardware_profiles_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    BUILTIN_HARDWARE["l4"].save(path)
    assert load_hardware(str(path)) == BUILTIN_HARDWARE["l4"]
    path.write_text(json.dumps({"schema": "inflight-sim-hardware/1", "name": "x"}))
    with pytest.raises(ConfigError):
        load_hardware(str(path))
    with pytest.raises(ConfigError, match="unknown hardware"):
        load_hardware("tpu-v9")


def test_profile_files_and_their_errors(tmp_path: Path) -> None:
    path = tmp_path / "machine.json"
    hw, engine = load_profiles("cpu-local")
    save_profile(path, hw, engine)
    assert load_profiles(str(path)) == (hw, engine)
    assert load_profiles(str(path), "inflight") == (hw, engine)
    # A file of the first schema (hardware and factors in one record), as calibrate wrote them.
    legacy_hw, legacy = load_profiles(str(ROOT / "benchmarks/sim/results/cpu-zen3-1thread.json"))
    assert legacy_hw.kind == legacy.kind == "cpu" and legacy.name == "inflight" and legacy.gemm_step_s > 0
    engine_path = tmp_path / "engine.json"
    dataclasses.replace(BUILTIN_ENGINES["vllm"], name="mine").save(engine_path)
    assert load_profiles("h100", str(engine_path))[1].name == "mine"
    assert load_profiles("h100")[1] is BUILTIN_ENGINES["vllm"]  # the default on a GPU
    assert load_profiles("h100", "inflight")[1] is BUILTIN_ENGINES["inflight"]
    with pytest.raises(ConfigError, match="is for a gpu"):
        load_profiles("cpu-local", "vllm")
    with pytest.raises(ConfigError, match="unknown engine profile"):
        load_profiles("h100", "tgi")
    engine_path.write_text(json.dumps({"schema": "inflight-sim-engine/1", "name": "x", "warp_speed": 9}))
    with pytest.raises(ConfigError, match="unknown fields"):
        load_profiles("h100", str(engine_path))
    with pytest.raises(ConfigError, match="must be > 0"):
        EngineProfile("x", flops_efficiency=0)
    with pytest.raises(ConfigError, match="must be >= 0"):
        EngineProfile("x", layer_overhead_s=-1e-6)


def test_fit_recovers_per_layer_and_all_reduce_terms() -> None:
    """Steps of two models at several TP degrees separate a per-layer cost from a per-step one,
    and an all-reduce's fixed cost from its per-peer one and its bandwidth."""
    h100 = load_hardware("h100")
    truth = dataclasses.replace(BUILTIN_ENGINES["trtllm"], roofline="max", flops_efficiency=0.65,
                                bandwidth_efficiency=0.85, attention_flops_efficiency=0.45,
                                attention_bandwidth_efficiency=0.75, step_overhead_s=7e-4, request_overhead_s=4e-6,
                                overlap_scheduling=False, layer_overhead_s=30e-6, cuda_graphs=True,
                                cuda_graph_max_batch=64, graph_layer_overhead_s=6e-6, allreduce_latency_s=9e-6,
                                allreduce_peer_latency_s=2e-6, allreduce_bandwidth_efficiency=0.7)
    samples = []
    for shapes, tps in ((BUILTIN_MODELS["llama-3-8b"], (1, 2)), (BUILTIN_MODELS["llama-3-70b"], (4, 8))):
        for tp in tps:
            cm = CostModel(shapes, h100, tp, engine=truth)
            for batch in _grid_batches() + [tuple([SeqWork(1, 512, True)] * 200)]:
                cost = cm.cost(cm.work(batch))
                samples.append(Sample(batch, cost.total_s, cost.device_s, shapes, tp))
    start = dataclasses.replace(truth, layer_overhead_s=0.0, graph_layer_overhead_s=0.0, allreduce_latency_s=0.0,
                                allreduce_peer_latency_s=0.0, allreduce_bandwidth_efficiency=1.0,
                                flops_efficiency=0.5, bandwidth_efficiency=0.5)
    result = fit_profile(samples, BUILTIN_MODELS["llama-3-8b"], h100, start, rooflines=("max",),
                         small_batch_rows=(1,))
    for name in ("flops_efficiency", "bandwidth_efficiency", "attention_bandwidth_efficiency", "step_overhead_s",
                 "request_overhead_s", "layer_overhead_s", "graph_layer_overhead_s", "allreduce_latency_s",
                 "allreduce_peer_latency_s", "allreduce_bandwidth_efficiency"):
        assert getattr(result.profile, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert np.allclose(result.predicted_s, result.measured_s, rtol=1e-6)


# --- calibration ----------------------------------------------------------------------------------


def _grid_batches() -> list[tuple[SeqWork, ...]]:
    batches = [tuple([SeqWork(1, c, True)] * b) for b in (1, 2, 3, 8, 32, 64, 128) for c in (64, 2048)]
    batches += [(SeqWork(n, n + s, s == 0),) for n in (128, 512, 2048) for s in (0, 1024)]
    batches += [(SeqWork(256, 256, True), *[SeqWork(1, 700, True)] * 16)]
    return batches


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
@pytest.mark.parametrize("form, small_rows", [("max", 1), ("sum", 3), ("smooth", 1)])
def test_fit_recovers_a_known_profile(form: str, small_rows: int, seed: int | None) -> None:
    """Exact samples, and samples off by a few units in the last place (`seed`): the rounding
    that differs between machines' BLAS and SIMD builds must not change what the fit finds."""
    hardware = BUILTIN_HARDWARE["cpu-local"]
    truth = dataclasses.replace(INFLIGHT_CPU, roofline=form, roofline_exponent=4.0, flops_efficiency=0.3,
                                bandwidth_efficiency=0.5, attention_flops_efficiency=0.2,
                                attention_bandwidth_efficiency=0.6, step_overhead_s=4e-4,
                                request_overhead_s=3e-5, small_batch_max_rows=small_rows,
                                small_batch_row_s=0.01 if small_rows > 1 else 0.0,
                                gemm_step_s=0.005 if small_rows > 1 else 0.0)
    shapes = BUILTIN_MODELS["smollm2-135m"]
    cm = CostModel(shapes, hardware, engine=truth)
    rng = np.random.default_rng(seed)
    samples = []
    for batch in _grid_batches():
        cost = cm.cost(cm.work(batch))
        forward_s, rest_s = cost.linear_s + cost.attention_s, cost.overhead_s
        if seed is not None:
            forward_s, rest_s = (t * (1 + 1e-13 * rng.standard_normal()) for t in (forward_s, rest_s))
        samples.append(Sample(batch, forward_s + rest_s, forward_s))
    result = fit_profile(samples, shapes, hardware, INFLIGHT_CPU)
    fitted = result.profile
    assert fitted.roofline == form and not result.outliers.any()
    assert form != "smooth" or fitted.roofline_exponent == truth.roofline_exponent
    assert fitted.small_batch_max_rows == small_rows
    for name in ("flops_efficiency", "bandwidth_efficiency", "step_overhead_s", "request_overhead_s",
                 "attention_bandwidth_efficiency", "small_batch_row_s", "gemm_step_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert np.allclose(predict(samples, CostModel(shapes, hardware, engine=fitted)), result.measured_s, rtol=1e-3)


def test_fit_tells_a_steps_weight_bytes_from_its_blocks_decoding() -> None:
    """Steps of a model in its Q4_1 blocks, of a BF16 copy and of a copy twice as wide (as
    `inflight sim calibrate` times them) give the bandwidth, the decoding per kept parameter and
    the per-layer cost apart; from one storage alone the fit leaves the decoding out, which the
    other terms then price."""
    from inflight.config import MatmulStorage

    hardware = BUILTIN_HARDWARE["cpu-local"]
    truth = dataclasses.replace(INFLIGHT_CPU, roofline="smooth", roofline_exponent=4.0, flops_efficiency=0.3,
                                bandwidth_efficiency=0.9, step_overhead_s=4e-4, request_overhead_s=3e-5,
                                small_batch_max_rows=1, small_batch_row_s=0.0, gemm_step_s=0.001,
                                weights_as_stored=True, block_decode_s=25e-12, block_decode_rows_s=10e-12,
                                block_decode_weights={"Q4_1": 1.0, "BF16": 0.6}, as_stored={}, fitted_storage={})
    shapes = BUILTIN_MODELS["smollm2-135m"]
    q4 = MatmulStorage(0.625, 0.625, 1.0625, 1, 1, 1, (("Q4_1", 1.0),), (("Q4_1", 1.0),), (("Q8_0", 1.0),))
    bf16 = q4._replace(dense=2, experts=2, dense_types=(("BF16", 1.0),), experts_types=(("BF16", 1.0),))
    wide = dataclasses.replace(shapes, hidden_size=2 * shapes.hidden_size, num_heads=2 * shapes.num_heads,
                               num_kv_heads=2 * shapes.num_kv_heads, intermediate_size=2 * shapes.intermediate_size,
                               num_layers=8)
    copies = [(SeqWork(1, 64, True),) * b for b in (1, 2, 4, 16)]
    samples = []
    for model, storage, batches in ((shapes, q4, _grid_batches()), (shapes, bf16, copies), (wide, q4, copies)):
        cm = CostModel(model, hardware, engine=truth, matmul_storage=storage)
        for batch in batches:
            cost = cm.cost(cm.work(batch))
            sample = Sample(batch, cost.total_s, cost.linear_s + cost.attention_s + cost.launch_s)
            samples.append(sample if batches is not copies else sample._replace(shapes=model, storage=storage))
    start = dataclasses.replace(INFLIGHT_CPU, weights_as_stored=True, block_decode_s=0.0,
                                block_decode_weights=truth.block_decode_weights)  # as timed by the calibration
    fit = {"rooflines": ("smooth",), "exponents": (4.0,), "small_batch_rows": (1,), "matmul_storage": q4}
    fitted = fit_profile(samples, shapes, hardware, start, **fit).profile
    for name in ("block_decode_s", "block_decode_rows_s", "bandwidth_efficiency", "flops_efficiency", "gemm_step_s",
                 "layer_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    one_type = fit_profile([s for s in samples if s.storage is None], shapes, hardware, start, **fit).profile
    assert one_type.block_decode_s == one_type.block_decode_rows_s == 0
    assert one_type.bandwidth_efficiency < truth.bandwidth_efficiency


def test_measure_times_real_engine_steps_with_their_composition(loaded: LoadedModel) -> None:
    import torch

    engine = LLMEngine(EngineConfig.from_kwargs(None, num_kv_blocks=64, max_batch_size=8), loaded)
    kinds: list[tuple[int, int]] = []  # per step: (decode tokens, prefill tokens), as the engine ran it
    engine.step_observers.append(lambda record, _: kinds.append((record.num_decode_tokens,
                                                                 record.num_prefill_tokens)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibration runs; two threads stall on a busy 2-core machine
    try:
        samples = measure(engine, [StepCase(3, 40, 2, 16), StepCase(0, 0, 1, 8, 32)])
    finally:
        torch.set_num_threads(threads)
    batches = [s.batch for s in samples]
    # Seated requests decode from their first step (no prefill; not a one-token prompt chunk,
    # which attention would run as a prefill), beside a fresh prompt.
    assert batches[:3] == [(SeqWork(1, 41, True),) * 3 + (SeqWork(16, 16, True),),
                           (SeqWork(1, 42, True),) * 3, (SeqWork(1, 43, True),) * 3]
    assert kinds[:3] == [(3, 16), (3, 0), (3, 0)]
    # A chunk after a cached context: its 32 tokens computed first, then found in the cache.
    assert batches[3:] == [(SeqWork(33, 33, True),), (SeqWork(8, 40, True),)]
    assert all(s.duration_s >= s.forward_s > 0 for s in samples)
    assert "schedule" not in vars(engine.scheduler) and not engine.has_unfinished()
    engine.block_manager.check_invariants()


def test_replaying_a_timeline_prices_each_step_as_it_ran() -> None:
    from inflight.sim.validate import replay_steps

    requests = small_requests(arrivals={"kind": "burst"})
    cm = CostModel(BUILTIN_MODELS["llama-3-8b"], load_hardware("h100"))
    engine = sim_engine(EngineConfig.from_kwargs(None, num_kv_blocks=4000, max_num_tokens=256), cm)
    capture = run_simulation(engine, requests)
    replay = replay_steps(capture.timeline, requests, cm)
    assert replay.num_steps == len(capture.timeline.steps) and replay.num_stalled == 0
    assert replay.predicted_s == pytest.approx(replay.measured_s, rel=1e-9)
    assert replay.median_ratio == pytest.approx(1.0)


def test_replaying_a_speculating_streams_timeline_counts_its_kept_proposals() -> None:
    """One stream verifying proposed tokens: each step's rows and the context they see, grown by
    the proposals kept before, rebuilt from the timeline, so that each step prices as it ran."""
    from inflight.sim.validate import replay_steps

    requests = small_requests(arrivals={"kind": "burst"}, num_requests=4)
    cm = CostModel(BUILTIN_MODELS["llama-3-8b"], load_hardware("h100"))
    config = EngineConfig.from_kwargs(None, num_kv_blocks=4000, max_num_tokens=256,
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    capture = run_simulation(sim_engine(config, cm, acceptance_rate=0.7), requests, max_concurrency=1)
    steps = capture.timeline.steps
    assert sum(s.num_accepted_tokens for s in steps) > 0  # proposals kept, so contexts grew by them
    replay = replay_steps(capture.timeline, requests, cm)
    assert replay.predicted_s == pytest.approx(replay.measured_s, rel=1e-9)


# --- tune and the command line --------------------------------------------------------------------


def test_tune_returns_only_configurations_that_pass() -> None:
    spec = parse_workload({**SMALL, "num_requests": 60, "arrivals": {"kind": "poisson", "rate": 8.0},
                           "prompt_len": {"kind": "uniform", "min": 16, "max": 1900}})
    space = SearchSpace((256, 1024, 2048), (8, 64), (True, False))
    loose = Tuner(h100_llama(), spec, SLA(), {})
    everything = loose.search(space)
    assert len(everything) == 8  # whole-prompt configs with a budget under the longest prompt are not tried
    tbt = sorted(c.run.metrics.tbt_ms.p99 for c in everything)
    sla = SLA(max_tbt_p99_ms=(tbt[3] + tbt[4]) / 2, max_failed_requests=0)
    tuner = Tuner(h100_llama(), spec, sla, {})
    passing = tune(tuner, space)
    assert 0 < len(passing) < len(everything)
    throughputs = [c.run.metrics.output_throughput for c in passing]
    assert throughputs == sorted(throughputs, reverse=True)
    for candidate in passing:
        again = simulate(h100_llama(), candidate.overrides, synthetic_requests(spec))
        assert all(line.passed for line in check_run(sla, again, spec.name))


def test_max_rate_is_the_edge_of_passing() -> None:
    spec = parse_workload({**SMALL, "num_requests": 80, "arrivals": {"kind": "poisson", "rate": 2.0}})
    sla = SLA(max_ttft_p99_ms=150.0)
    tuner = Tuner(h100_llama(), spec, sla, {})
    overrides = {"max_num_tokens": 512, "max_batch_size": 32, "enable_chunked_prefill": True}
    rate = tuner.max_rate(overrides, start=2.0)
    assert rate is not None and rate > 2.0
    from inflight.bench.workload import with_request_rate

    def ttft_p99(r: float) -> float:
        return tuner.evaluate(overrides, with_request_rate(spec, r))[0].metrics.ttft_ms.p99

    assert ttft_p99(rate) <= 150.0 < ttft_p99(rate * 1.1)
    downward = tuner.max_rate(overrides, start=rate * 8)  # fails there: halves, then bisects
    assert downward is not None and downward == pytest.approx(rate, rel=0.1)
    assert Tuner(h100_llama(), spec, SLA(max_ttft_p99_ms=0.001), {}).max_rate(overrides, 2.0) is None


def test_cli_sim_output_passes_through_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(yaml.safe_dump(SMALL))
    sla = tmp_path / "sla.yaml"
    sla.write_text(yaml.safe_dump({"workload": "small", "max_failed_requests": 0, "max_ttft_p99_ms": 1e6}))
    out = tmp_path / "run.json"
    args = ["sim", "--workload", str(workload), "--model", "llama-3-8b", "--hardware", "h100", "--tp", "2",
            "--compare", "static,chunked", "-o", str(out)]
    assert main(args) == 0
    assert "inflight sim: small" in capsys.readouterr().out
    document, runs = read_run_file(out)
    assert [r.label for r in runs] == ["static", "chunked"] and document["target"]["tp"] == 2
    assert runs[1].capture.timeline is not None and runs[1].metrics.num_completed == 40
    assert main(["check", "--sla", str(sla), str(out)]) == 0
    sla.write_text(yaml.safe_dump({"max_tbt_p99_ms": 0.001}))
    assert main(["check", "--sla", str(sla), str(out)]) == 1
    assert main(["sim", "--model", "llama-3-8b"]) == 2  # no --workload
    assert main(["tune", "--workload", str(workload), "--sla", str(sla), "--model", "llama-3-8b",
                 "--hardware", "h100", "--max-num-tokens-grid", "512", "--max-batch-size-grid", "16"]) == 1


# --- weights priced as stored ---------------------------------------------------------------------


def test_a_checkpoints_matrices_are_priced_at_the_bytes_a_step_reads_of_them(tmp_path: Path) -> None:
    """A GGUF file's matrices the CPU kernels keep in their blocks cost their packed bytes and
    their decoding, those widened (F32) four bytes and no decoding, each averaged over its part; a
    tied head is the embedding's blocks."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_loading import TINY, write_tiny_gguf

    from inflight.config import MatmulStorage
    from inflight.model.loader import PACKED_BYTES, matmul_storage, resolve_model

    types = {"embd": "Q6_K", "q": "Q8_0", "k": "Q8_0", "v": "Q8_0", "o": "Q4_1", "gate": "Q4_K", "up": "Q4_K",
             "down": "F32"}
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, types)
    h, f, kv = TINY["hidden"], TINY["intermediate"], TINY["kv_heads"] * TINY["hidden"] // TINY["heads"]
    sizes = {"q": h * h, "k": kv * h, "v": kv * h, "o": h * h, "gate": f * h, "up": f * h, "down": h * f}
    per_layer = sum(n * (PACKED_BYTES[types[m]] if types[m] != "F32" else 4) for m, n in sizes.items())
    dense = per_layer / sum(sizes.values())
    kept = 1 - sizes["down"] / sum(sizes.values())
    stored = matmul_storage(resolve_model(path))
    assert stored.identity() == pytest.approx(MatmulStorage(dense, dense, PACKED_BYTES["Q6_K"], kept, kept, 1.0)
                                              .identity())
    assert 0.9 < stored.dense < 4  # between the blocks' bytes and fp32's
    # The kept parameters by type: each type's share of the part, its decoding weighed by type.
    total = sum(sizes.values())
    shares = {"Q8_0": (sizes["q"] + sizes["k"] + sizes["v"]) / total, "Q4_1": sizes["o"] / total,
              "Q4_K": (sizes["gate"] + sizes["up"]) / total}
    assert dict(stored.dense_types) == pytest.approx(shares) and stored.head_types == (("Q6_K", 1.0),)
    assert stored.decoded("dense", {}) == pytest.approx(kept)
    assert stored.decoded("dense", {"Q4_K": 1.5, "Q8_0": 0.5}) == pytest.approx(
        1.5 * shares["Q4_K"] + 0.5 * shares["Q8_0"] + shares["Q4_1"])

    # The cost model reads a step's weights at those bytes; without them, in the compute type.
    shapes = dataclasses.replace(BUILTIN_MODELS["smollm2-135m"], num_layers=TINY["layers"], hidden_size=h,
                                 intermediate_size=f, num_heads=TINY["heads"], num_kv_heads=TINY["kv_heads"],
                                 head_dim=h // TINY["heads"], vocab_size=TINY["vocab"])
    fitted = dataclasses.replace(FLAT, weights_as_stored=True)  # as `inflight sim calibrate` fits
    as_stored, widened = (CostModel(shapes, BARE, dtype="float32", engine=fitted, matmul_storage=mb)
                          for mb in (stored, None))
    step = [SeqWork(1, 8, True)]
    head = TINY["vocab"] * h
    assert as_stored.work(step).linear_bytes == pytest.approx(TINY["layers"] * per_layer + head * stored.head)
    assert widened.work(step).linear_bytes == pytest.approx(4 * (TINY["layers"] * sum(sizes.values()) + head))
    # Each kept parameter costs its decoding once a step, whatever the step's rows: at one rate in a
    # step of one token (its matmuls a vector's), at another in a step of more; each type's at its
    # timed weight against Q4_1's.
    summed = dataclasses.replace(fitted, roofline="sum")
    decoding = dataclasses.replace(summed, block_decode_s=1e-12, block_decode_rows_s=0.4e-12,
                                   block_decode_weights={"Q4_K": 2.0, "Q6_K": 1.5})
    kept_params = TINY["layers"] * sum(sizes.values()) * (kept + shares["Q4_K"]) + 1.5 * head
    plain = CostModel(shapes, BARE, dtype="float32", engine=summed, matmul_storage=stored)
    for rows, rate in ((1, 1e-12), (3, 0.4e-12), (40, 0.4e-12)):
        work = [SeqWork(rows, 64, True)]
        extra = CostModel(shapes, BARE, dtype="float32", engine=decoding, matmul_storage=stored).step_time(work)
        assert extra - plain.step_time(work) == pytest.approx(kept_params * rate)
        assert (CostModel(shapes, BARE, dtype="float32", engine=decoding).step_time(work)
                == CostModel(shapes, BARE, dtype="float32", engine=summed).step_time(work))  # widened: none decoded
    # The decoding is the cores' work beside the multiply-adds: under a `max` roofline a step that
    # waits on its weights' bytes hides it, one that waits on its cores pays it.
    hidden = dataclasses.replace(decoding, roofline="max", block_decode_s=1e-18)
    bound = dataclasses.replace(hidden, block_decode_s=1e-9)
    model, one = CostModel(shapes, BARE, dtype="float32", engine=hidden, matmul_storage=stored), [SeqWork(1, 64, True)]
    work = model.work(one)
    assert model.cost(work).linear_s == pytest.approx(work.linear_bytes / BARE.memory_bandwidth)
    assert CostModel(shapes, BARE, dtype="float32", engine=bound, matmul_storage=stored).cost(work).linear_s == (
        pytest.approx(work.linear_compute_s + kept_params * 1e-9))
    # A profile fitted before the blocks were priced as stored keeps the pricing it was fitted with.
    assert CostModel(shapes, BARE, dtype="float32", engine=FLAT, matmul_storage=stored).work(step) == widened.work(step)
    # An 8-bit weight type is what the matmuls then read, whatever the checkpoint stores.
    eight = CostModel(BUILTIN_MODELS["llama-3-8b"], BUILTIN_HARDWARE["h100"], weight_dtype="int8",
                      matmul_storage=MatmulStorage(0.6, 0.6, 0.8))
    assert eight.matmul_storage is None


def test_the_calibrations_copies_of_a_gguf_file_in_another_type_and_width(tmp_path: Path) -> None:
    """`inflight sim calibrate` times two copies of its model: the decoder matrices in BF16 (other
    bytes a parameter, the same shares kept), and twice as wide with fewer layers in the file's
    own types (a type gguf-py cannot write as Q8_0); each loads, with the storage it says."""
    import sys

    import gguf
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from test_loading import TINY, write_tiny_gguf

    from inflight.model.gguf_copy import resized_copy, retyped_copy
    from inflight.model.loader import PACKED_BYTES, load_checkpoint, load_model_config, matmul_storage, resolve_model

    types = {"embd": "Q8_0", "q": "Q4_1", "k": "Q4_1", "v": "Q4_1", "o": "Q4_1", "gate": "Q4_K", "up": "Q4_K",
             "down": "Q8_0"}
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, types)
    source = resolve_model(path)
    stored = matmul_storage(source)

    bf16 = resolve_model(retyped_copy(path, "BF16", tmp_path))
    assert load_model_config(bf16) == load_model_config(source)
    assert matmul_storage(bf16).identity() == pytest.approx(stored._replace(dense=2.0, experts=2.0).identity())
    assert {kind for kind, _ in matmul_storage(bf16).dense_types} == {"BF16"}
    original, copied = (dict(load_checkpoint(s, torch.float32)[1]) for s in (source, bf16))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(original[name], copied[name], atol=0.02 * original[name].abs().max().item())

    wide = resolve_model(resized_copy(path, 2.0, 1, tmp_path))
    config = load_model_config(wide)
    assert (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.num_layers,
            config.vocab_size) == (2 * TINY["hidden"], 2 * TINY["intermediate"], 2 * TINY["heads"],
                                   2 * TINY["kv_heads"], 1, TINY["vocab"])
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(wide.path).tensors}
    assert kinds["blk.0.attn_q.weight"] == "Q4_1" and kinds["blk.0.ffn_gate.weight"] == "Q4_K"  # random codes
    assert "blk.1.attn_q.weight" not in kinds
    assert matmul_storage(wide).head == PACKED_BYTES["Q8_0"] and matmul_storage(wide).dense_kept == 1.0
    _, weights = load_checkpoint(wide, torch.float32)
    assert dict(weights)["model.layers.0.mlp.down_proj.weight"].shape == (2 * TINY["hidden"], 2 * TINY["intermediate"])
    with pytest.raises(ValueError, match="not whole"):  # 4 heads halve, 2 KV heads too; a third does not
        resized_copy(path, 1 / 3, 1, tmp_path)
    # The same shape, every decoder matrix in a type gguf-py cannot quantize (random codes).
    retyped = resolve_model(resized_copy(path, 1.0, 1, tmp_path, kind="IQ4_XS"))
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(retyped.path).tensors}
    assert {kind for name, kind in kinds.items() if name.startswith("blk.0.") and "norm" not in name} == {"IQ4_XS"}
    assert matmul_storage(retyped).dense == pytest.approx(PACKED_BYTES["IQ4_XS"])
    assert all(torch.isfinite(w).all() for w in load_checkpoint(retyped, torch.float32)[1].values())
    # Half as wide, rows of 128 weights are not whole 256-weight blocks: those matrices in Q8_0.
    narrow = resized_copy(path, 0.5, 1, tmp_path, kind="IQ4_XS")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(narrow).tensors}
    assert kinds["blk.0.attn_q.weight"] == "Q8_0" and kinds["blk.0.ffn_down.weight"] == "IQ4_XS"


def test_the_calibration_times_each_block_types_decoding() -> None:
    """`block_decode_times`: a one-row matmul's seconds a weight from the cache for each type asked
    (Q4_1, the reference, always), through the kernels' own reading of its random blocks."""
    from inflight.model.linear import blocks_usable
    from inflight.sim.calibrate import block_decode_times

    if not blocks_usable():
        assert block_decode_times(["IQ4_XS"], rounds=1) == {}
        return
    times = block_decode_times(["IQ4_XS", "BF16"], rounds=1)
    assert list(times) == ["Q4_1", "IQ4_XS", "BF16"]
    # A weight's multiply-add and decoding: more than a 512-bit FMA port's share, less than a
    # microsecond, on any CPU the suite runs on.
    assert all(1e-12 < t < 1e-6 for t in times.values())


def test_the_engine_and_the_simulator_price_a_checkpoint_by_how_it_is_stored(loaded: LoadedModel) -> None:
    """The built-in CPU profile prices the embedded model (the one it was calibrated on, Q4_1
    blocks) with its own factors, and any checkpoint stored otherwise with its `as_stored` ones:
    each matrix at its stored bytes, each kept parameter's decoding; the engine's SLO policy, the
    simulator and `SimTarget.of` alike. A GPU engine widens the blocks: the compute type there."""
    from inflight.cli import build_parser
    from inflight.model.linear import keeps_blocks
    from inflight.model.loader import matmul_storage, resolve_model
    from inflight.sim.cli import _target

    if not keeps_blocks(loaded.model.dtype, loaded.model.device):
        pytest.skip("no block kernels here: the matrices are widened, and priced so")
    stored = matmul_storage(resolve_model(None))
    assert stored.dense == pytest.approx(0.625) and stored.head == pytest.approx(1.0625)  # Q4_1, a tied Q8_0 head
    assert loaded.matmul_storage == stored
    assert INFLIGHT_CPU.fitted_storage == stored.identity() and INFLIGHT_CPU.as_stored["weights_as_stored"]
    engine = LLMEngine(EngineConfig.from_kwargs(None, num_kv_blocks=64, scheduling_policy="slo",
                                             tbt_slo_ms=100), loaded)
    cost_model = engine.scheduler.predictor.cost_model  # type: ignore[attr-defined]
    assert cost_model.engine == INFLIGHT_CPU and cost_model.matmul_storage is None  # its own fit
    target = _target(build_parser().parse_args(["sim", "--workload", "burst"]))
    assert target.matmul_storage == stored and target.cost_model().engine == INFLIGHT_CPU

    bf16 = stored._replace(dense=2.0, experts=2.0)  # the same model's matrices in BF16
    other = SimTarget(target.model_name, target.shapes, target.hardware, matmul_storage=bf16).cost_model()
    assert other.engine.weights_as_stored and other.matmul_storage == bf16
    assert other.engine.block_decode_s == INFLIGHT_CPU.as_stored["block_decode_s"] > 0
    one = [SeqWork(1, 64, True)]
    q4 = CostModel(target.shapes, target.hardware, engine=other.engine, matmul_storage=stored)
    extra_bytes = (2.0 - 0.625) * (q4.work(one).linear_bytes - 1.0625 * target.shapes.vocab_size
                                   * target.shapes.hidden_size) / 0.625
    assert other.work(one).linear_bytes - q4.work(one).linear_bytes == pytest.approx(extra_bytes)
    assert other.step_time(one) > q4.step_time(one)
    # A draft stored otherwise is priced by those factors too, its passes without the step's overhead.
    draft = target.cost_model().for_draft(target.shapes, bf16)
    assert draft.engine.weights_as_stored and draft.engine.step_overhead_s == 0 and draft.matmul_storage == bf16
    # A named shape has no file: an fp32 checkpoint's pricing, by the profile's own factors.
    named = _target(build_parser().parse_args(["sim", "--workload", "burst", "--model", "llama-3-8b"]))
    assert named.matmul_storage is None and named.cost_model().engine == INFLIGHT_CPU
    gpu = build_parser().parse_args(["sim", "--workload", "burst", "--hardware", "h100"])
    assert _target(gpu).matmul_storage is None
