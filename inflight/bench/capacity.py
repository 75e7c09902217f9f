"""Capacity under an SLA: the highest Poisson arrival rate at which the same fixed traffic still
passes every SLA line, found by one search whatever runs the traffic: the simulator
(`inflight tune --max-rate`), an in-process engine or a remote server (`inflight bench
--find-max-rate`), so that a plan and a measurement can be laid side by side.

The search doubles the rate while it passes (or halves it until it does), then bisects on a log
scale to a relative tolerance; every trial is kept with the SLA line that limited it. It is
bounded by a number of trials and, for real targets, a wall-clock budget. It assumes passing is
monotone in the rate near the edge (a throughput floor in the SLA makes low rates fail too: the
table shows it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inflight.bench.metrics import RequestSLO
from inflight.bench.results import BenchRun
from inflight.bench.sla import CheckLine


@dataclass(slots=True)
class Trial:
    """One run of the traffic at `rate` requests per second, and its SLA check."""

    rate: float
    run: BenchRun
    checks: list[CheckLine]

    @property
    def passed(self) -> bool:
        return all(line.ok for line in self.checks)

    @property
    def limiting(self) -> list[str]:
        """The SLA lines that failed."""
        return [line.name for line in self.checks if not line.ok]

    def attainment(self, slo: RequestSLO | None) -> float | None:
        """The share of requests that met the per-request goodput limits."""
        results = self.run.capture.results
        if slo is None or not results:
            return None
        return sum(slo.is_met(r) for r in results) / len(results)


@dataclass(slots=True)
class Capacity:
    """The trials in the order run and the highest passing rate (None: none passed)."""

    trials: list[Trial] = field(default_factory=list)
    max_rate: float | None = None
    stopped: str | None = None  # why the search ended before its tolerance, if it did

    def passes(self, rate: float) -> bool | None:
        """Whether the search showed `rate` to pass: a passing trial at or above it, or a
        failing one at or below it; None if neither."""
        if any(t.passed and t.rate >= rate for t in self.trials):
            return True
        if any(not t.passed and t.rate <= rate for t in self.trials):
            return False
        return None


Measure = Callable[[float], tuple[BenchRun, list[CheckLine]]]


def find_max_rate(measure: Measure, start: float, rel_tol: float = 0.05, max_trials: int = 24,
                  budget_s: float | None = None, min_rate: float | None = None,
                  progress: Callable[[str], None] | None = None) -> Capacity:
    """The highest rate at which `measure(rate)`'s checks pass, from `start`: doubling while it
    passes (or halving until it does, down to start / 256), then bisecting on a log scale until
    the passing and failing rates are within `rel_tol`. At most `max_trials` runs; with
    `budget_s`, no new run starts once that many seconds have passed. With `min_rate`, that rate
    is tried first (the SLA's floor: if it fails, nothing above is tried)."""
    if start <= 0 or not math.isfinite(start):
        raise ValueError(f"the search needs a positive starting rate, not {start}")
    capacity = Capacity()
    began = time.perf_counter()

    def passes(rate: float) -> bool | None:
        """None when the search's bounds stop it before this trial."""
        if len(capacity.trials) >= max_trials:
            capacity.stopped = f"stopped after {max_trials} trials"
            return None
        if budget_s is not None and time.perf_counter() - began >= budget_s:
            capacity.stopped = f"stopped at the time budget ({budget_s:g} s)"
            return None
        trial = Trial(rate, *measure(rate))
        capacity.trials.append(trial)
        if progress:
            verdict = "pass" if trial.passed else "FAIL (" + ", ".join(trial.limiting) + ")"
            progress(f"trial {len(capacity.trials)}: {rate:.4g} req/s -> {verdict}")
        return trial.passed

    lo: float | None = None
    hi: float | None = None
    if min_rate is not None:
        first = passes(min_rate)
        if not first:
            return capacity
        lo, start = min_rate, max(start, min_rate)
    if lo is None or start > lo:
        verdict = passes(start)
        if verdict is None:
            return _done(capacity, lo)
        lo, hi = (start, None) if verdict else (lo, start)
    while True:
        if hi is None:
            assert lo is not None
            verdict = passes(lo * 2)
            if verdict is None:
                break
            lo, hi = (lo * 2, None) if verdict else (lo, lo * 2)
        elif lo is None:
            if hi < start / 256:
                break
            verdict = passes(hi / 2)
            if verdict is None:
                break
            lo, hi = (hi / 2, hi) if verdict else (None, hi / 2)
        elif hi / lo <= 1 + rel_tol:
            break
        else:
            mid = math.sqrt(lo * hi)
            verdict = passes(mid)
            if verdict is None:
                break
            lo, hi = (mid, hi) if verdict else (lo, mid)
    return _done(capacity, lo)


def _done(capacity: Capacity, lo: float | None) -> Capacity:
    capacity.max_rate = lo
    return capacity


def format_capacity(capacity: Capacity, slo: RequestSLO | None, title: str) -> str:
    """The trials by rate: throughput, latency tails, KV peak, goodput, attainment, verdict and
    the lines that limited it."""
    header = (f"{'req/s':>8} {'out tok/s':>10} {'TTFT p99 ms':>12} {'TBT p99 ms':>11} {'KV peak %':>9} "
              f"{'goodput':>8} {'attain':>7}  result  limited by")
    lines = [title, header, "-" * len(header)]
    for t in sorted(capacity.trials, key=lambda t: t.rate):
        m = t.run.metrics
        attainment = t.attainment(slo)
        lines.append(
            f"{t.rate:>8.4g} {m.output_throughput:>10.1f} {_num(m.ttft_ms.p99, 1):>12} {_num(m.tbt_ms.p99, 1):>11} "
            f"{_num(m.kv_peak_perc, 0):>9} {_num(m.goodput, 3):>8} "
            f"{'-' if attainment is None else f'{100 * attainment:.0f}%':>7}  {'PASS' if t.passed else 'FAIL':<6}  "
            f"{', '.join(t.limiting) or '-'}")
    best = "none passed" if capacity.max_rate is None else f"{capacity.max_rate:.4g} req/s"
    lines.append(f"highest passing rate: {best}" + (f" ({capacity.stopped})" if capacity.stopped else ""))
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
