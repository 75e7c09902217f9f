"""Search engine configurations in simulation for those that pass an SLA: every combination of
`max_num_tokens`, `max_batch_size` and chunked prefill on/off, each judged by the bench's own
SLA check; optionally, for the best of them, the highest Poisson request rate that still passes
(bisection)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.bench.capacity import find_max_rate
from inflight.bench.results import BenchRun
from inflight.bench.sla import SLA, CheckLine, check_run
from inflight.bench.workload import WorkloadSpec, with_request_rate
from inflight.sim.runs import SimTarget, simulate
from inflight.sim.workload import synthetic_requests


@dataclass(frozen=True)
class SearchSpace:
    """Engine options, and with `replicas` beyond (1,) the fleet's size and routing policy."""

    max_num_tokens: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    max_batch_size: tuple[int, ...] = (16, 32, 64, 128, 256)
    enable_chunked_prefill: tuple[bool, ...] = (True, False)
    replicas: tuple[int, ...] = (1,)
    routers: tuple[str, ...] = ("prefix",)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        fleets: list[dict[str, Any]] = [{"replicas": 1}] if self.replicas == (1,) else [
            {"replicas": n, "router": r} for n in self.replicas for r in (self.routers if n > 1 else self.routers[:1])]
        for fleet, tokens, batch, chunked in itertools.product(fleets, self.max_num_tokens, self.max_batch_size,
                                                               self.enable_chunked_prefill):
            options = {"max_num_tokens": tokens, "max_batch_size": batch, "enable_chunked_prefill": chunked}
            yield options if self.replicas == (1,) else {**fleet, **options}


@dataclass(slots=True)
class Candidate:
    overrides: dict[str, Any]  # the searched options
    run: BenchRun
    checks: list[CheckLine]
    max_rate: float | None = None  # req/s, when searched

    @property
    def passed(self) -> bool:
        return all(line.ok for line in self.checks)

    @property
    def label(self) -> str:
        o = self.overrides
        fleet = f"replicas={o['replicas']} " if "replicas" in o else ""
        if o.get("replicas", 1) > 1:
            fleet += f"router={o['router']} "
        return fleet + f"tokens={o['max_num_tokens']} batch={o['max_batch_size']} " + (
            "chunked" if o["enable_chunked_prefill"] else "whole-prompt")


class Tuner:
    def __init__(self, target: SimTarget, spec: WorkloadSpec, sla: SLA, base_options: dict[str, Any],
                 spec_dir: Path | None = None, max_concurrency: int | None = None) -> None:
        self.target = target
        self.spec = spec
        self.sla = sla
        self.base_options = base_options
        self.spec_dir = spec_dir
        self.max_concurrency = max_concurrency
        self.slo = sla.goodput.slo() if sla.goodput else None
        self.requests = synthetic_requests(spec, spec_dir)
        self.num_simulations = 0

    def evaluate(self, overrides: dict[str, Any], spec: WorkloadSpec | None = None,
                 label: str = "") -> tuple[BenchRun, list[CheckLine]]:
        requests = self.requests if spec is None else synthetic_requests(spec, self.spec_dir)
        run = simulate(self.target, {**self.base_options, **overrides}, requests, label or "tune",
                       self.max_concurrency, self.slo)
        self.num_simulations += 1
        return run, check_run(self.sla, run, self.spec.name)

    def admits_all(self, overrides: dict[str, Any]) -> bool:
        """Without chunked prefill a prompt longer than the step budget is rejected outright."""
        if overrides["enable_chunked_prefill"]:
            return True
        return max(r.prompt_len for r in self.requests) <= overrides["max_num_tokens"]

    def search(self, space: SearchSpace, progress: Callable[[str], None] | None = None) -> list[Candidate]:
        """Every configuration of the space that admits all the workload's prompts, simulated
        and checked; passing ones first, each group by output throughput, highest first (ties
        within 0.5% broken by TTFT p99, then TBT p99)."""
        results = []
        for overrides in space:
            if not self.admits_all(overrides):
                continue
            candidate = Candidate(overrides, *self.evaluate(overrides))
            candidate.run.label = candidate.label
            results.append(candidate)
            if progress:
                progress(f"{candidate.label}: {'pass' if candidate.passed else 'fail'}")
        return sorted(results, key=_rank)

    def max_rate(self, overrides: dict[str, Any], start: float, rel_tol: float = 0.05,
                 max_steps: int = 24) -> float | None:
        """The highest Poisson arrival rate at which the configuration passes (`bench.capacity`'s
        search, the one `inflight bench --find-max-rate` runs on a server): from `start`,
        doubling while it passes (or halving until it does), then bisecting on a log scale to
        `rel_tol`. None if it passes at no rate down to start / 256."""
        def measure(rate: float) -> tuple[BenchRun, list[CheckLine]]:
            return self.evaluate(overrides, with_request_rate(self.spec, rate))

        return find_max_rate(measure, start, rel_tol, max_trials=max_steps + 1).max_rate


def start_rate(spec: WorkloadSpec, candidate: Candidate) -> float:
    """The spec's own rate, or for a burst the rate the configuration served it at."""
    rate = getattr(spec.arrivals, "rate", None)
    return float(rate) if rate is not None else candidate.run.metrics.request_throughput


def _rank(c: Candidate) -> tuple[bool, float, float, float]:
    """Passing first; then output throughput, highest first, to 0.5% (below saturation every
    configuration serves the offered load); then TTFT p99 and TBT p99, lowest first."""
    m = c.run.metrics
    bucket = round(math.log(max(m.output_throughput, 1e-9)) / math.log(1.005))
    return (not c.passed, -bucket, m.ttft_ms.p99 or math.inf, m.tbt_ms.p99 or math.inf)


def add_max_rates(tuner: Tuner, passing: list[Candidate], top: int = 5,
                  progress: Callable[[str], None] | None = None) -> list[Candidate]:
    """Searches the highest passing rate of the first `top` passing configurations and puts
    them first, highest rate first."""
    for candidate in passing[:top]:
        candidate.max_rate = tuner.max_rate(candidate.overrides, start_rate(tuner.spec, candidate))
        if progress:
            progress(f"{candidate.label}: max rate {candidate.max_rate}")
    return sorted(passing[:top], key=lambda c: -(c.max_rate or 0.0)) + passing[top:]


def tune(tuner: Tuner, space: SearchSpace, find_max_rate: bool = False, top: int = 5,
         progress: Callable[[str], None] | None = None) -> list[Candidate]:
    """The passing configurations, best output throughput first; with `find_max_rate`, the
    best `top` of them also get their highest passing rate and come first, ordered by it."""
    passing = [c for c in tuner.search(space, progress) if c.passed]
    return add_max_rates(tuner, passing, top, progress) if find_max_rate else passing


def format_candidates(candidates: Sequence[Candidate], title: str) -> str:
    fleet = any("replicas" in c.overrides for c in candidates)
    header = (f"{'#':>3} " + (f"{'replicas':>8} {'router':>11} " if fleet else "")
              + f"{'max_num_tokens':>14} {'max_batch_size':>14} {'chunked':>8} {'out tok/s':>10} "
              f"{'TTFT p99 ms':>12} {'TBT p99 ms':>11} {'KV peak %':>9} {'preempt':>7} {'max req/s':>9}")
    lines = [title, header, "-" * len(header)]
    for i, c in enumerate(candidates, 1):
        m, o = c.run.metrics, c.overrides
        rate = "-" if c.max_rate is None else f"{c.max_rate:.3g}"
        where = f"{o.get('replicas', 1):>8} {o.get('router', '-') if o.get('replicas', 1) > 1 else '-':>11} "
        lines.append(f"{i:>3} " + (where if fleet else "") + f"{o['max_num_tokens']:>14} {o['max_batch_size']:>14} "
                     f"{'on' if o['enable_chunked_prefill'] else 'off':>8} {m.output_throughput:>10.1f} "
                     f"{_ms(m.ttft_ms.p99):>12} {_ms(m.tbt_ms.p99):>11} {_num(m.kv_peak_perc):>9} "
                     f"{_num(m.num_preemptions):>7} {rate:>9}")
    if not candidates:
        lines.append("  no configuration passes the SLA")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
