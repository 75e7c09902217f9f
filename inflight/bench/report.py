"""The run's table on screen and its JSON file: the whole configuration beside the figures."""

from __future__ import annotations

import datetime
import gzip
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from inflight.bench.metrics import BenchMetrics, RequestResult
from inflight.bench.results import BenchRun
from inflight.errors import InflightError

SCHEMA = "inflight-bench/1"


class RunFileError(InflightError):
    """A run file is missing or not a bench result."""


def environment() -> dict[str, Any]:
    """Versions and the machine, so figures can be compared with care (or not at all)."""
    import numpy
    import torch

    device = "cuda: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "inflight": importlib.metadata.version("inflight"),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "device": device,
        # Other work on the machine when the run started (1, 5, 15 minutes).
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def write_run_file(path: Path, document: dict[str, Any], runs: Sequence[BenchRun]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"schema": SCHEMA, **document, "runs": [r.to_dict() for r in runs]}
    # Compact: the per-request and per-step records are long lists of numbers.
    text = json.dumps(data, separators=(",", ":"), default=_json_default, allow_nan=False) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        path.write_text(text, encoding="utf-8")


def read_run_file(path: Path) -> tuple[dict[str, Any], list[BenchRun]]:
    """(the document without its runs, the runs); raises RunFileError with a one-line message."""
    try:
        raw = Path(path).read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except OSError as exc:
        raise RunFileError(f"cannot read run file {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunFileError(f"run file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise RunFileError(f"{path} is not an inflight bench run file (schema {SCHEMA})")
    try:
        runs = [BenchRun.from_dict(r) for r in data.pop("runs")]
    except (KeyError, TypeError, ValueError) as exc:
        raise RunFileError(f"run file {path} is malformed: {type(exc).__name__}: {exc}") from None
    if not runs:
        raise RunFileError(f"run file {path} holds no runs")
    return data, runs


def _json_default(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


# --- the table ----------------------------------------------------------------------------------

Row = tuple[str, Callable[[BenchMetrics], Any], str]

TABLE_ROWS: list[Row | str] = [
    ("Successful requests", lambda m: m.num_completed, "d"),
    ("Failed requests", lambda m: m.num_failed, "d"),
    ("Duration (s)", lambda m: m.duration_s, ".1f"),
    ("Request throughput (req/s)", lambda m: m.request_throughput, ".2f"),
    ("Output throughput (tok/s)", lambda m: m.output_throughput, ".1f"),
    ("Total throughput (tok/s)", lambda m: m.total_throughput, ".1f"),
    ("Goodput (req/s)", lambda m: m.goodput, ".2f"),
    "Time to first token (ms)",
    *[(f"  {k}", lambda m, k=k: getattr(m.ttft_ms, k), ".0f") for k in ("mean", "p50", "p90", "p99", "max")],
    "Time between tokens (ms)",
    *[(f"  {k}", lambda m, k=k: getattr(m.tbt_ms, k), ".1f") for k in ("mean", "p50", "p90", "p99", "max")],
    "Time per output token (ms)",
    *[(f"  {k}", lambda m, k=k: getattr(m.tpot_ms, k), ".1f") for k in ("mean", "p50", "p99")],
    "End-to-end latency (ms)",
    *[(f"  {k}", lambda m, k=k: getattr(m.e2e_ms, k), ".0f") for k in ("p50", "p99")],
    "Engine",
    ("KV cache peak (%)", lambda m: m.kv_peak_perc, ".1f"),
    ("KV cache mean (%)", lambda m: m.kv_mean_perc, ".1f"),
    ("KV slots live, mean (%)", lambda m: m.kv_live_mean_perc, ".1f"),
    ("KV slots live, at peak (%)", lambda m: m.kv_live_at_peak_perc, ".1f"),
    ("Preemptions", lambda m: m.num_preemptions, "d"),
    ("KV allocation failures", lambda m: m.num_kv_allocation_failures, "d"),
    ("OOM events", lambda m: m.num_oom_errors, "d"),
    ("Spec. acceptance (%)", lambda m: m.spec_acceptance_perc, ".1f"),
    ("Spec. tokens per draft step", lambda m: m.spec_tokens_per_draft, ".2f"),
    ("Spec. lookups found (%)", lambda m: m.spec_proposal_perc, ".1f"),
]

# Ratios to the first run printed under a comparison: (name, metric, higher is better).
_RATIOS: list[tuple[str, Callable[[BenchMetrics], float | None]]] = [
    ("output tok/s", lambda m: m.output_throughput),
    ("TTFT p99", lambda m: m.ttft_ms.p99),
    ("TBT p99", lambda m: m.tbt_ms.p99),
    ("TTFT mean", lambda m: m.ttft_ms.mean),
]


def format_table(runs: Sequence[BenchRun], title: str) -> str:
    label_w = 30
    col_w = max(12, *(len(r.label) + 2 for r in runs))
    width = label_w + col_w * len(runs)
    lines = [f" {title} ".center(width, "="), " " * label_w + "".join(r.label.rjust(col_w) for r in runs)]
    for key in _differing_options(runs):
        cells = "".join(format_cell(r.options.get(key)).rjust(col_w) for r in runs)
        lines.append(key[:label_w - 1].ljust(label_w) + cells)
    for row in TABLE_ROWS:
        if isinstance(row, str):
            lines.append(f"-- {row} ".ljust(width, "-"))
            continue
        name, get, spec = row
        lines.append(name.ljust(label_w) + "".join(format_cell(get(r.metrics), spec).rjust(col_w) for r in runs))
    for priority in sorted({r.priority for run in runs for r in run.capture.results}) if _has_classes(runs) else []:
        lines.append(f"-- Priority {priority} ".ljust(width, "-"))
        for class_row, of_run, class_spec in _class_rows(priority):
            cells = "".join(format_cell(of_run(r), class_spec).rjust(col_w) for r in runs)
            lines.append(class_row.ljust(label_w) + cells)
    if len(runs) > 1:
        lines.append(f"-- Ratio to {runs[0].label} ".ljust(width, "-"))
        for name, get in _RATIOS:
            base = get(runs[0].metrics)
            values = [get(r.metrics) for r in runs]
            ratios = [format_cell(None if not base or v is None else v / base, ".2f") + "x" for v in values]
            lines.append(f"  {name}".ljust(label_w) + "".join(c.rjust(col_w) for c in ratios))
    lines.append("=" * width)
    return "\n".join(lines)


def _has_classes(runs: Sequence[BenchRun]) -> bool:
    return len({r.priority for run in runs for r in run.capture.results}) > 1


def _class_rows(priority: int) -> list[tuple[str, Callable[[BenchRun], Any], str]]:
    """Each priority class's own figures, from the run's requests of that class."""
    def of(run: BenchRun) -> list[RequestResult]:
        return [r for r in run.capture.results if r.priority == priority]

    def stat(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    def ttft(run: BenchRun, q: float) -> float | None:
        return stat([r.ttft_s * 1e3 for r in of(run) if r.ok and r.ttft_s is not None], q)

    def tpot(run: BenchRun, q: float) -> float | None:
        return stat([t * 1e3 for r in of(run) if (t := r.tpot_s) is not None], q)

    return [
        ("  requests (completed)", lambda run: f"{len(of(run))} ({sum(r.ok for r in of(run))})", ""),
        ("  TTFT p50 (ms)", lambda run: ttft(run, 50), ".0f"),
        ("  TTFT p99 (ms)", lambda run: ttft(run, 99), ".0f"),
        ("  TPOT p50 (ms)", lambda run: tpot(run, 50), ".1f"),
        ("  TPOT p99 (ms)", lambda run: tpot(run, 99), ".1f"),
    ]


def _differing_options(runs: Sequence[BenchRun]) -> list[str]:
    if len(runs) < 2:
        return []
    keys = sorted({k for r in runs for k in r.options})
    return [k for k in keys if len({json.dumps(r.options.get(k), default=str) for r in runs}) > 1]


def format_cell(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, Enum):
        return str(value.value)
    if spec == "d":
        return str(int(value))
    return format(value, spec) if spec and isinstance(value, (int, float)) else str(value)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


_COMMAND_LINE: list[str] | None = None


def record_command_line(argv: Sequence[str]) -> None:
    """The command a run file and a report name, when `inflight.cli.main` is called with one
    (from Python) rather than from the shell (`sys.argv`)."""
    global _COMMAND_LINE
    _COMMAND_LINE = list(argv)


def command_line() -> list[str]:
    return list(_COMMAND_LINE if _COMMAND_LINE is not None else sys.argv)
