"""Capacity under an SLA: the highest Poisson arrival rate at which the same fixed traffic still
passes every SLA line, found by one search whatever runs the traffic: the simulator
(`inflight tune --max-rate`), an in-process engine or a remote server (`inflight bench
--find-max-rate`), so that a plan and a measurement can be laid side by side.

A trial fails one of two ways: on a ceiling (latency tails, KV watermark, failures), which a
lower rate relieves, or only on a floor (output throughput, goodput: `CheckLine.floor`), which a
lower rate cannot meet. The search doubles the rate while it passes or falls short of a floor,
halves it while a ceiling fails, then bisects on a log scale between the highest rate known to
pass (or to fall short) and the lowest known to break a ceiling, to a relative tolerance; every
trial is kept with the lines that limited it. An SLA whose floors need more load than its
ceilings allow passes at no rate, and the table shows both. The search is bounded by a number
of trials and, for real targets, a wall-clock budget.
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
    def too_low(self) -> bool:
        """Failed on floors only: a higher rate may pass."""
        failed = [line for line in self.checks if not line.ok]
        return bool(failed) and all(line.floor for line in failed)

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
    """The highest rate at which `measure(rate)`'s checks pass, from `start` (see the module's
    doc for the rule): at most `max_trials` runs; with `budget_s`, no new run starts once that
    many seconds have passed; rates below start / 256 are not tried. With `min_rate`, that rate
    is tried first (the SLA's floor: if a ceiling fails there, nothing above is tried)."""
    if start <= 0 or not math.isfinite(start):
        raise ValueError(f"the search needs a positive starting rate, not {start}")
    capacity = Capacity()
    began = time.perf_counter()
    low: float | None = None  # the highest rate known to fall short of a floor
    lo: float | None = None  # the highest rate known to pass
    hi: float | None = None  # the lowest rate known to break a ceiling

    def run(rate: float) -> bool:
        """Runs a trial and updates the bounds; False when the search's bounds stop it."""
        nonlocal low, lo, hi
        if len(capacity.trials) >= max_trials:
            capacity.stopped = f"stopped after {max_trials} trials"
            return False
        if budget_s is not None and time.perf_counter() - began >= budget_s:
            capacity.stopped = f"stopped at the time budget ({budget_s:g} s)"
            return False
        trial = Trial(rate, *measure(rate))
        capacity.trials.append(trial)
        if trial.passed:
            lo = max(lo or rate, rate)
        elif trial.too_low:
            low = max(low or rate, rate)
        else:
            hi = min(hi or rate, rate)
        if progress:
            verdict = "pass" if trial.passed else ("short of a floor" if trial.too_low else "FAIL") + \
                " (" + ", ".join(trial.limiting) + ")"
            progress(f"trial {len(capacity.trials)}: {rate:.4g} req/s -> {verdict}")
        return True

    if min_rate is not None:
        if not run(min_rate) or hi is not None:
            return _done(capacity, lo)
        start = max(start, min_rate * (2 if low is not None else 1))
    if start not in {t.rate for t in capacity.trials} and not run(start):
        return _done(capacity, lo)
    while True:
        below = lo if lo is not None else low
        if hi is None:
            assert below is not None
            rate = below * 2
        elif below is None:
            if hi / 2 < start / 256:
                break
            rate = hi / 2
        elif hi / below <= 1 + rel_tol:
            break
        else:
            rate = math.sqrt(below * hi)
        if not run(rate):
            break
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
