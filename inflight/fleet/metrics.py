"""The fleet's `/metrics`: every replica's `inflight:*` series, each with a `replica` label.

Replicas hand their Prometheus text to a `MetricsBoard` (a small Ray actor) whenever Ray Serve
asks them for routing stats, about once a second; the ingress reads the board and relabels.
A replica that stops reporting (it died, or was scaled down) drops out after `max_age_s`.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from inflight.engine.stats import METRIC_PREFIX as PREFIX


class MetricsBoard:
    """The latest Prometheus text of each replica (a Ray actor: `ray.remote(MetricsBoard)`)."""

    def __init__(self, max_age_s: float = 15.0) -> None:
        self.max_age_s = max_age_s
        self._reports: dict[str, tuple[float, bytes, dict[str, str]]] = {}

    def report(self, replica: str, text: bytes, where: dict[str, str] | None = None) -> None:
        """`where`: labels that place the replica (its process id and node)."""
        self._reports[replica] = (time.monotonic(), text, dict(where or {}))

    def collect(self) -> dict[str, tuple[bytes, dict[str, str]]]:
        now = time.monotonic()
        self._reports = {r: rep for r, rep in self._reports.items() if now - rep[0] <= self.max_age_s}
        return {r: (text, where) for r, (_, text, where) in self._reports.items()}


class _Relabelled(Collector):
    def __init__(self, texts: dict[str, bytes], extra: list[Metric]) -> None:
        self._texts, self._extra = texts, extra

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self._texts.items()):
            for family in text_string_to_metric_families(text.decode("utf-8", errors="replace")):
                if not family.name.startswith(PREFIX):
                    continue
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                      sample.timestamp, sample.exemplar)
        return [*families.values(), *self._extra]


def merge(reports: dict[str, tuple[bytes, dict[str, str]]]) -> bytes:
    """One exposition of every replica's series, labelled `replica="<id>"`, and two of the
    fleet's own: how many replicas report, and where each runs (`inflight:replica_info`)."""
    info = GaugeMetricFamily(PREFIX + "replica_info", "One per reporting replica: where it runs.",
                             labels=["replica", "pid", "node"])
    for replica, (_, where) in sorted(reports.items()):
        info.add_metric([replica, where.get("pid", ""), where.get("node", "")], 1.0)
    count = GaugeMetricFamily(PREFIX + "fleet_replicas_reporting", "Engine replicas whose metrics are shown here.",
                              value=len(reports))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Relabelled({r: text for r, (text, _) in reports.items()}, [count, info]))
    return generate_latest(registry)
