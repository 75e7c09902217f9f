"""Fitting a hardware profile to timed engine steps: least squares on relative error over the
cost model's terms, for each roofline form and small-batch regime, keeping the best."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from inflight.config import ModelConfig
from inflight.sim.cost_model import CostModel, SeqWork
from inflight.sim.hardware import HardwareProfile


class Sample(NamedTuple):
    batch: tuple[SeqWork, ...]
    duration_s: float  # the whole step, as `LLMEngine.step()` took it
    forward_s: float  # of which the model's forward pass


_EFFICIENCIES = ("flops_efficiency", "bandwidth_efficiency", "attention_flops_efficiency",
                 "attention_bandwidth_efficiency")


class FitResult(NamedTuple):
    profile: HardwareProfile
    predicted_s: np.ndarray
    measured_s: np.ndarray
    outliers: np.ndarray  # bool per sample: left out of the final fit
    errors_by_roofline: dict[str, float]  # mean relative error (%) of each form's best fit


def _design(samples: Sequence[Sample], cm: CostModel) -> np.ndarray:
    """Per sample, the forward pass's time terms at efficiency 1: linear FLOPs, weight bytes,
    attention FLOPs, KV bytes, each over its peak; the extra rows of a small-batch step and
    whether the step runs GEMMs (only fitted where single-row steps are in the data).
    Under the `max` roofline only the side that binds (under `cm`'s current factors) is kept;
    under `sum` both are."""
    hw = cm.hardware
    peak, bw = hw.peak_flops, hw.memory_bandwidth
    both = hw.roofline == "sum"
    rows = []
    for sample in samples:
        w = cm.work(sample.batch)
        compute = w.linear_flops / (peak * hw.flops_efficiency) >= w.linear_bytes / (bw * hw.bandwidth_efficiency)
        attn_f = attn_b = 0.0
        for f, b in w.attention:
            bound = f / (peak * hw.attention_flops_efficiency) >= b / (bw * hw.attention_bandwidth_efficiency)
            attn_f += f if both or bound else 0.0
            attn_b += b if both or not bound else 0.0
        small = w.num_tokens - 1 if 2 <= w.num_tokens <= hw.small_batch_max_rows else 0
        gemm = 1.0 if w.num_tokens >= 2 and not small else 0.0
        rows.append([w.linear_flops / peak if both or compute else 0.0,
                     w.linear_bytes / bw if both or not compute else 0.0, attn_f / peak, attn_b / bw,
                     small, gemm])
    return np.array(rows)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, fallback: np.ndarray, relative: bool) -> np.ndarray:
    """Least squares (in relative error if `relative`) with no coefficient below zero: a column
    with no data, or whose coefficient comes out <= 0, leaves the solve and takes its `fallback`.
    For a time term (seconds per row, per step) the fallback is 0: a term the data does not ask
    for is absent, and a term that is truly absent solves to a rounding error of either sign, so
    keeping any other value there would let the last bit of a sum decide the fit."""
    coef = fallback.copy()
    free = [j for j in range(x.shape[1]) if np.any(x[:, j] > 0)]
    weights = 1.0 / y if relative else np.ones_like(y)
    while free:
        fixed = [j for j in range(x.shape[1]) if j not in free]
        rhs = (y - x[:, fixed] @ coef[fixed]) * weights
        sol, *_ = np.linalg.lstsq(x[:, free] * weights[:, None], rhs, rcond=None)
        bad = [j for j, c in zip(free, sol, strict=True) if c <= 0]
        if not bad:
            coef[free] = sol
            break
        for j in bad:
            free.remove(j)
    return coef


def _fit_forward(samples: Sequence[Sample], shapes: ModelConfig, profile: HardwareProfile,
                 dtype: str | None, max_iterations: int = 30) -> HardwareProfile:
    """The four efficiency factors and the small-batch terms from the forward-pass times.
    Under `max`, which side of each roofline binds depends on the factors: classify, solve,
    until the classes stop changing. An efficiency the data says nothing about keeps `profile`'s
    (its inverse cannot be 0); a time term keeps 0."""
    y = np.array([s.forward_s for s in samples])
    for _ in range(max_iterations):
        x = _design(samples, CostModel(shapes, profile, dtype=dtype))
        fallback = np.array([*(1 / getattr(profile, k) for k in _EFFICIENCIES), 0.0, 0.0])
        coef = _nonnegative_lstsq(x, y, fallback, relative=True)
        fitted: dict[str, Any] = {k: float(1 / c) for k, c in zip(_EFFICIENCIES, coef, strict=False)}
        new = dataclasses.replace(profile, **fitted, small_batch_row_s=float(coef[4]), gemm_step_s=float(coef[5]))
        if np.array_equal(_design(samples, CostModel(shapes, new, dtype=dtype)) > 0, x > 0):
            return new
        profile = new
    return profile


def _fit_overheads(samples: Sequence[Sample], profile: HardwareProfile) -> HardwareProfile:
    """Step and per-request overheads from the time of each step outside the forward pass."""
    y = np.array([s.duration_s - s.forward_s for s in samples])
    x = np.array([[1.0, len(s.batch)] for s in samples])
    coef = _nonnegative_lstsq(x, np.maximum(y, 1e-9), np.zeros(2), relative=False)
    return dataclasses.replace(profile, step_overhead_s=float(coef[0]), request_overhead_s=float(coef[1]))


def fit_profile(samples: Sequence[Sample], shapes: ModelConfig, base: HardwareProfile,
                dtype: str | None = None, rooflines: Sequence[str] = ("max", "sum"),
                small_batch_rows: Sequence[int] = (1, 2, 3, 4, 6, 8),
                outlier_factor: float = 4.0) -> FitResult:
    """Fits the efficiency factors of `base` to the forward-pass times and its overheads to the
    rest of each step, for each roofline form and small-batch regime, and keeps the one with
    the smallest mean relative error. Samples whose error exceeds `outlier_factor` times the
    median (steps stalled by other work on the machine) are then left out and the fit runs
    again, once."""
    y = np.array([s.duration_s for s in samples])
    keep = np.ones(len(samples), dtype=bool)
    for _ in range(2):
        kept = [s for s, k in zip(samples, keep, strict=True) if k]
        fits = []
        for form in rooflines:
            for rows in small_batch_rows:
                start = dataclasses.replace(base, roofline=form, small_batch_max_rows=rows)
                profile = _fit_overheads(kept, _fit_forward(kept, shapes, start, dtype))
                rel = np.abs(predict(samples, CostModel(shapes, profile, dtype=dtype)) - y) / y
                fits.append((float(np.mean(rel[keep])), profile, rel))
        _, profile, rel = _simplest_of_the_best(fits)
        new_keep = rel <= max(outlier_factor * float(np.median(rel[keep])), 0.05)
        if np.array_equal(new_keep, keep):
            break
        keep = new_keep
    errors = {form: round(100 * min(e for e, p, _ in fits if p.roofline == form), 2) for form in rooflines}
    return FitResult(profile, predict(samples, CostModel(shapes, profile, dtype=dtype)), y, ~keep, errors)


def _simplest_of_the_best(fits: list[tuple[float, HardwareProfile, np.ndarray]]
                          ) -> tuple[float, HardwareProfile, np.ndarray]:
    """The fit with the smallest mean error, except that a simpler one within rounding of it wins:
    on exact data, a regime of more small-batch rows whose extra term solves to 0 fits exactly as
    well as the regime without them, and which of the two came out ahead would depend on the last
    bits of this machine's BLAS. `fits` is in order of preference among equals (roofline form as
    given, then fewer small-batch rows)."""
    best = min(error for error, _, _ in fits)
    tie = best + 1e-9 + 1e-6 * best
    return min((f for f in fits if f[0] <= tie), key=lambda f: f[1].small_batch_max_rows)


def predict(samples: Sequence[Sample], cm: CostModel) -> np.ndarray:
    return np.array([cm.step_time(s.batch) for s in samples])


def _kind(sample: Sample) -> str:
    decodes = [w for w in sample.batch if w.num_new_tokens == 1]
    chunks = [w for w in sample.batch if w.num_new_tokens > 1]
    context = max(w.context_len for w in sample.batch)
    bucket = next(b for b in (128, 768, 2048, 1 << 30) if context <= b)
    if not chunks:
        return f"decode x{len(decodes):<3} context <= {bucket}"
    tokens = sum(w.num_new_tokens for w in chunks)
    start = max(w.context_len - w.num_new_tokens for w in chunks)
    what = f"prefill {tokens} at {start}" if len(chunks) == 1 else f"prefill {tokens} ({len(chunks)} chunks)"
    return what + (f" + decode x{len(decodes)}" if decodes else "")


def format_fit(result: FitResult, samples: Sequence[Sample]) -> str:
    """The fitted factors and, per kind of step, measured against predicted mean time."""
    p = result.profile
    small = (f"{p.small_batch_row_s * 1e3:.1f} ms per extra row up to {p.small_batch_max_rows} rows, "
             if p.small_batch_max_rows > 1 else "") + f"{p.gemm_step_s * 1e3:.1f} ms per GEMM step"
    lines = [f"profile {p.name} ({p.roofline} roofline; mean error of each form: {result.errors_by_roofline} %)",
             f"  linear: {p.flops_efficiency:.3f} of {p.peak_flops / 1e9:.0f} GFLOP/s, "
             f"{p.bandwidth_efficiency:.3f} of {p.memory_bandwidth / 1e9:.0f} GB/s",
             f"  attention: {p.attention_flops_efficiency:.3f} of peak FLOP/s, "
             f"{p.attention_bandwidth_efficiency:.3f} of peak bandwidth",
             f"  overhead: {p.step_overhead_s * 1e3:.2f} ms per step + {p.request_overhead_s * 1e6:.1f} us per request",
             f"  small-batch matmuls: {small}",
             f"  {len(samples)} steps, {int(result.outliers.sum())} left out as outliers",
             f"{'kind of step':<40}{'steps':>6}{'measured ms':>13}{'predicted ms':>14}{'error':>8}"]
    groups: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(_kind(sample), []).append(i)
    for kind, idx in sorted(groups.items(), key=lambda g: float(np.mean(result.measured_s[g[1]]))):
        measured, predicted = float(np.mean(result.measured_s[idx])), float(np.mean(result.predicted_s[idx]))
        lines.append(f"{kind:<40}{len(idx):>6}{measured * 1e3:>13.1f}{predicted * 1e3:>14.1f}"
                     f"{100 * (predicted - measured) / measured:>+7.1f}%")
    return "\n".join(lines)
