"""`inflight check --plan`: a configuration against a workload, before any traffic. Each flag is
raised where (and only where) its condition holds, with the number behind it; vLLM's names are
read from flags and from its YAML config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inflight.bench.sla import SLA
from inflight.bench.workload import BenchRequest, parse_workload
from inflight.cli import main
from inflight.perf.cost_model import SeqWork
from inflight.perf.profiles import load_profiles
from inflight.sim.plan import check_plan, read_engine_config
from inflight.sim.runs import SimTarget
from inflight.sim.shapes import resolve_shapes
from inflight.sim.workload import synthetic_requests

SPEC = {"name": "plan", "seed": 1, "num_requests": 40, "arrivals": {"kind": "poisson", "rate": 4},
        "prompt_len": {"kind": "uniform", "min": 100, "max": 600},
        "output_len": {"kind": "uniform", "min": 20, "max": 80}}


@pytest.fixture(scope="module")
def target() -> SimTarget:
    name, shapes = resolve_shapes(None)
    hardware, engine = load_profiles("cpu-local")
    return SimTarget(name, shapes, hardware, engine=engine)


@pytest.fixture(scope="module")
def requests() -> list[BenchRequest]:
    return synthetic_requests(parse_workload(SPEC))


def lines(plan) -> dict[str, tuple[bool | None, str]]:  # type: ignore[no-untyped-def]
    return {line.name: (line.flagged, line.text) for line in plan.lines}


def test_a_roomy_configuration_raises_no_flag(target: SimTarget, requests: list[BenchRequest]) -> None:
    plan = check_plan(target, {"num_kv_blocks": 4096}, requests, SLA(max_tbt_p99_ms=60_000))
    assert not plan.flags and [line.status for line in plan.lines] == ["OK"] * 4
    assert plan.num_kv_blocks == 4096
    longest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    assert f"{longest.prompt_len} + {longest.output_len}" in lines(plan)["max_model_len"][1]


def test_each_flag_where_its_condition_holds(target: SimTarget, requests: list[BenchRequest]) -> None:
    prompts = [r.prompt_len for r in requests]
    totals = [r.prompt_len + r.output_len for r in requests]
    short = sorted(totals)[len(totals) // 2]  # half the requests longer than this
    plan = check_plan(target, {"max_model_len": short, "max_num_tokens": 300, "enable_chunked_prefill": False,
                               "num_kv_blocks": 100, "max_batch_size": 32}, requests, SLA(max_tbt_p99_ms=60_000))
    found = lines(plan)
    over = sum(t > short for t in totals)
    assert found["max_model_len"] == (True, found["max_model_len"][1]) and f"{over} of 40 requests" in \
        found["max_model_len"][1]
    assert found["token budget"][0] and f"{sum(p > 300 for p in prompts)} requests can never be scheduled" in \
        found["token budget"][1] and f"longest prompt, {max(prompts)} tokens" in found["token budget"][1]
    # The pool: a running request holds its prompt and half its output, in blocks of 16.
    context = round(sum(prompts) / 40 + sum(r.output_len for r in requests) / 80)
    holds = 100 // -(-context // 16)
    assert found["KV pool"][0] and f"holds {holds} requests at the mean context of {context} tokens" in \
        found["KV pool"][1] and f"a batch of 32 needs {32 * -(-context // 16)} blocks" in found["KV pool"][1]
    assert found["step time"][0] is False
    assert {line.name for line in plan.flags} == {"max_model_len", "token budget", "KV pool"}


def test_the_step_time_is_the_cost_models_and_the_suggested_budget_fits(target: SimTarget,
                                                                         requests: list[BenchRequest]) -> None:
    options = {"max_num_tokens": 2048, "max_batch_size": 16, "num_kv_blocks": 4096}
    free = check_plan(target, options, requests)
    assert lines(free)["step time"][0] is None  # no SLA: shown, not judged
    cost = target.cost_model()
    context = round(sum(r.prompt_len for r in requests) / 40 + sum(r.output_len for r in requests) / 80)
    assert free.decode_step_s == pytest.approx(cost.step_time([SeqWork(1, context, True)] * 16))
    limit_ms = 1000 * (free.decode_step_s + free.full_step_s) / 2  # between a decode step and a full one
    plan = check_plan(target, options, requests, SLA(max_tbt_p99_ms=limit_ms))
    flagged, text = lines(plan)["step time"]
    assert flagged and f"{1000 * free.full_step_s:.0f} ms" in text
    budget = int(re.search(r"max_num_tokens (\d+) would fit", text).group(1))  # type: ignore[union-attr]
    assert 16 < budget < 2048
    assert 1000 * check_plan(target, {**options, "max_num_tokens": budget}, requests).full_step_s <= limit_ms
    assert 1000 * check_plan(target, {**options, "max_num_tokens": budget + 1}, requests).full_step_s > limit_ms
    slow = check_plan(target, options, requests, SLA(max_tbt_p99_ms=1000 * free.decode_step_s / 2))
    assert "even the decode-only step is above" in lines(slow)["step time"][1]


def test_vllm_names_from_its_config_file(tmp_path: Path) -> None:
    path = tmp_path / "vllm.yaml"
    path.write_text("model: meta-llama/Llama-3.2-1B\nport: 8000\nmax-num-seqs: 48\nmax_num_batched_tokens: 1024\n"
                    "max-model-len: 4096\ngpu-memory-utilization: 0.8\nenable-chunked-prefill: false\n")
    options, target_options, ignored = read_engine_config(path)
    assert options == {"max_batch_size": 48, "max_num_tokens": 1024, "max_model_len": 4096,
                       "enable_chunked_prefill": False}
    assert target_options == {"gpu_memory_utilization": 0.8} and ignored == ["model", "port"]


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "vllm.yaml"
    config.write_text("max-num-seqs: 8\nmax-num-batched-tokens: 64\nenable-chunked-prefill: false\nport: 1\n")
    assert main(["check", "--plan", "--workload", "long-prefill", "--engine-config", str(config),
                 "--max-num-seqs", "4", "--num-kv-blocks", "512"]) == 1
    out = capsys.readouterr().out
    assert "max_batch_size 4, max_num_tokens 64" in out and "chunked prefill off" in out  # a flag beats the file
    assert "not read from the engine config: port" in out and "FLAG  token budget" in out
    assert out.strip().splitlines()[-1] == "RESULT: 1 flag (token budget)"
    assert main(["check", "--plan", "--workload", "burst", "--num-kv-blocks", "4096"]) == 0
    assert capsys.readouterr().out.strip().endswith("RESULT: 0 flags: nothing found before traffic")
    assert main(["check", "--plan", "--workload", "burst", str(tmp_path / "run.json")]) == 2
    assert "drop RUN.json" in capsys.readouterr().err
    assert main(["check"]) == 2
    assert "inflight check --sla SLA RUN.json" in capsys.readouterr().err
