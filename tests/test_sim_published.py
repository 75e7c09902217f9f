"""The published points the simulator is held to (benchmarks/sim/published/points.yaml): every
point names a known source, model, hardware, engine profile and workload file, and its target
builds; the cheapest points (one request) run through the same code as the table's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from inflight.perf.profiles import BUILTIN_ENGINES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "sim"))
import published  # noqa: E402

DATA = yaml.safe_load((published.HERE / "points.yaml").read_text(encoding="utf-8"))
POINTS: list[dict[str, Any]] = DATA["points"]


def test_every_point_is_complete_and_its_target_builds() -> None:
    ids = [p["id"] for p in POINTS]
    assert len(ids) == len(set(ids)) >= 10
    for point in POINTS:
        assert point["source"] in DATA["sources"], point["id"]
        assert point["engine"] in BUILTIN_ENGINES and point["role"] in ("fit", "check"), point["id"]
        assert (published.HERE / f"{point['workload']}.yaml").is_file(), point["id"]
        assert point["published"] > 0
        options = published.point_options(point, DATA["defaults"])
        assert isinstance(options, dict)
    # The table spans what the issue asks of it.
    assert {p.get("tp", 1) > 1 for p in POINTS} == {True, False}
    assert {"fp8" in (p.get("weights"), p.get("kv")) for p in POINTS} == {True, False}
    assert {"request_rate" in p for p in POINTS} == {True, False}
    assert sum(p["role"] == "check" and not p.get("approx") for p in POINTS) >= 10


@pytest.mark.parametrize("point", [p for p in POINTS if p["num_requests"] == 1], ids=lambda p: p["id"])
def test_one_request_points_run_and_give_their_command(point: dict[str, Any]) -> None:
    value, command = published.predict(point, DATA["defaults"], 1.0, {})
    assert value is not None and value > 0
    assert command[:2] == ["inflight", "sim"] and point["model"] in command and point["engine"] in command
