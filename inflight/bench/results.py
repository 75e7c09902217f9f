"""What one run measured (`Capture`), the same with its label, options and metrics (`BenchRun`),
and their JSON form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from inflight.bench.metrics import (
    BenchMetrics,
    EngineCounters,
    KvSample,
    LatencyStats,
    RequestResult,
    RequestSLO,
    compute_metrics,
)
from inflight.bench.timeline import Timeline


@dataclass(slots=True)
class Capture:
    """The raw measurements of a target (the in-process engine or a server) over one run."""

    results: list[RequestResult]
    duration_s: float
    samples: list[KvSample] = field(default_factory=list)
    counters: EngineCounters = field(default_factory=EngineCounters)
    timeline: Timeline | None = None


@dataclass(slots=True)
class BenchRun:
    label: str
    options: dict[str, Any]  # engine options (in-process) or what is known of the server (HTTP)
    capture: Capture
    metrics: BenchMetrics

    @classmethod
    def measure(cls, label: str, options: dict[str, Any], capture: Capture,
                slo: RequestSLO | None = None) -> BenchRun:
        metrics = compute_metrics(capture.results, capture.duration_s, capture.samples, capture.counters, slo)
        return cls(label, options, capture, metrics)

    def to_dict(self) -> dict[str, Any]:
        c = self.capture
        return {
            "label": self.label,
            "options": self.options,
            "metrics": dataclasses.asdict(self.metrics),
            "counters": dataclasses.asdict(c.counters),
            "duration_s": c.duration_s,
            "requests": [_rounded(dataclasses.asdict(r)) for r in c.results],
            "samples": {"fields": ["t_s", "kv_usage_perc", "num_running", "num_waiting", "kv_live_perc"],
                        "rows": [_rounded(list(dataclasses.astuple(s))) for s in c.samples]},
            "timeline": c.timeline.to_dict() if c.timeline is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRun:
        """Reads a run back from its JSON form; raises KeyError/TypeError/ValueError if malformed."""
        capture = Capture(
            results=[RequestResult(**r) for r in data["requests"]],
            duration_s=float(data["duration_s"]),
            samples=[KvSample(*row) for row in data["samples"]["rows"]],
            counters=EngineCounters(**_renamed(data["counters"])),
            timeline=Timeline.from_dict(data["timeline"]) if data.get("timeline") else None,
        )
        m = _renamed(data["metrics"])
        for key in ("ttft_ms", "tbt_ms", "tpot_ms", "e2e_ms"):
            m[key] = LatencyStats(**m[key])
        return cls(data["label"], data["options"], capture, BenchMetrics(**m))


# Fields that run files written before a rename still carry under their old names.
_OLD_NAMES = {"num_oom": "num_oom_errors"}


def _renamed(fields: dict[str, Any]) -> dict[str, Any]:
    return {_OLD_NAMES.get(k, k): v for k, v in fields.items()}


def _rounded(value: Any) -> Any:
    """Times to the microsecond: finer digits are noise and would double the file's size."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
