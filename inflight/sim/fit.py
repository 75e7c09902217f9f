"""Fitting an engine profile to timed engine steps on known hardware: least squares on relative
error over the cost model's terms, for each roofline form and small-batch regime, keeping the
best."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from inflight.config import MatmulStorage, ModelConfig
from inflight.perf.cost_model import CostModel, SeqWork, combine
from inflight.perf.profiles import EngineProfile, HardwareProfile


class Sample(NamedTuple):
    batch: tuple[SeqWork, ...]
    duration_s: float  # the whole step, as `LLMEngine.step()` took it
    forward_s: float  # of which the model's forward pass (the device's work)
    shapes: ModelConfig | None = None  # the model it ran; None: the fit's
    tp: int = 1
    # How its matmul weights were stored (`MatmulStorage`), where it ran another copy of the fit's
    # model (the same shapes, other types); None: the fit's model's storage, or of `shapes`' model none.
    storage: MatmulStorage | None = None


_EFFICIENCIES = ("flops_efficiency", "bandwidth_efficiency", "attention_flops_efficiency",
                 "attention_bandwidth_efficiency")
# The forward pass's time terms, in the order of `_design`'s columns: an efficiency's column
# holds work over the peak (its coefficient is 1 / efficiency), a time term's a count.
_TERMS = (*_EFFICIENCIES, "small_batch_row_s", "gemm_step_s", "block_decode_s", "block_decode_rows_s",
          "layer_overhead_s", "graph_layer_overhead_s", "allreduce_latency_s", "allreduce_peer_latency_s",
          "allreduce_bandwidth_efficiency")
_INVERSE = {*_EFFICIENCIES, "allreduce_bandwidth_efficiency"}


class FitResult(NamedTuple):
    profile: EngineProfile
    predicted_s: np.ndarray
    measured_s: np.ndarray
    outliers: np.ndarray  # bool per sample: left out of the final fit
    errors_by_roofline: dict[str, float]  # mean relative error (%) of each form's best fit
    hardware: HardwareProfile


class _Models:
    """One cost model per (shapes, tp) among the samples, on the profiles being fitted."""

    def __init__(self, shapes: ModelConfig, hardware: HardwareProfile, dtype: str | None,
                 weight_dtype: str | None = None, matmul_storage: MatmulStorage | None = None,
                 samples: Sequence[Sample] = ()) -> None:
        self.shapes, self.hardware, self.dtype, self.weight_dtype = shapes, hardware, dtype, weight_dtype
        self.matmul_storage = matmul_storage  # of `shapes`' checkpoint; other samples' models in the compute type
        self._cache: dict[tuple[int, int, MatmulStorage | None, EngineProfile], CostModel] = {}
        # Whether the samples' blocks' decoding can be told from their bytes (`separates_decoding`).
        self.decoding_known = self.separates_decoding(samples)

    def storage(self, sample: Sample) -> MatmulStorage | None:
        return sample.storage or (self.matmul_storage if sample.shapes is None else None)

    def separates_decoding(self, samples: Sequence[Sample]) -> bool:
        """Whether `samples` ran blocks kept at two sizes a parameter, and of two widths
        (`calibrate`'s copies of its model, in BF16 and twice as wide). Else a step's bytes, its
        blocks' decoding and its layers' fixed cost are too nearly all a fixed cost per step, and
        the decoding is left out of the fit (`block_decode_s` 0: the bandwidth and the per-layer
        cost price it)."""
        kept = [(s.shapes or self.shapes, storage) for s in samples
                if (storage := self.storage(s)) is not None and storage.dense_kept]
        return (len({storage.dense for _, storage in kept}) > 1
                and len({(shapes.hidden_size, shapes.intermediate_size) for shapes, _ in kept}) > 1)

    def of(self, sample: Sample, engine: EngineProfile) -> CostModel:
        storage = self.storage(sample)
        key = (id(sample.shapes), sample.tp, storage, engine)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = CostModel(sample.shapes or self.shapes, self.hardware, sample.tp, self.dtype, engine,
                                         self.weight_dtype, matmul_storage=storage)
        return self._cache[key]


def _design(samples: Sequence[Sample], models: _Models, engine: EngineProfile) -> np.ndarray:
    """Per sample, the forward pass's terms at efficiency 1 (see `_TERMS`). Under `max` only the
    side of each roofline that binds (under `engine`'s current factors) is kept; under `sum`
    both are; under `smooth` both, weighted as `_sides` says."""
    hw = models.hardware
    peak, bw = hw.peak_flops, hw.memory_bandwidth
    rows = []
    for sample in samples:
        cm = models.of(sample, engine)
        w = cm.work(sample.batch)
        # The blocks' decoding, one column in a step of one token (its matmuls a vector's), one in
        # a step of more; on the compute side of the matmuls' roofline.
        kept = w.kept_params if models.decoding_known else 0.0
        decode = (kept * (w.num_tokens == 1), kept * (w.num_tokens > 1))
        lin_c, lin_m, core = _sides(w.linear_compute_s, cm.linear_flops_efficiency,
                                    w.linear_bytes / bw, engine.bandwidth_efficiency, engine,
                                    decode[0] * engine.block_decode_s + decode[1] * engine.block_decode_rows_s)
        attn_f = attn_b = 0.0
        for f, b in w.attention:
            c, m, _ = _sides(f / peak, engine.attention_flops_efficiency, b / bw,
                             engine.attention_bandwidth_efficiency, engine)
            attn_f, attn_b = attn_f + c, attn_b + m
        small = w.num_tokens - 1 if 2 <= w.num_tokens <= engine.small_batch_max_rows else 0
        gemm = 1.0 if w.num_tokens >= 2 and not small else 0.0
        link = hw.interconnect_bandwidth or 1.0
        rows.append([lin_c, lin_m, attn_f, attn_b, small, gemm, decode[0] * core, decode[1] * core,
                     0.0 if w.graphed else w.num_layers, w.num_layers if w.graphed else 0.0,
                     w.num_allreduces, w.num_allreduces * (cm.tp - 1), w.allreduce_bytes / link])
    return np.array(rows)


def _sides(compute: float, compute_eff: float, memory: float, memory_eff: float,
           engine: EngineProfile, extra: float = 0.0) -> tuple[float, float, float]:
    """The design's two entries for one roofline, at efficiency 1, and the weight of terms that
    join its compute side (`extra`: their seconds at the current factors, a step's decoding of
    blocks). The smooth max `T(c, m)` is homogeneous of degree 1, so `T = c * dT/dc + m * dT/dm`
    (Euler): each side enters weighted by its partial derivative at the current factors,
    `(side / T) ** (k - 1)`. At the right factors that is exact, and both efficiencies stay in
    the solve."""
    if engine.roofline == "sum":
        return compute, memory, 1.0
    c, m = compute / compute_eff + extra, memory / memory_eff
    if engine.roofline == "max" or max(c, m) <= 0:
        return (compute, 0.0, 1.0) if c >= m else (0.0, memory, 0.0)
    total, k = combine(c, m, engine), engine.roofline_exponent
    weight = (c / total) ** (k - 1)
    return compute * weight, memory * (m / total) ** (k - 1), weight


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


def _fit_forward(samples: Sequence[Sample], models: _Models, profile: EngineProfile,
                 max_iterations: int = 300) -> EngineProfile:
    """The efficiency factors and the time terms from the forward-pass times. Under `max`, which
    side of each roofline binds depends on the factors, and under `smooth` so does the factor
    over it: classify, solve, until the classes and the factors stop changing. An efficiency
    the data says nothing about keeps `profile`'s (its inverse cannot be 0); a time term keeps 0."""
    y = np.array([s.forward_s for s in samples])
    for _ in range(max_iterations):
        x = _design(samples, models, profile)
        fallback = np.array([1 / getattr(profile, k) if k in _INVERSE else 0.0 for k in _TERMS])
        coef = _nonnegative_lstsq(x, y, fallback, relative=True)
        fitted: dict[str, Any] = {k: float(1 / c if k in _INVERSE else c) for k, c in zip(_TERMS, coef, strict=True)}
        new = dataclasses.replace(profile, **fitted)
        x_new = _design(samples, models, new)
        if np.array_equal(x_new > 0, x > 0) and (profile.roofline != "smooth" or np.allclose(x_new, x, rtol=1e-14)):
            return new
        profile = new
    return profile


def _fit_overheads(samples: Sequence[Sample], profile: EngineProfile) -> EngineProfile:
    """Step and per-request overheads from the time of each step outside the forward pass."""
    y = np.array([s.duration_s - s.forward_s for s in samples])
    x = np.array([[1.0, len(s.batch)] for s in samples])
    coef = _nonnegative_lstsq(x, np.maximum(y, 1e-9), np.zeros(2), relative=False)
    return dataclasses.replace(profile, step_overhead_s=float(coef[0]), request_overhead_s=float(coef[1]))


def fit_profile(samples: Sequence[Sample], shapes: ModelConfig, hardware: HardwareProfile, base: EngineProfile,
                dtype: str | None = None, rooflines: Sequence[str] = ("max", "sum", "smooth"),
                exponents: Sequence[float] = (2.0, 4.0), small_batch_rows: Sequence[int] = (1, 2, 3, 4, 6, 8),
                outlier_factor: float = 4.0, weight_dtype: str | None = None,
                matmul_storage: MatmulStorage | None = None) -> FitResult:
    """Fits the efficiency factors and time terms of `base` to the forward-pass times and its
    overheads to the rest of each step, for each roofline form (the smooth one at each of
    `exponents`) and small-batch regime, and keeps the one with the smallest mean relative
    error. Samples whose error exceeds `outlier_factor` times the median (steps stalled by
    other work on the machine) are then left out and the fit runs again, once. Samples may
    come from several models and TP degrees (`Sample.shapes`, `Sample.tp`), which is what
    separates a per-layer cost from a per-step one. `weight_dtype` int8: the steps of an engine
    with int8 matmuls, whose efficiency is then of the hardware's int8 peak (`base` must have no
    `eight_bit_flops_efficiency`: the fit's `flops_efficiency` stands for it). `matmul_storage`:
    the weight reads of `shapes`' checkpoint as its engine made them (`LoadedModel.matmul_storage`)."""
    base = dataclasses.replace(base, as_stored={}, fitted_storage={})  # one set of factors, the one fitted
    models = _Models(shapes, hardware, dtype, weight_dtype, matmul_storage, samples)
    y = np.array([s.duration_s for s in samples])
    keep = np.ones(len(samples), dtype=bool)
    forms = [(form, k) for form in rooflines for k in (exponents if form == "smooth" else (base.roofline_exponent,))]
    for _ in range(2):
        kept = [s for s, k in zip(samples, keep, strict=True) if k]
        fits = []
        for form, exponent in forms:
            for rows in small_batch_rows:
                start = dataclasses.replace(base, roofline=form, roofline_exponent=exponent,
                                            small_batch_max_rows=rows)
                profile = _fit_overheads(kept, _fit_forward(kept, models, start))
                rel = np.abs(predict(samples, models, profile) - y) / y
                fits.append((float(np.mean(rel[keep])), profile, rel))
        _, profile, rel = _simplest_of_the_best(fits)
        new_keep = rel <= max(outlier_factor * float(np.median(rel[keep])), 0.05)
        if np.array_equal(new_keep, keep):
            break
        keep = new_keep
    errors = {form: round(100 * min(e for e, p, _ in fits if p.roofline == form), 2) for form in rooflines}
    return FitResult(profile, predict(samples, models, profile), y, ~keep, errors, hardware)


def _simplest_of_the_best(fits: list[tuple[float, EngineProfile, np.ndarray]]
                          ) -> tuple[float, EngineProfile, np.ndarray]:
    """The fit with the smallest mean error, except that a simpler one within rounding of it wins:
    on exact data, a regime of more small-batch rows whose extra term solves to 0 fits exactly as
    well as the regime without them, and which of the two came out ahead would depend on the last
    bits of this machine's BLAS. `fits` is in order of preference among equals (roofline form as
    given, then fewer small-batch rows)."""
    best = min(error for error, _, _ in fits)
    tie = best + 1e-9 + 1e-6 * best
    return min((f for f in fits if f[0] <= tie), key=lambda f: f[1].small_batch_max_rows)


def predict(samples: Sequence[Sample], models: _Models | CostModel, engine: EngineProfile | None = None
            ) -> np.ndarray:
    """Each sample's predicted step time: by one cost model, or per sample's model and TP."""
    if isinstance(models, CostModel):
        return np.array([models.step_time(s.batch) for s in samples])
    assert engine is not None
    return np.array([models.of(s, engine).step_time(s.batch) for s in samples])


def _kind(sample: Sample) -> str:
    decodes = [w for w in sample.batch if w.num_new_tokens == 1]
    chunks = [w for w in sample.batch if w.num_new_tokens > 1]
    context = max(w.context_len for w in sample.batch)
    bucket = next(b for b in (128, 768, 2048, 1 << 30) if context <= b)
    copy = ""  # or a copy of the model in another storage type or width (`calibrate`'s)
    if sample.storage is not None:
        width = f"{sample.shapes.hidden_size} wide, " if sample.shapes is not None else ""
        copy = f" [copy: {width}{sample.storage.dense:.3g} B]"
    if not chunks:
        return f"decode x{len(decodes):<3} context <= {bucket}{copy}"
    tokens = sum(w.num_new_tokens for w in chunks)
    start = max(w.context_len - w.num_new_tokens for w in chunks)
    what = f"prefill {tokens} at {start}" if len(chunks) == 1 else f"prefill {tokens} ({len(chunks)} chunks)"
    return what + (f" + decode x{len(decodes)}" if decodes else "") + copy


def format_fit(result: FitResult, samples: Sequence[Sample], int8: bool = False) -> str:
    """The fitted factors and, per kind of step, measured against predicted mean time (`int8`: of
    an engine with int8 matmuls, their efficiency of the int8 peak)."""
    p, hw = result.profile, result.hardware
    form = f"smooth (exponent {p.roofline_exponent:g})" if p.roofline == "smooth" else p.roofline
    small = (f"{p.small_batch_row_s * 1e3:.1f} ms per extra row up to {p.small_batch_max_rows} rows, "
             if p.small_batch_max_rows > 1 else "") + f"{p.gemm_step_s * 1e3:.1f} ms per GEMM step"
    peak = f"{hw.peak_flops_int8 / 1e9:.0f} int8 GOP/s (nominal)" if int8 else f"{hw.peak_flops / 1e9:.0f} GFLOP/s"
    lines = [f"engine profile {p.name}{' with int8 matmuls' if int8 else ''} on {hw.name} ({form} roofline; "
             f"mean error of each form: {result.errors_by_roofline} %)",
             f"  linear: {p.flops_efficiency:.3f} of {peak}, "
             f"{p.bandwidth_efficiency:.3f} of {hw.memory_bandwidth / 1e9:.0f} GB/s",
             f"  attention: {p.attention_flops_efficiency:.3f} of peak FLOP/s, "
             f"{p.attention_bandwidth_efficiency:.3f} of peak bandwidth",
             f"  overhead: {p.step_overhead_s * 1e3:.2f} ms per step + {p.request_overhead_s * 1e6:.1f} us per request",
             f"  small-batch matmuls: {small}",
             *([f"  stored blocks: {p.block_decode_s * 1e12:.1f} ps per Q4_1 parameter a step of one token decodes, "
                f"{p.block_decode_rows_s * 1e12:.1f} ps in a step of more"]
               if p.weights_as_stored else []),
             f"  per layer: {p.layer_overhead_s * 1e6:.1f} us, "
             f"{p.graph_layer_overhead_s * 1e6:.1f} us from a CUDA graph",
             f"  {len(samples)} steps, {int(result.outliers.sum())} left out as outliers"]
    groups: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(_kind(sample), []).append(i)
    width = max(40, *(len(kind) + 1 for kind in groups))
    lines.append(f"{'kind of step':<{width}}{'steps':>6}{'measured ms':>13}{'predicted ms':>14}{'error':>8}")
    for kind, idx in sorted(groups.items(), key=lambda g: float(np.mean(result.measured_s[g[1]]))):
        measured, predicted = float(np.mean(result.measured_s[idx])), float(np.mean(result.predicted_s[idx]))
        lines.append(f"{kind:<{width}}{len(idx):>6}{measured * 1e3:>13.1f}{predicted * 1e3:>14.1f}"
                     f"{100 * (predicted - measured) / measured:>+7.1f}%")
    return "\n".join(lines)
