"""The measurement package: workloads, metric arithmetic, an in-process bench with the real
embedded model, the HTTP client against the real server and a fake one, and `inflight check`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from pydantic import TypeAdapter

from inflight.bench import local as local_module
from inflight.bench import runs as runs_module
from inflight.bench.client import run_http
from inflight.bench.corpus import Corpus
from inflight.bench.distributions import Arrivals, LengthDist
from inflight.bench.local import TurnClock
from inflight.bench.metrics import (
    EngineCounters,
    KvSample,
    LatencyStats,
    RequestResult,
    RequestSLO,
    compute_metrics,
    time_weighted_mean,
)
from inflight.bench.report import read_run_file, write_run_file
from inflight.bench.runs import RunPlan, parse_compare, parse_sweep, plan_runs, resolve_options
from inflight.bench.server_metrics import parse_prometheus
from inflight.bench.workload import (
    BenchRequest,
    WorkloadError,
    canonical_specs,
    generate_requests,
    load_workload,
    parse_workload,
    with_request_rate,
)
from inflight.cli import main
from inflight.errors import ConfigError
from inflight.model.loaded import LoadedModel

TINY = {
    "name": "tiny", "seed": 3, "num_requests": 4,
    "arrivals": {"kind": "poisson", "rate": 40},
    "prompt_len": {"kind": "uniform", "min": 8, "max": 24},
    "output_len": {"kind": "uniform", "min": 2, "max": 4},
    "shared_prefix": {"fraction": 0.5, "num_tokens": 16},
}


class CharTokenizer:
    """One token per character: enough for workload tests that need no model."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in token_ids)


@pytest.fixture(scope="module")
def char_corpus() -> Corpus:
    return Corpus(CharTokenizer())


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def key(requests: list[BenchRequest]) -> list[tuple[Any, ...]]:
    return [(r.prompt_token_ids, r.output_len, r.arrival_s, r.has_shared_prefix) for r in requests]


# --- workloads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["burst", "mixed", "long-prefill", "shared-prefix", "multi-prefix", "copy-edit"])
def test_same_spec_and_seed_give_same_requests(name: str, char_corpus: Corpus) -> None:
    spec, path = load_workload(name)
    first = generate_requests(spec, char_corpus, path.parent)
    assert key(first) == key(generate_requests(spec, char_corpus, path.parent))
    other, _ = load_workload(name, seed=spec.seed + 1)
    assert key(generate_requests(other, char_corpus, path.parent)) != key(first)
    assert len(first) == spec.num_requests
    assert all(r.prompt_len + r.output_len <= 2048 for r in first)  # fits the default max_model_len
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first)


def test_canonical_specs_are_shipped() -> None:
    assert set(canonical_specs()) == {"burst", "mixed", "long-prefill", "shared-prefix", "multi-prefix", "copy-edit"}
    with pytest.raises(WorkloadError, match="no workload 'nope'.*burst"):
        load_workload("nope")


@pytest.mark.parametrize(("dist", "mean", "lo", "hi"), [
    ({"kind": "fixed", "value": 7}, 7, 7, 7),
    ({"kind": "uniform", "min": 16, "max": 64}, 40, 16, 64),
    ({"kind": "normal", "mean": 100, "std": 10, "min": 1}, 100, 50, 150),
    ({"kind": "lognormal", "mean": 200, "std": 100}, 200, 1, None),
    ({"kind": "lognormal", "mean": 200, "std": 400, "min": 10, "max": 300}, None, 10, 300),
    ({"kind": "mixture", "components": [{"kind": "fixed", "value": 10, "weight": 3},
                                        {"kind": "fixed", "value": 1000, "weight": 1}]}, 257.5, 10, 1000),
])
def test_length_distributions(dist: dict[str, Any], mean: float | None, lo: int, hi: int | None) -> None:
    samples = TypeAdapter(LengthDist).validate_python(dist).sample(np.random.default_rng(0), 20_000)
    assert samples.dtype == np.int64
    if mean is not None:
        assert samples.mean() == pytest.approx(mean, rel=0.03)
    assert samples.min() >= lo
    if hi is not None:
        assert samples.max() <= hi
    if dist["kind"] == "lognormal" and "max" in dist:  # clipping piles the tail up at max
        assert samples.max() == hi and (samples == hi).mean() > 0.05


def test_bare_integer_is_a_fixed_length() -> None:
    assert TypeAdapter(LengthDist).validate_python(12).sample(np.random.default_rng(0), 3).tolist() == [12] * 3


def test_arrival_processes() -> None:
    rng = np.random.default_rng(0)
    parse = TypeAdapter(Arrivals).validate_python
    assert parse({"kind": "burst"}).offsets(rng, 5).tolist() == [0.0] * 5
    poisson = parse({"kind": "poisson", "rate": 4.0}).offsets(rng, 20_000)
    assert poisson[0] == 0 and np.diff(poisson).mean() == pytest.approx(0.25, rel=0.03)
    gaps = np.diff(parse({"kind": "gamma", "rate": 2.0, "burstiness": 0.25}).offsets(rng, 20_000))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    # Gamma gaps with shape k have a squared coefficient of variation of 1/k: burstier than Poisson.
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(4.0, rel=0.15)


def test_prompts_are_exact_token_lengths_of_real_text(loaded: LoadedModel) -> None:
    spec = parse_workload({**TINY, "num_requests": 40, "shared_prefix": {"fraction": 0.5, "num_tokens": 64}})
    requests = generate_requests(spec, Corpus(loaded.tokenizer))
    with_prefix = [r for r in requests if r.has_shared_prefix]
    assert 10 <= len(with_prefix) <= 30
    prefix = with_prefix[0].prompt_token_ids[:64]
    for r in requests:
        body = r.prompt_len - (64 if r.has_shared_prefix else 0)
        assert 8 <= body <= 24 and r.prompt_len == len(r.prompt_token_ids)
        assert (r.prompt_token_ids[:64] == prefix) == r.has_shared_prefix
        assert all(0 <= t < loaded.tokenizer.vocab_size for t in r.prompt_token_ids)
        assert r.prompt.strip() and "\ufffd" not in r.prompt[1:-1]


def test_several_system_prompts(char_corpus: Corpus) -> None:
    one = parse_workload({**TINY, "num_requests": 60, "shared_prefix": {"fraction": 0.8, "num_tokens": 32}})
    four = parse_workload({**TINY, "num_requests": 60,
                           "shared_prefix": {"fraction": 0.8, "num_tokens": 32, "num_prompts": 4}})
    singles, several = generate_requests(one, char_corpus), generate_requests(four, char_corpus)
    heads = {tuple(r.prompt_token_ids[:32]) for r in several if r.has_shared_prefix}
    assert len(heads) == 4  # four distinct system prompts, each drawn to at least one request
    # The same arrivals, lengths and membership as with one prompt: the draw is on its own stream.
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.has_shared_prefix) for r in several] == \
        [(r.arrival_s, r.prompt_len, r.output_len, r.has_shared_prefix) for r in singles]
    assert [r.prompt_token_ids[32:] for r in several] == [r.prompt_token_ids[32:] for r in singles]


def test_trace_files(tmp_path: Path, char_corpus: Corpus) -> None:
    (tmp_path / "t.csv").write_text("timestamp,prompt_len,output_len\n10.5,30,4\n10.0,20,3\n12.0,40,5\n")
    (tmp_path / "t.jsonl").write_text('{"timestamp": 3, "prompt_len": 7, "output_len": 2}\n\n'
                                      '{"timestamp": 1, "prompt_len": 5, "output_len": 9}\n')
    spec_csv, path = load_workload(str(write_yaml(tmp_path / "csv.yaml", {
        "arrivals": {"kind": "trace", "path": "t.csv", "time_scale": 2.0}})))
    requests = generate_requests(spec_csv, char_corpus, path.parent)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in requests] == [(0, 20, 3), (1, 30, 4), (4, 40, 5)]
    spec_jsonl, _ = load_workload(str(write_yaml(tmp_path / "j.yaml", {
        "num_requests": 1, "arrivals": {"kind": "trace", "path": str(tmp_path / "t.jsonl")}})))
    assert [(r.prompt_len, r.output_len) for r in generate_requests(spec_jsonl, char_corpus)] == [(5, 9)]
    (tmp_path / "bad.csv").write_text("timestamp,prompt_len\n1,2\n")
    bad, _ = load_workload(str(write_yaml(tmp_path / "b.yaml", {"arrivals": {"kind": "trace", "path": "bad.csv"}})))
    with pytest.raises(WorkloadError, match="line 2: missing column 'output_len'"):
        generate_requests(bad, char_corpus, tmp_path)


def test_templates_put_a_passage_into_each_task(char_corpus: Corpus) -> None:
    templates = ["Copy: {text} | again:", "{text}\n{text}"]
    base = {**TINY, "num_requests": 12, "shared_prefix": None}
    requests = generate_requests(parse_workload({**base, "templates": templates}), char_corpus)
    texts = [char_corpus.decode(r.prompt_token_ids) for r in requests]
    copies = [t for t in texts if t.startswith("Copy: ") and t.endswith(" | again:")]
    twice = [t for t in texts if t not in copies]
    assert copies and twice  # both tasks drawn
    assert all(t[:len(t) // 2] == t[len(t) // 2 + 1:] for t in twice)  # the same passage twice
    plain = generate_requests(parse_workload(base), char_corpus)
    assert [r.output_len for r in plain] == [r.output_len for r in requests]  # lengths drawn as before


@pytest.mark.parametrize(("change", "message"), [
    ({"templates": ["no passage"]}, "templates: each needs a {text}"),
    ({"arrivals": {"kind": "poisson", "rate": -1}}, "arrivals.poisson.rate: Input should be greater than 0"),
    ({"arrivals": {"kind": "weekly"}}, "does not match any of the expected tags: 'burst', 'poisson'"),
    ({"output_len": {"kind": "uniform", "min": 9, "max": 3}}, "output_len.uniform: max (3) is below min (9)"),
    ({"output_len": None}, "missing output_len"),
    ({"num_reqests": 4}, "num_reqests: Extra inputs are not permitted"),
    ({"shared_prefix": {"fraction": 1.5, "num_tokens": 8}}, "shared_prefix.fraction"),
    ({"arrivals": {"kind": "trace", "path": "x.csv"}}, "a trace gives its own prompt_len and output_len"),
    ({"prompt_len": {"kind": "mixture", "components": []}}, "components: List should have at least 1 item"),
])
def test_bad_specs_raise_clear_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_workload({**TINY, **change}, source="spec.yaml")
    assert str(info.value).startswith("spec.yaml: ")
    assert message in str(info.value)


def test_cli_reports_a_bad_spec_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml(tmp_path / "bad.yaml", {**TINY, "arrivals": {"kind": "poisson"}})
    assert main(["bench", "--workload", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (err.count("\n") == 0 and err.startswith("inflight: error: ")
            and "arrivals.poisson.rate: Field required" in err)
    (tmp_path / "notyaml.yaml").write_text("a: [1,\n")
    assert main(["bench", "--workload", str(tmp_path / "notyaml.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_request_rate_override() -> None:
    spec = parse_workload({**TINY, "arrivals": {"kind": "gamma", "rate": 1, "burstiness": 0.5}})
    assert with_request_rate(spec, 3.0).arrivals.model_dump() == {"kind": "gamma", "rate": 3.0, "burstiness": 0.5}
    assert with_request_rate(spec, float("inf")).arrivals.kind == "burst"
    burst = parse_workload({**TINY, "arrivals": {"kind": "burst"}})
    assert with_request_rate(burst, 2.0).arrivals.model_dump() == {"kind": "poisson", "rate": 2.0}


# --- metric arithmetic --------------------------------------------------------------------------


def test_request_result_from_token_times() -> None:
    r = RequestResult.from_token_times(0, 10, 4, arrival_s=1.0, token_times_s=[1.5, 1.6, 1.8, 2.1],
                                       finished_s=2.1)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.token_gaps_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx(0.2)  # (1.1 - 0.5) / 3
    assert r.num_output_tokens == 4 and r.ok
    # A stream chunk may carry several tokens: the usage count wins, TPOT divides by it.
    chunked = RequestResult.from_token_times(1, 10, 7, 0.0, [0.5, 1.1], 1.1, num_output_tokens=7)
    assert chunked.token_gaps_s == pytest.approx([0.6]) and chunked.tpot_s == pytest.approx(0.1)
    failed = RequestResult.from_token_times(2, 10, 4, 0.0, [0.5], 0.9, error="boom")
    assert not failed.ok and failed.e2e_s is None and failed.tpot_s is None


def test_latency_stats_percentiles() -> None:
    stats = LatencyStats.of_seconds([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats.mean == pytest.approx(50.5)
    assert stats.p50 == pytest.approx(50.5)
    assert stats.p90 == pytest.approx(90.1)
    assert stats.p99 == pytest.approx(99.01)
    assert stats.max == pytest.approx(100) and stats.count == 100
    assert LatencyStats.of_seconds([]) == LatencyStats()


def _result(i: int, ttft: float, tpot: float, n: int = 5, error: str | None = None) -> RequestResult:
    times = [ttft + k * tpot for k in range(n)]
    return RequestResult.from_token_times(i, 100, n, 0.0, times, times[-1], error=error)


def test_goodput_and_throughput() -> None:
    results = [_result(0, 0.2, 0.05), _result(1, 0.8, 0.05), _result(2, 0.2, 0.3), _result(3, 0.1, 0.01, error="x")]
    slo = RequestSLO(max_ttft_ms=500, max_tpot_ms=100)
    assert [slo.is_met(r) for r in results] == [True, False, False, False]
    samples = [KvSample(0, 10, 1, 0), KvSample(1, 50, 2, 1), KvSample(3, 0, 0, 0)]
    counters = EngineCounters(kv_peak_perc=55.0, num_preemptions=2, num_oom_errors=0)
    m = compute_metrics(results, 2.0, samples, counters, slo)
    assert (m.num_completed, m.num_failed, m.num_good) == (3, 1, 1)
    assert m.goodput == pytest.approx(0.5)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(15 / 2)
    assert m.total_throughput == pytest.approx((15 + 300) / 2)
    assert m.ttft_ms.max == pytest.approx(800)
    assert m.tbt_ms.count == 12  # 4 gaps for each of the three that succeeded
    assert m.kv_peak_perc == 55.0 and m.kv_mean_perc == pytest.approx((10 * 1 + 50 * 2) / 3)
    assert compute_metrics(results, 2.0).goodput is None


def test_time_weighted_mean() -> None:
    assert time_weighted_mean([]) is None
    assert time_weighted_mean([(5.0, 3.0)]) == 3.0
    assert time_weighted_mean([(0, 0), (1, 100), (4, 0)]) == pytest.approx(75.0)


def test_parse_prometheus() -> None:
    text = ('# HELP inflight:kv_cache_usage_perc x\n# TYPE inflight:kv_cache_usage_perc gauge\n'
            'inflight:kv_cache_usage_perc 0.25\ninflight:oom_total 2.0\n'
            'inflight:request_success_total{finished_reason="length"} 3.0\n'
            'inflight:request_success_total{finished_reason="stop"} 4.0\n')
    values = parse_prometheus(text)
    assert values["inflight:kv_cache_usage_perc"] == 0.25 and values["inflight:oom_total"] == 2.0
    assert values["inflight:request_success_total"] == 7.0
    # Behind a fleet: one series per replica. Counters add up; the KV gauges keep the fullest pool.
    fleet = ('inflight:kv_cache_usage_perc{replica="a"} 0.25\ninflight:kv_cache_usage_perc{replica="b"} 0.75\n'
             'inflight:kv_cache_usage_peak_perc{replica="a"} 0.9\ninflight:kv_cache_usage_peak_perc{replica="b"} 0.8\n'
             'inflight:num_preemptions_total{replica="a"} 2.0\ninflight:num_preemptions_total{replica="b"} 5.0\n')
    values = parse_prometheus(fleet)
    assert values["inflight:kv_cache_usage_perc"] == 0.75 and values["inflight:kv_cache_usage_peak_perc"] == 0.9
    assert values["inflight:num_preemptions_total"] == 7.0


# --- runs and comparisons -----------------------------------------------------------------------


def test_plan_runs() -> None:
    plans = plan_runs(parse_compare("static,chunked"), [parse_sweep("max-num-tokens=32,64")])
    assert [p.label for p in plans] == ["static max_num_tokens=32", "static max_num_tokens=64",
                                        "chunked max_num_tokens=32", "chunked max_num_tokens=64"]
    assert plans[0].overrides == {"scheduling_policy": "static", "max_num_tokens": 32}
    assert [p.label for p in plan_runs()] == ["default"]
    assert parse_sweep("enable_prefix_caching=true,false") == ("enable_prefix_caching", [True, False])
    with pytest.raises(ConfigError, match="unknown configuration fast"):
        parse_compare("static,fast")
    with pytest.raises(ConfigError, match="unknown engine option 'max_tokens'"):
        parse_sweep("max_tokens=1,2")
    (unchunked,) = plan_runs(["continuous"])  # a whole prompt must fit one step
    assert resolve_options({"max_num_tokens": 256, "max_model_len": 1024}, unchunked)["max_num_tokens"] == 1024
    assert resolve_options({"max_num_tokens": 4096}, unchunked)["max_num_tokens"] == 4096


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_run(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One `inflight bench` in-process: two configurations by two budgets, JSON, plots, SLA."""
    folder = tmp_path_factory.mktemp("bench")
    spec = write_yaml(folder / "tiny.yaml", TINY)
    sla = write_yaml(folder / "sla.yaml", {"workload": "tiny", "max_failed_requests": 0, "max_oom": 0,
                                           "max_kv_peak_perc": 100, "min_output_tokens_per_s": 0.01,
                                           "min_goodput_req_per_s": 0.01, "goodput": {"max_ttft_ms": 600_000}})
    mp = pytest.MonkeyPatch()
    mp.setattr(LoadedModel, "load", classmethod(lambda cls, *args, **kwargs: loaded))
    try:
        code = main(["bench", "--workload", str(spec), "--num-kv-blocks", "64", "--compare", "static,chunked",
                     "--sweep", "max_num_tokens=16,512", "--output", str(folder / "run.json"),
                     "--plot", str(folder / "plots"), "--sla", str(sla), "--no-progress"])
    finally:
        mp.undo()
    assert code == 0
    yield {"folder": folder, "run": folder / "run.json", "sla": sla}


def test_in_process_bench_writes_runs_config_and_plots(bench_run: dict[str, Path]) -> None:
    data = json.loads(bench_run["run"].read_text())
    assert data["schema"] == "inflight-bench/1"
    assert data["workload"]["name"] == "tiny" and data["workload"]["seed"] == 3
    assert data["workload"]["spec"]["arrivals"] == {"kind": "poisson", "rate": 40.0}
    assert data["engine_options"]["num_kv_blocks"] == 64
    assert {"inflight", "torch", "python", "cpu_count", "platform", "device"} <= set(data["environment"])
    assert [r["label"] for r in data["runs"]] == ["static max_num_tokens=16", "static max_num_tokens=512",
                                                  "chunked max_num_tokens=16", "chunked max_num_tokens=512"]
    for run in data["runs"]:
        assert run["metrics"]["num_failed"] == 0 and run["metrics"]["num_completed"] == 4
        assert [r["num_output_tokens"] for r in run["requests"]] == [r["output_len"] for r in run["requests"]]
        assert run["metrics"]["num_oom_errors"] == 0 and run["metrics"]["kv_peak_perc"] > 0
        assert run["options"]["num_kv_blocks_allocated"] == 64
        steps = run["timeline"]["steps"]
        assert steps and sum(s[3] for s in steps) == sum(r["output_len"] - 1 for r in run["requests"])
    chunked_small = data["runs"][2]
    assert max(s[2] + s[3] for s in chunked_small["timeline"]["steps"]) <= 16  # the budget holds
    plots = sorted(p.name for p in (bench_run["folder"] / "plots").iterdir())
    assert plots == ["kv_usage.png", "latency_cdf.png", "timeline.png", "tradeoff.png"]
    document, runs = read_run_file(bench_run["run"])
    assert runs[0].metrics.num_completed == 4
    write_run_file(bench_run["folder"] / "run.json.gz", document, runs)  # gzip when the name says so
    _, again = read_run_file(bench_run["folder"] / "run.json.gz")
    assert [r.metrics for r in again] == [r.metrics for r in runs]
    assert again[0].capture.timeline == runs[0].capture.timeline


def test_check_passes_and_fails(bench_run: dict[str, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--sla", str(bench_run["sla"]), str(bench_run["run"])]) == 0
    assert "RESULT: PASS" in capsys.readouterr().out
    strict = write_yaml(tmp_path / "strict.yaml", {"max_ttft_p99_ms": 0.001, "workload": "mixed",
                                                   "max_oom": 0})
    assert main(["check", "--sla", str(strict), str(bench_run["run"])]) == 1
    out = capsys.readouterr().out
    assert "FAIL  TTFT p99" in out and "FAIL  workload" in out and "PASS  OOM events" in out
    assert "RESULT: FAIL" in out
    bad = write_yaml(tmp_path / "bad.yaml", {"max_tbt_p99": 10})
    assert main(["check", "--sla", str(bad), str(bench_run["run"])]) == 2
    assert capsys.readouterr().err.strip() == (f"inflight: error: SLA file {bad}: max_tbt_p99: "
                                               "Extra inputs are not permitted")
    (tmp_path / "junk.json").write_text("{}")
    assert main(["check", "--sla", str(bench_run["sla"]), str(tmp_path / "junk.json")]) == 2
    assert "not an inflight bench run file" in capsys.readouterr().err


def test_http_bench_against_the_real_server(loaded: LoadedModel, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = pytest.importorskip("inflight.server.launcher")
    from inflight import EngineConfig, LLMEngine
    from inflight.model.tokenizer import Tokenizer
    from inflight.server.config import ServerConfig

    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64), loaded)
    requests = generate_requests(parse_workload(TINY), Corpus(loaded.tokenizer))
    monkeypatch.setattr(Tokenizer, "load", classmethod(lambda cls, *args, **kwargs: loaded.tokenizer))
    spec = write_yaml(tmp_path / "tiny.yaml", TINY)
    with launcher.serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as server:
        capture, info = run_http(server.url, requests, progress=False, timeout_s=60)
        code = main(["bench", "--workload", str(spec), "--url", server.url, "--no-progress",
                     "--output", str(tmp_path / "server.json")])
    assert code == 0
    document, (run,) = read_run_file(tmp_path / "server.json")
    assert document["target"]["kind"] == "http" and run.metrics.num_failed == 0
    assert run.metrics.kv_peak_perc is not None and run.metrics.num_oom_errors == 0
    assert info["metrics_available"] and info["served_model_name"]
    assert [r.error for r in capture.results] == [None] * 4
    assert [r.num_output_tokens for r in capture.results] == [r.output_len for r in requests]
    assert all(len(r.token_gaps_s) == r.num_output_tokens - 1 for r in capture.results)
    assert capture.counters.num_oom_errors == 0 and capture.counters.num_preemptions == 0
    assert capture.counters.kv_peak_perc is not None and capture.counters.kv_peak_perc > 0


def _sse(*chunks: dict[str, Any]) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def test_http_client_against_a_fake_server(char_corpus: Corpus) -> None:
    """Multi-token chunks, a bare finish chunk, the usage chunk, an HTTP error, /metrics."""
    scrapes = iter(range(100))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if request.url.path == "/metrics":
            n = next(scrapes)
            return httpx.Response(200, text=f"inflight:kv_cache_usage_perc 0.5\ninflight:kv_cache_usage_peak_perc "
                                            f"{0.1 + 0.01 * n}\ninflight:num_preemptions_total {n}\n")
        body = json.loads(request.content)
        sent_priorities.append(body.get("priority", 0))
        assert body["model"] == "fake" and body["ignore_eos"] and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True} and isinstance(body["prompt"], list)
        if body["max_tokens"] == 2:
            return httpx.Response(400, json={"error": {"message": "too long"}})
        text = lambda t, f=None: {"choices": [{"index": 0, "text": t, "finish_reason": f}]}  # noqa: E731
        return httpx.Response(200, content=_sse(text("a"), text("bc"), text("", "length"),
                                                {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}),
                              headers={"content-type": "text/event-stream"})

    sent_priorities: list[int] = []
    spec = parse_workload({**TINY, "num_requests": 6, "output_len": {"kind": "uniform", "min": 2, "max": 4},
                           "priorities": [{"priority": 0, "share": 0.5}, {"priority": 2, "share": 0.5}]})
    requests = generate_requests(spec, char_corpus)
    capture, info = run_http("http://fake", requests, progress=False,
                             transport=httpx.MockTransport(handler), max_concurrency=2)
    assert info["served_model_name"] == "fake"
    assert sorted(sent_priorities) == sorted(r.priority for r in requests)
    assert [r.priority for r in capture.results] == [r.priority for r in requests]
    for request, result in zip(requests, capture.results, strict=True):
        if request.output_len == 2:
            assert result.error is not None and "HTTP 400" in result.error and not result.ok
        else:
            assert result.ok and result.num_output_tokens == request.output_len
            assert len(result.token_gaps_s) == 1  # two chunks carried tokens; the finish marker did not
    assert capture.counters.num_preemptions is not None and capture.counters.num_preemptions >= 1
    assert capture.counters.kv_peak_perc is not None and capture.samples[0].kv_usage_perc == 50.0


def test_priority_classes_are_drawn_apart_from_the_rest(char_corpus: Corpus) -> None:
    plain = parse_workload({**TINY, "num_requests": 400})
    classed = parse_workload({**TINY, "num_requests": 400,
                              "priorities": [{"priority": 0, "share": 0.25}, {"priority": 5, "share": 0.75}]})
    a, b = generate_requests(plain, char_corpus), generate_requests(classed, char_corpus)
    assert key(a) == key(b)  # same lengths, arrivals and prompts: the classes come from their own stream
    counts = {p: sum(r.priority == p for r in b) for p in (0, 5)}
    assert counts[0] + counts[5] == 400 and 70 <= counts[0] <= 130
    assert all(r.priority == 0 for r in a)
    for bad, message in (([{"priority": 0, "share": 0.5}], "sum to 1"),
                         ([{"priority": 1, "share": 0.5}, {"priority": 1, "share": 0.5}], "each priority once")):
        with pytest.raises(WorkloadError, match=message):
            parse_workload({**TINY, "priorities": bad})


def test_the_bench_sends_priorities_and_reports_each_class(loaded: LoadedModel, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_yaml(tmp_path / "classes.yaml", {
        **TINY, "num_requests": 8, "shared_prefix": None,
        "priorities": [{"priority": 0, "share": 0.5}, {"priority": 3, "share": 0.5}]})
    assert main(["bench", "--workload", str(spec), "--scheduling-policy", "priority", "--num-kv-blocks", "256",
                 "--no-progress", "--output", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    assert "-- Priority 0 " in out and "-- Priority 3 " in out
    _, (run,) = read_run_file(tmp_path / "run.json")
    assert {r.priority for r in run.capture.results} == {0, 3} and all(r.ok for r in run.capture.results)


def test_turn_clock_runs_only_during_its_turns() -> None:
    clock = TurnClock()
    assert clock() == 0.0
    time.sleep(0.02)
    assert clock() == 0.0  # no turn yet: nothing of the host's time is this engine's
    with clock.turn():
        time.sleep(0.02)
        inside = clock()
        assert inside >= 0.02
        with pytest.raises(RuntimeError), clock.turn():
            pass
    after = clock()
    assert after >= inside
    time.sleep(0.02)
    assert clock() == after
    clock.wait_until(after + 5.0)  # waiting for an arrival jumps at once
    assert clock() == pytest.approx(after + 5.0)
    clock.wait_until(1.0)  # a time already past leaves the clock where it is
    assert clock() == pytest.approx(after + 5.0)


def test_lockstep_runs_take_turns_step_by_step_each_on_its_own_time(loaded: LoadedModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst on two engines at once: each turn goes to the engine least far through the
    workload (the share of its output tokens collected), so the two cross it together; each
    run's duration counts its own steps and none of the other's."""
    spec = parse_workload({**TINY, "num_requests": 6, "arrivals": {"kind": "burst"}})
    requests = generate_requests(spec, Corpus(loaded.tokenizer))
    calls: list[int] = []
    engines: list[Any] = []
    own_s = [0.0, 0.0]
    total = sum(r.output_len for r in requests)
    progress = [0.0, 0.0]  # each engine's share of its tokens collected, after its last step
    behind = []  # at each step: did the engine stepping have the least progress of those running?
    span: list[float] = []  # when the first step began and the last ended
    real = local_module.RequestDriver.step

    def logged(driver: Any) -> Any:
        if driver.engine not in engines:
            engines.append(driver.engine)
        j = engines.index(driver.engine)
        calls.append(j)
        if len(engines) == 2:
            behind.append(all(progress[j] <= p for p in progress if p < 1.0))
        started = time.perf_counter()
        try:
            return real(driver)
        finally:
            own_s[j] += time.perf_counter() - started
            span[:] = [span[0] if span else started, time.perf_counter()]
            progress[j] = driver.num_tokens / total

    monkeypatch.setattr(local_module.RequestDriver, "step", logged)
    # Two requests a step against six: the first makes a third of the second's tokens a step.
    plans = [RunPlan("off", {"max_batch_size": 2}), RunPlan("ngram", {"speculative_config": {"method": "ngram"}})]
    off, ngram = runs_module.run_lockstep(None, {"num_kv_blocks": 64}, plans, requests, loaded=loaded)
    # The order the runner promises: the first steps one each, then always the one behind, so
    # the slower engine takes more turns.
    assert calls[:2] == [0, 1] and behind and all(behind)
    assert progress == [1.0, 1.0] and calls.count(0) >= 2 * calls.count(1)
    for j, run in enumerate((off, ngram)):
        results = run.capture.results
        assert [r.num_output_tokens for r in results] == [r.output_len for r in requests]
        assert not any(r.error for r in results) and run.options["lockstep"] is True
        # Its own steps, up to the last token's stamp (taken inside the last step's collection).
        assert run.capture.duration_s >= 0.9 * own_s[j]
    # Neither clock ran during the other's turns: on wall clocks each run would last most of the
    # span of their steps together, and the two nearly twice it.
    assert off.capture.duration_s + ngram.capture.duration_s <= 1.1 * (span[1] - span[0])
    assert off.capture.counters.spec_num_lookups == 0
    assert (ngram.capture.counters.spec_num_lookups or 0) > 0


def test_bench_cli_compares_in_lockstep(loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_yaml(tmp_path / "tiny.yaml", TINY)
    monkeypatch.setattr(LoadedModel, "load", classmethod(lambda cls, *args, **kwargs: loaded))
    assert main(["bench", "--workload", str(spec), "--num-kv-blocks", "64", "--compare", "chunked,prefix-caching",
                 "--lockstep", "--no-progress", "--output", str(tmp_path / "run.json")]) == 0
    _, runs = read_run_file(tmp_path / "run.json")
    assert [r.label for r in runs] == ["chunked", "prefix-caching"]
    for run in runs:
        assert run.options["lockstep"] is True and run.metrics.num_completed == 4
        assert [r.num_output_tokens for r in run.capture.results] == [r.output_len for r in run.capture.results]
    capsys.readouterr()
    assert main(["bench", "--workload", str(spec), "--url", "http://127.0.0.1:9", "--lockstep"]) == 2
    assert "--lockstep" in capsys.readouterr().err


def test_lockstep_single_stream_sends_each_request_when_the_last_finished(loaded: LoadedModel) -> None:
    spec = parse_workload({**TINY, "arrivals": {"kind": "burst"}})
    requests = generate_requests(spec, Corpus(loaded.tokenizer))
    plans = [RunPlan("off", {}), RunPlan("off-again", {})]
    for run in runs_module.run_lockstep(None, {"num_kv_blocks": 64}, plans, requests, max_concurrency=1,
                                        loaded=loaded):
        results = run.capture.results
        assert [r.index for r in results] == [0, 1, 2, 3] and not any(r.error for r in results)
        ends = np.cumsum([r.e2e_s for r in results])
        assert [r.arrival_s for r in results] == pytest.approx([0.0, *ends[:-1]])
        assert run.capture.duration_s == pytest.approx(ends[-1])
