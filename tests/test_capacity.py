"""The capacity search (`bench.capacity.find_max_rate`) on a target whose edge is known, the SLA's
optional lines, and `inflight bench --find-max-rate` end to end against a real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from inflight.bench.capacity import find_max_rate, format_capacity
from inflight.bench.metrics import RequestResult, RequestSLO
from inflight.bench.results import BenchRun, Capture
from inflight.bench.sla import SLA, CheckLine, SLAError, check_run, format_check, load_sla
from inflight.cli import main
from inflight.model.loaded import LoadedModel


def _run_at(rate: float, edge: float) -> BenchRun:
    """A run whose TTFT grows with the rate and crosses 100 ms at `edge` req/s."""
    ttft = 0.1 * rate / edge
    results = [RequestResult.from_token_times(i, 10, 3, 0.0, [ttft, ttft + 0.01, ttft + 0.02], ttft + 0.02)
               for i in range(4)]
    return BenchRun.measure(f"rate={rate:.4g}", {}, Capture(results, 4 / rate), RequestSLO(max_ttft_ms=100))


def _measure(edge: float, sla: SLA, calls: list[float]):  # noqa: ANN202
    def measure(rate: float) -> tuple[BenchRun, list[CheckLine]]:
        calls.append(rate)
        run = _run_at(rate, edge)
        return run, check_run(sla, run, None)
    return measure


SLA_TTFT = SLA(max_ttft_p99_ms=100, goodput={"max_ttft_ms": 100})


@pytest.mark.parametrize("start", [0.3, 3.0, 40.0])
def test_the_search_finds_the_edge_from_below_and_above(start: float) -> None:
    calls: list[float] = []
    capacity = find_max_rate(_measure(3.7, SLA_TTFT, calls), start, rel_tol=0.02, max_trials=30)
    assert capacity.max_rate is not None and 3.7 / 1.02 <= capacity.max_rate <= 3.7
    assert capacity.stopped is None and len(capacity.trials) == len(calls) <= 30
    assert all(t.passed == (t.rate <= 3.7) for t in capacity.trials)
    failing = [t for t in capacity.trials if not t.passed]
    assert failing and all(t.limiting == ["TTFT p99"] for t in failing)
    assert capacity.passes(3.0) is True and capacity.passes(5.0) is False
    table = format_capacity(capacity, SLA_TTFT.goodput.slo(), "t")  # type: ignore[union-attr]
    assert "highest passing rate: 3.6" in table and "TTFT p99" in table and "100%" in table


def test_a_floor_short_at_low_rates_sends_the_search_up() -> None:
    """Output throughput grows with the rate (3 tok/s per req/s here): an SLA floor of 3 tok/s
    fails below 1 req/s, the TTFT ceiling above 3.7. From below the window the search climbs;
    from above it comes down through it; a floor beyond the ceiling passes nowhere."""
    window = SLA(max_ttft_p99_ms=100, min_output_tokens_per_s=3)
    for start in (0.1, 20.0):
        calls: list[float] = []
        capacity = find_max_rate(_measure(3.7, window, calls), start, rel_tol=0.02)
        assert capacity.max_rate is not None and 3.7 / 1.02 <= capacity.max_rate <= 3.7, calls
        short = [t for t in capacity.trials if t.too_low]
        assert all(t.rate < 1 and t.limiting == ["output throughput"] for t in short)
        assert (start < 1) == bool(short)
    calls = []
    nowhere = find_max_rate(_measure(3.7, SLA(max_ttft_p99_ms=100, min_output_tokens_per_s=30), calls), 1.0,
                            rel_tol=0.05)
    assert nowhere.max_rate is None and len(calls) < 20
    assert any(t.too_low for t in nowhere.trials) and any(not t.too_low for t in nowhere.trials)


def test_the_search_is_bounded_and_starts_at_the_floor() -> None:
    calls: list[float] = []
    capacity = find_max_rate(_measure(3.7, SLA_TTFT, calls), 1.0, rel_tol=0.001, max_trials=4)
    assert len(calls) == 4 and capacity.stopped == "stopped after 4 trials"
    assert capacity.max_rate == pytest.approx(2 ** 1.5)  # 1 and 2 pass, 4 fails, then the midpoint 2.83 passes
    calls.clear()
    below = find_max_rate(_measure(3.7, SLA_TTFT, calls), 1.0, min_rate=5.0)
    assert calls == [5.0] and below.max_rate is None and below.passes(5.0) is False
    calls.clear()
    at_floor = find_max_rate(_measure(3.7, SLA_TTFT, calls), 1.0, rel_tol=0.1, min_rate=2.0)
    assert calls[0] == 2.0 and at_floor.passes(2.0) and at_floor.max_rate is not None
    assert find_max_rate(_measure(3.7, SLA_TTFT, []), 1.0, budget_s=0.0).trials == []
    with pytest.raises(ValueError, match="positive starting rate"):
        find_max_rate(_measure(3.7, SLA_TTFT, []), 0.0)


def test_optional_lines_skip_only_when_unmeasured(tmp_path: Path) -> None:
    run = _run_at(1.0, 3.7)  # in-process-like: no server figures
    sla = SLA(max_ttft_p99_ms=100, max_kv_peak_perc=90, max_preemptions=0, optional=["max_kv_peak_perc"])
    lines = {line.name: line for line in check_run(sla, run, None)}
    assert lines["KV cache peak"].status == "SKIP" and lines["KV cache peak"].ok
    assert lines["preemptions"].status == "FAIL" and "not measured" in lines["preemptions"].format()
    text = format_check("sla.yaml", "run.json", [(run, list(lines.values()))])
    assert text.endswith("RESULT: FAIL (1 of 2 checks passed, 1 optional not measured)")
    # A measured optional line is judged like any other.
    (ttft,) = check_run(SLA(max_ttft_p99_ms=1, optional=["max_ttft_p99_ms"]), run, None)
    assert ttft.status == "FAIL"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"max_oom": 0, "optional": ["max_om"]}))
    with pytest.raises(SLAError, match="optional: max_om is not a line that can go unmeasured"):
        load_sla(bad)


def test_find_max_rate_against_a_real_server(loaded: LoadedModel, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The same requests at three rates through HTTP: the table, the run file with every trial,
    the plot, and the exit code from the SLA's floor."""
    launcher = pytest.importorskip("inflight.server.launcher")
    from inflight import EngineConfig, LLMEngine
    from inflight.model.tokenizer import Tokenizer
    from inflight.server.config import ServerConfig

    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"name": "tiny", "seed": 3, "num_requests": 4,
                                    "arrivals": {"kind": "poisson", "rate": 4},
                                    "prompt_len": {"kind": "uniform", "min": 8, "max": 24},
                                    "output_len": {"kind": "uniform", "min": 2, "max": 4}}))
    sla = tmp_path / "sla.yaml"
    sla.write_text(yaml.safe_dump({"max_failed_requests": 0, "max_http_5xx": 0, "max_kv_peak_perc": 100,
                                   "max_preemptions": 0, "min_request_rate": 0.5,
                                   "goodput": {"max_ttft_ms": 600_000}}))
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64), loaded)
    monkeypatch.setattr(Tokenizer, "load", classmethod(lambda cls, *args, **kwargs: loaded.tokenizer))
    with launcher.serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as server:
        code = main(["bench", "--workload", str(spec), "--url", server.url, "--sla", str(sla), "--find-max-rate",
                     "--max-trials", "3", "--no-progress", "--output", str(tmp_path / "cap.json"),
                     "--plot", str(tmp_path / "plots"), "--metrics-interval", "0.05"])
    out = capsys.readouterr()
    assert code == 0, out
    assert "highest passing rate" in out.out and "min_request_rate 0.5 req/s: PASS" in out.out
    assert "trial 3:" in out.err and "trial 4:" not in out.err
    document = json.loads((tmp_path / "cap.json").read_text())
    capacity = document["capacity"]
    assert [t["rate"] for t in capacity["trials"]] == [0.5, 4.0, 8.0]  # the floor, the spec's rate, doubled
    assert all(t["passed"] for t in capacity["trials"]) and capacity["max_rate"] == 8.0
    assert capacity["stopped"] == "stopped after 3 trials"
    assert len(document["runs"]) == 3 and document["target"]["metrics"]["server_kind"] == "inflight"
    prompts = [[r["prompt_len"] for r in run["requests"]] for run in document["runs"]]
    assert prompts[0] == prompts[1] == prompts[2]  # the same traffic at each rate
    assert (tmp_path / "plots" / "capacity.png").stat().st_size > 10_000
