"""The pre-launch checklist: SLA limits read from YAML, checked against a bench run.

    workload: mixed               # optional: the run must have used this workload
    min_output_tokens_per_s: 40
    max_ttft_p99_ms: 8000
    max_tbt_p99_ms: 1000
    max_kv_peak_perc: 90
    max_kv_mean_perc: 70
    max_oom: 0                    # inflight's steps failed out of memory
    max_preemptions: 10           # requests whose KV the engine took back (vLLM, SGLang, inflight)
    max_server_failed_requests: 0 # requests the server counts as failed
    max_http_5xx: 0               # 5xx responses, as the client saw them (any server)
    max_failed_requests: 0
    min_goodput_req_per_s: 0.5
    goodput:                      # what makes one request "good"
      max_ttft_ms: 5000
      max_tpot_ms: 250
    optional: [max_oom]           # lines that may go unmeasured (a server that does not expose them)
    min_request_rate: 2.0         # bench --find-max-rate: the rate that must pass

Every line is optional. A limit whose figure the run did not measure fails: a checklist must
not pass on missing data, unless the SLA names the line under `optional:`; then it shows as
SKIP, "not exposed", and counts neither way. Which server figures each engine exposes:
`inflight.bench.server_metrics.DIALECTS`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from inflight.bench.distributions import SpecModel
from inflight.bench.metrics import BenchMetrics, RequestSLO
from inflight.bench.results import BenchRun
from inflight.errors import InflightError


class SLAError(InflightError):
    """An SLA file is missing or invalid."""


class GoodputLimits(SpecModel):
    max_ttft_ms: float | None = Field(None, gt=0)
    max_tpot_ms: float | None = Field(None, gt=0)
    max_e2e_ms: float | None = Field(None, gt=0)

    def slo(self) -> RequestSLO:
        return RequestSLO(self.max_ttft_ms, self.max_tpot_ms, self.max_e2e_ms)


class SLA(SpecModel):
    workload: str | None = None
    min_output_tokens_per_s: float | None = Field(None, ge=0)
    max_ttft_p99_ms: float | None = Field(None, gt=0)
    max_tbt_p99_ms: float | None = Field(None, gt=0)
    max_tpot_p99_ms: float | None = Field(None, gt=0)
    max_kv_peak_perc: float | None = Field(None, gt=0, le=100)
    max_kv_mean_perc: float | None = Field(None, gt=0, le=100)
    max_oom: int | None = Field(None, ge=0)
    max_preemptions: int | None = Field(None, ge=0)
    max_server_failed_requests: int | None = Field(None, ge=0)
    max_http_5xx: int | None = Field(None, ge=0)
    max_failed_requests: int | None = Field(None, ge=0)
    min_goodput_req_per_s: float | None = Field(None, ge=0)
    goodput: GoodputLimits | None = None
    optional: list[str] = Field(default_factory=list)
    # The arrival rate (req/s) the service must sustain: `inflight bench --find-max-rate` exits
    # 0 only if the SLA passes there.
    min_request_rate: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check_goodput(self) -> SLA:
        if self.min_goodput_req_per_s is not None and self.goodput is None:
            raise ValueError("min_goodput_req_per_s needs a goodput: section with per-request limits")
        limits = {field for field, *_ in _LIMITS}
        for name in self.optional:
            if name not in limits:
                raise ValueError(f"optional: {name} is not a line that can go unmeasured "
                                 f"(one of {', '.join(sorted(limits))})")
        return self


def load_sla(path: str | Path) -> SLA:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SLAError(f"cannot read SLA file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise SLAError(f"SLA file {path} is not valid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise SLAError(f"SLA file {path}: expected a mapping of limits")
    try:
        return SLA.model_validate(data)
    except ValidationError as exc:
        parts = [f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}".lstrip(": ")
                 for e in exc.errors()]
        raise SLAError(f"SLA file {path}: {'; '.join(parts)}") from None


@dataclass(frozen=True, slots=True)
class CheckLine:
    name: str
    measured: float | str | None
    limit: float | str
    unit: str
    passed: bool
    skipped: bool = False  # an optional line the run could not measure: counts neither way
    missing: str = "not measured"  # what an unmeasured figure shows
    floor: bool = False  # a lower bound on a rate (throughput, goodput): more load helps it pass

    @property
    def ok(self) -> bool:
        """Passed, or an optional line that could not be measured."""
        return self.passed or self.skipped

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"

    def format(self) -> str:
        shown = self.missing if self.measured is None else _show(self.measured, self.unit)
        return f"  {self.status}  {self.name:<24} {shown:>16}   {_show(self.limit, self.unit)}"


# (SLA field, shown name, unit, metric getter, comparison the measured value must satisfy)
_LIMITS: list[tuple[str, str, str, Callable[[BenchMetrics], Any], Callable[[Any, Any], bool], str]] = [
    ("min_output_tokens_per_s", "output throughput", "tok/s", lambda m: m.output_throughput, operator.ge, ">="),
    ("max_ttft_p99_ms", "TTFT p99", "ms", lambda m: m.ttft_ms.p99, operator.le, "<="),
    ("max_tbt_p99_ms", "TBT p99", "ms", lambda m: m.tbt_ms.p99, operator.le, "<="),
    ("max_tpot_p99_ms", "TPOT p99", "ms", lambda m: m.tpot_ms.p99, operator.le, "<="),
    ("max_kv_peak_perc", "KV cache peak", "%", lambda m: m.kv_peak_perc, operator.le, "<="),
    ("max_kv_mean_perc", "KV cache mean", "%", lambda m: m.kv_mean_perc, operator.le, "<="),
    ("max_oom", "OOM events", "", lambda m: m.num_oom_errors, operator.le, "<="),
    ("max_preemptions", "preemptions", "", lambda m: m.num_preemptions, operator.le, "<="),
    ("max_server_failed_requests", "server-failed requests", "", lambda m: m.num_server_failed_requests,
     operator.le, "<="),
    ("max_http_5xx", "HTTP 5xx responses", "", lambda m: m.num_http_5xx, operator.le, "<="),
    ("max_failed_requests", "failed requests", "", lambda m: m.num_failed, operator.le, "<="),
]
# Figures only a server's /metrics gives: unmeasured on a server that does not expose them.
_FROM_SERVER = frozenset({"max_kv_peak_perc", "max_kv_mean_perc", "max_oom", "max_preemptions",
                          "max_server_failed_requests"})


def check_run(sla: SLA, run: BenchRun, workload_name: str | None) -> list[CheckLine]:
    lines = []
    if sla.workload is not None:
        lines.append(CheckLine("workload", workload_name, f"= {sla.workload}", "", workload_name == sla.workload))
    server = run.options.get("metrics") or {}
    for field, name, unit, get, ok, sign in _LIMITS:
        limit = getattr(sla, field)
        if limit is None:
            continue
        measured = get(run.metrics)
        missing = "not measured"
        if measured is None and field in _FROM_SERVER and server.get("server_kind"):
            missing = "not exposed"  # the server answered /metrics without this figure
        lines.append(CheckLine(name, measured, f"{sign} {_num(limit)}", unit,
                               measured is not None and ok(measured, limit),
                               skipped=measured is None and field in sla.optional, missing=missing,
                               floor=sign == ">="))
    if sla.min_goodput_req_per_s is not None and sla.goodput is not None:
        slo = sla.goodput.slo()
        good = sum(slo.is_met(r) for r in run.capture.results)
        goodput = good / max(run.capture.duration_s, 1e-9)
        lines.append(CheckLine("goodput", goodput, f">= {_num(sla.min_goodput_req_per_s)}", "req/s",
                               goodput >= sla.min_goodput_req_per_s, floor=True))
    return lines


def format_check(sla_path: str, run_path: str, results: Sequence[tuple[BenchRun, list[CheckLine]]]) -> str:
    out = []
    for run, lines in results:
        out.append(f"SLA {sla_path} vs {run_path} [{run.label}]")
        out.extend(line.format() for line in lines)
    counted = [line for _, lines in results for line in lines if not line.skipped]
    failed = sum(not line.ok for line in counted)
    skipped = sum(len(lines) for _, lines in results) - len(counted)
    note = f", {skipped} optional not measured" if skipped else ""
    out.append(f"RESULT: {'PASS' if not failed else 'FAIL'} ({len(counted) - failed} of {len(counted)} checks "
               f"passed{note})")
    return "\n".join(out)


def _num(value: float) -> str:
    return f"{value:g}"


def _show(value: Any, unit: str) -> str:
    if value is None:
        return "not measured"
    if isinstance(value, float):
        value = f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return f"{value} {unit}".strip()
