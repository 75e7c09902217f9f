"""Reading other engines' /metrics: each engine's dialect on texts in its format (captured from
a real server where one ran here, built from the engine's source otherwise: tests/fixtures/
metrics/README.md says which), inflight's own on its real rendering, and the gate end to end on
fake servers that speak vLLM's and llama.cpp's names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from inflight.bench.client import run_http
from inflight.bench.corpus import Corpus
from inflight.bench.results import BenchRun
from inflight.bench.server_metrics import (
    COUNTERS,
    DIALECTS,
    ExpositionError,
    kv_usage_from_slots,
    parse_exposition,
    parse_prometheus,
    recognize,
)
from inflight.bench.sla import SLA, check_run, format_check
from inflight.bench.workload import generate_requests, parse_workload
from inflight.engine.stats import EngineStats

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def _reads(kind: str, **figures: Any) -> tuple[str, dict[str, Any]]:
    """The engine a fixture must be recognized as and every figure its dialect reads (None: not
    exposed by that engine at that version)."""
    base = dict.fromkeys(("kv_usage", "running", "waiting", *COUNTERS))
    return kind, {**base, **figures}


EXPECTED: dict[str, tuple[str, dict[str, Any]]] = {
    "vllm-0.34.0.txt": _reads("vllm", kv_usage=0.4375, running=3, waiting=1, preemptions=2, failed_requests=1),
    "vllm-0.11.0.txt": _reads("vllm", kv_usage=0.4375, running=3, waiting=1, preemptions=2),  # no "error" reason
    # A real vLLM 0.32.0 CPU server's, mid-run: its finish reasons include "error" (at 0).
    "vllm-0.32.0-captured.txt": _reads("vllm", kv_usage=0.07734806629834257, running=7, waiting=20, preemptions=0,
                                       failed_requests=0),
    "vllm-0.6.3.txt": _reads("vllm-v0", kv_usage=0.8125, running=4, waiting=2, preemptions=7),
    "sglang-0.5.23.txt": _reads("sglang", kv_usage=0.42, running=12, waiting=3, preemptions=5, failed_requests=3),
    "llama.cpp-0c1e570.txt": _reads("llama.cpp", running=4, waiting=46),
    "llama.cpp-0c1e570-captured.txt": _reads("llama.cpp", running=8, waiting=16),  # a real llama-server's
    "llama.cpp-8733e0c.txt": _reads("llama.cpp", kv_usage=0.125, running=1, waiting=0),
    "trtllm-0.19.0.txt": _reads("trtllm", kv_usage=0.25, running=6, waiting=3, failed_requests=0),  # CANCELED: not
    "tgi-3.3.7.txt": _reads("tgi", kv_usage=24576 / 131072, running=16, waiting=5, failed_requests=2),
}


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in token_ids)


def test_every_dialect_names_its_source_and_unique_markers() -> None:
    markers = [m for d in DIALECTS.values() for m in d.markers]
    assert len(markers) == len(set(markers))
    for dialect in DIALECTS.values():
        assert dialect.source and dialect.markers
        assert dialect.kv_usage is not None or dialect.kind in ("tgi",), dialect.kind


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.txt")))
def test_each_engine_is_recognized_and_read(name: str) -> None:
    kind, figures = EXPECTED[name]
    series = parse_exposition((FIXTURES / name).read_text())
    dialect = recognize(series)
    assert dialect is not None and dialect.kind == kind
    reading = dialect.read(series)
    for figure, want in figures.items():
        got = reading.counters.get(figure) if figure in COUNTERS else getattr(reading, figure)
        assert got == pytest.approx(want) if want is not None else got is None, (figure, got, want)
    assert set(reading.exposed) == {f for f, v in figures.items() if v is not None}


def test_the_fixture_table_covers_every_fixture_and_engine() -> None:
    assert sorted(EXPECTED) == sorted(p.name for p in FIXTURES.glob("*.txt"))
    assert {kind for kind, _ in EXPECTED.values()} == set(DIALECTS) - {"inflight"}


def test_inflight_is_read_from_its_own_rendering() -> None:
    from inflight.server.metrics import ServerMetrics

    stats = EngineStats(num_running=3, num_waiting=2, num_kv_blocks_used=30, num_kv_blocks_total=120,
                        num_kv_blocks_peak=60, num_preemptions=4, num_oom_errors=1, num_kv_allocation_failures=5,
                        num_kv_live_tokens=240, block_size=16, spec_num_drafts=6, spec_num_draft_tokens=20,
                        spec_num_accepted_tokens=11, spec_accepted_per_position=(5, 4, 2), spec_num_lookups=9,
                        spec_num_found=7)
    metrics = ServerMetrics(lambda: stats)
    metrics.count_failure("error")
    metrics.count_failure("aborted")  # the client left: not the server's failure
    series = parse_exposition(metrics.render().decode())
    dialect = recognize(series)
    assert dialect is not None and dialect.kind == "inflight"
    reading = dialect.read(series)
    assert (reading.kv_usage, reading.running, reading.waiting, reading.kv_peak) == (0.25, 3, 2, 0.5)
    assert reading.kv_live == pytest.approx(240 / (30 * 16))
    assert reading.counters == {"preemptions": 4, "oom_errors": 1, "failed_requests": 1, "kv_allocation_failures": 5,
                                "spec_drafts": 6, "spec_draft_tokens": 20, "spec_accepted_tokens": 11,
                                "spec_lookups": 9, "spec_found": 7}


def test_fleet_series_keep_the_fullest_pool_and_sum_the_rest() -> None:
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 5\n')
    reading = DIALECTS["vllm"].read(parse_exposition(text))
    assert (reading.kv_usage, reading.running) == (0.75, 7)
    assert parse_prometheus(text) == {"vllm:kv_cache_usage_perc": 0.75, "vllm:num_requests_running": 7}


def test_a_body_that_is_not_the_text_format_is_one_error() -> None:
    with pytest.raises(ExpositionError, match="not Prometheus text format"):
        parse_exposition("<html>not metrics</html>\n")
    assert recognize(parse_exposition("some_other_server_metric 1\n")) is None


def _fake_server(metrics: list[str], fail_one: bool = False, slots: Any = None) -> httpx.MockTransport:
    """An OpenAI-compatible streaming server whose /metrics walks through `metrics` (then stays
    at the last); with `fail_one`, the request of 3 output tokens gets a 503; with `slots`, a
    /slots answer (llama-server's)."""
    scrapes = iter(metrics)
    last = [metrics[0]]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if request.url.path == "/metrics":
            last[0] = next(scrapes, last[0])
            return httpx.Response(200, text=last[0])
        if request.url.path == "/slots" and slots is not None:
            return httpx.Response(200, json=slots)
        if request.url.path != "/v1/completions":
            return httpx.Response(404, json={"error": "no such endpoint"})
        body = json.loads(request.content)
        if fail_one and body["max_tokens"] == 3:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        chunks = [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}] * body["max_tokens"]
        chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        content = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=content.encode(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def _vllm(usage: float, running: int, waiting: int, preemptions: int, errors: int) -> str:
    labels = 'engine="0",model_name="fake"'
    return (f"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} {waiting}\n"
            f"# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{{{labels}}} {preemptions}\n"
            f"# TYPE vllm:request_success counter\n"
            f'vllm:request_success_total{{{labels},finished_reason="length"}} 40\n'
            f'vllm:request_success_total{{{labels},finished_reason="abort"}} 3\n'
            f'vllm:request_success_total{{{labels},finished_reason="error"}} {errors}\n')


SPEC = {"name": "tiny", "seed": 3, "num_requests": 6, "arrivals": {"kind": "poisson", "rate": 30},
        "prompt_len": {"kind": "uniform", "min": 8, "max": 24}, "output_len": {"kind": "uniform", "min": 2, "max": 5}}


def _bench(transport: httpx.MockTransport, **kwargs: Any) -> tuple[BenchRun, dict[str, Any]]:
    requests = generate_requests(parse_workload(SPEC), Corpus(CharTokenizer()))
    capture, info = run_http("http://fake", requests, progress=False, transport=transport,
                             metrics_interval_s=0.01, **kwargs)
    return BenchRun.measure("server", info, capture), info


def test_the_gate_reads_a_vllm_server() -> None:
    """KV watermark (peak and mean of the samples), preemptions and server-side failures as
    their rise over the run, the sampling's own cost; every SLA line measured."""
    walk = [_vllm(0.1, 0, 0, 7, 1), _vllm(0.8, 4, 2, 9, 1), _vllm(0.5, 2, 0, 10, 2)]
    run, info = _bench(_fake_server(walk))
    sampling = info["metrics"]
    assert sampling["server_kind"] == "vllm" and "vllm/v1/metrics" in sampling["names_from"]
    assert set(sampling["exposed"]) == {"kv_usage", "running", "waiting", "preemptions", "failed_requests"}
    assert sampling["scrapes"] >= 2 and sampling["scrape_mean_ms"] >= sampling["parse_cpu_mean_ms"] > 0
    assert 0 < sampling["cpu_share"] < 1
    m = run.metrics
    assert m.kv_peak_perc == pytest.approx(80.0) and 10.0 < m.kv_mean_perc < 80.0  # type: ignore[operator]
    assert (m.num_preemptions, m.num_server_failed_requests, m.num_oom_errors) == (3, 1, None)
    assert max(s.num_running for s in run.capture.samples) == 4
    sla = SLA(max_kv_peak_perc=90, max_kv_mean_perc=90, max_preemptions=5, max_server_failed_requests=1,
              max_http_5xx=0, max_failed_requests=0)
    lines = check_run(sla, run, None)
    assert [line.status for line in lines] == ["PASS"] * 6
    strict = check_run(SLA(max_kv_peak_perc=50, max_preemptions=2), run, None)
    assert [line.status for line in strict] == ["FAIL", "FAIL"]


def test_a_figure_the_server_does_not_expose() -> None:
    """llama-server (since its KV metrics went): no KV usage, no preemptions. Required lines
    fail as "not exposed", optional ones are skipped; a 503 is counted by the client."""
    text = ("# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n"
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
            "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 1\n")
    run, info = _bench(_fake_server([text], fail_one=True))
    assert info["metrics"]["server_kind"] == "llama.cpp"
    assert set(info["metrics"]["exposed"]) == {"running", "waiting"}
    assert run.metrics.num_http_5xx == sum(r.output_len == 3 for r in run.capture.results) > 0
    assert run.capture.samples == [] and run.metrics.kv_peak_perc is None
    sla = SLA(max_kv_peak_perc=90, max_preemptions=0, max_http_5xx=0, optional=["max_preemptions"])
    lines = check_run(sla, run, None)
    assert [(line.name, line.status) for line in lines] == [
        ("KV cache peak", "FAIL"), ("preemptions", "SKIP"), ("HTTP 5xx responses", "FAIL")]
    assert "not exposed" in lines[0].format() and "not exposed" in lines[1].format()
    assert "RESULT: FAIL (0 of 2 checks passed, 1 optional not measured)" in format_check("s", "r", [(run, lines)])


def test_llama_server_kv_usage_from_its_slots() -> None:
    """A llama-server without KV metrics: the usage is the tokens its slots hold over their
    context, and the run says where the figure came from."""
    text = (FIXTURES / "llama.cpp-0c1e570.txt").read_text()
    slots = [{"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": True, "id_task": 7,
              "n_prompt_tokens": 1024, "next_token": [{"has_next_token": True, "n_decoded": 3}]},
             {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": False}]
    run, info = _bench(_fake_server([text], slots=slots))
    assert info["metrics"]["kv_usage_from"].startswith("/slots")
    assert "kv_usage" in info["metrics"]["exposed"] and run.metrics.kv_peak_perc == pytest.approx(12.5)
    assert kv_usage_from_slots({"not": "slots"}) is None and kv_usage_from_slots([{"id": 0}]) is None
    # A real llama-server's /slots mid-run (8 slots of 1024, all busy): 1592 tokens held.
    captured = json.loads((FIXTURES / "llama.cpp-0c1e570-captured-slots.json").read_text())
    assert kv_usage_from_slots(captured) == pytest.approx(1592 / 8192)


def test_metrics_served_apart_from_the_api() -> None:
    """Triton serves /metrics on its own port: --metrics-url points the sampler there."""
    trt = (FIXTURES / "trtllm-0.19.0.txt").read_text()
    api = _fake_server(["no_metrics_here 1\n"])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port == 8002:
            return httpx.Response(200, text=trt) if request.url.path == "/metrics" else httpx.Response(404)
        return api.handle_request(request)

    run, info = _bench(httpx.MockTransport(handler), metrics_url="http://fake:8002")
    assert info["metrics"]["server_kind"] == "trtllm" and info["metrics_url"] == "http://fake:8002"
    assert run.metrics.kv_peak_perc == pytest.approx(25.0) and run.metrics.num_completed == 6


def test_server_kind_can_be_named_and_unknown_servers_are_said() -> None:
    walk = [_vllm(0.3, 1, 0, 0, 0)]
    run, info = _bench(_fake_server(walk), server_kind="sglang")  # the wrong dialect: nothing read
    assert info["metrics"]["server_kind"] == "sglang" and info["metrics"]["exposed"] == []
    assert run.metrics.kv_peak_perc is None
    run, info = _bench(_fake_server(["other_server_requests 3\n"]))
    assert "none of the names of a known engine" in info["metrics"]["problem"]
    assert run.metrics.num_completed == 6  # the traffic ran all the same


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.txt")))
def test_parsing_only_the_dialects_families_reads_the_same(name: str) -> None:
    """The sampler parses only the families a recognized engine's dialect reads (a real vLLM
    scrape is 52 KB, mostly histograms): the reading is the one the whole text gives."""
    text = (FIXTURES / name).read_text()
    whole = parse_exposition(text)
    dialect = recognize(whole)
    assert dialect is not None
    kept = parse_exposition(text, dialect.sample_names())
    assert dialect.read(kept) == dialect.read(whole)
    assert set(kept) < set(whole)  # something was left out of every engine's text
