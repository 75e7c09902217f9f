"""Calibration on the machine at hand: time real engine steps of known composition, then fit
the hardware profile's efficiency factors and overheads by least squares.

The grid: decode batches of several sizes and context lengths, whole prefills, chunks after a
cached context, and mixed steps (a prefill beside decodes). Decoding requests are *seated*:
added through `LLMEngine.add_request`, then given their blocks (allocated a block at a time
round-robin, the layout concurrent decodes leave behind) and their prompts counted as computed,
with one output token to decode next (`seat`), so a batch of 32 requests at 1536 tokens costs no
prefill. Their KV is never written, which changes what they sample, not how long a step takes.
Each request has its own KV: decodes sharing a cached prompt would read it from the CPU's caches
and look 1.5x faster than real traffic. Every step is timed as `LLMEngine.step()` runs it and
kept with the composition the scheduler gave it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from inflight.config import MatmulStorage
from inflight.perf.profiles import EngineProfile, HardwareProfile
from inflight.sim.fit import FitResult, Sample, fit_profile


class StepCase(NamedTuple):
    """`num_decodes` requests decoding at `context_len` for `num_steps` steps; in the first, a
    prompt of `prefill_len` new tokens after `prefill_context` cached ones (0: a fresh prompt)."""

    num_decodes: int
    context_len: int
    num_steps: int
    prefill_len: int = 0
    prefill_context: int = 0  # a multiple of the block size

    def describe(self) -> str:
        parts = [f"{self.num_decodes} x decode at {self.context_len}"] if self.num_decodes else []
        if self.prefill_len:
            at = f" at {self.prefill_context}" if self.prefill_context else ""
            parts.append(f"prefill {self.prefill_len}{at}")
        return " + ".join(parts)


def default_grid() -> list[StepCase]:
    """About a minute on one core of the dev machine with the embedded model. Needs a token
    budget of 2048, a max_model_len above it and about 3300 KV blocks of 16 tokens."""
    decodes = [(b, 64) for b in (1, 2, 3, 4, 6, 8, 16, 32, 64)]
    decodes += [(b, 512) for b in (1, 4, 16, 64)] + [(b, 1536) for b in (1, 4, 16, 32)]
    cases = [StepCase(b, c, 3) for b, c in decodes]
    cases += [StepCase(0, 0, 1, n) for n in (16, 128, 512, 2048)]
    cases += [StepCase(0, 0, 1, 512, 1024), StepCase(0, 0, 1, 128, 1536)]
    cases += [StepCase(16, 512, 2, 256), StepCase(64, 64, 2, 512), StepCase(4, 1536, 2, 512, 1024),
              StepCase(32, 512, 2, 128, 1536), StepCase(8, 256, 2, 1024, 512)]
    return cases


# --- measuring ------------------------------------------------------------------------------------


def seat(engine: Any, prompts: Sequence[list[int]], max_tokens: int) -> list[Any]:
    """Adds requests decoding after their prompts (see the module docstring): each prompt counts
    as computed, and its last token is given again as a first output, not yet computed, so that
    the next step decodes it. (Left uncomputed, that token would make the next step a one-token
    prompt chunk, which attention runs as a prefill, not as the decode the cost model prices.)
    `max_tokens` counts that first output: the requests decode `max_tokens - 1` steps."""
    from inflight.request import RequestStatus

    requests = [engine.add_request(p, _params(max_tokens)) for p in prompts]
    scheduler, bm = engine.scheduler, engine.block_manager
    for request in requests:
        scheduler.waiting.remove(request)
        request.output_token_ids.append(request.prompt_token_ids[-1])
    for k in range(1, bm.num_blocks_for(max(r.num_tokens for r in requests)) + 1):
        for request in requests:
            if not bm.allocate_slots(request, min(k * bm.block_size, request.num_tokens)):
                raise RuntimeError("the calibration engine's KV pool is too small for the grid")
    for request in requests:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_prompt_tokens
        scheduler.running.append(request)
    return requests


def _params(max_tokens: int) -> Any:
    from inflight.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def measure(engine: Any, cases: Sequence[StepCase], seed: int = 0,
            progress: Callable[[str], None] | None = None) -> list[Sample]:
    """Runs the cases on an empty `LLMEngine` and returns every step it took, with its
    composition and wall time."""
    from inflight.engine.output import RequestOutput, StepRecord

    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    # Chunks after a context reuse prefixes of one prompt, so its KV is computed once.
    base = rng.integers(vocab, size=max(c.prefill_context for c in cases) + 1).tolist()
    samples: list[Sample] = []

    def keep(record: StepRecord, outputs: list[RequestOutput]) -> None:
        if record.work:
            samples.append(Sample(record.work, record.duration_s, record.forward_s))

    def drain() -> None:
        while engine.has_unfinished():
            engine.step()

    engine.step_observers.append(keep)
    try:
        for i, case in enumerate(cases):
            if progress:
                progress(f"case {i + 1}/{len(cases)}: {case.describe()}")
            if case.prefill_context:  # computed (or found in the prefix cache) beforehand
                engine.add_request(base[:case.prefill_context + 1], _params(1))
                drain()
            if case.num_decodes:
                prompts = [rng.integers(vocab, size=case.context_len).tolist() for _ in range(case.num_decodes)]
                seat(engine, prompts, case.num_steps + 2)  # seat's own first output, then num_steps + 1 decodes
            if case.prefill_len:
                fresh = rng.integers(vocab, size=case.prefill_len).tolist()
                engine.add_request(base[:case.prefill_context] + fresh, _params(1))
            for _ in range(case.num_steps):
                engine.step()
            drain()
    finally:
        engine.step_observers.remove(keep)
    return samples


# --- the whole procedure --------------------------------------------------------------------------


def calibrate(model: str | None, hardware: HardwareProfile, base: EngineProfile, *, name: str = "cpu-local",
              cases: Sequence[StepCase] | None = None, torch_threads: int | None = 1,
              num_kv_blocks: int = 4096, max_num_tokens: int = 2048, repeats: int = 2,
              progress: Callable[[str], None] | None = None
              ) -> tuple[FitResult, list[Sample], tuple[FitResult, list[Sample]] | None]:
    """Loads `model` on the CPU, measures the grid and fits the inflight engine's profile on
    `hardware` (the nominal peaks of this machine, renamed `name`), starting from `base`.
    `max_num_tokens` is the calibration engine's budget: the largest prefill chunk measured.
    Where `model` is a GGUF file of kept blocks, also times its copies (`_storage_samples`) and
    fits the weights priced as stored to them and the grid, kept as the profile's `as_stored`
    factors (which price any other checkpoint): returned as the third item, with its samples."""
    import torch

    from inflight.sim.shapes import resolve_shapes

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    cases = list(cases or default_grid())
    engine = _timed_engine(model, cases, num_kv_blocks, max_num_tokens)
    load_before = os.getloadavg()
    started = time.perf_counter()
    samples = [s for seed in range(repeats) for s in measure(engine, cases, seed, progress)]
    stored = engine.parts.loaded.matmul_storage
    model_name, dtype = engine.model_name, str(engine.model.dtype).removeprefix("torch.")
    del engine
    copies: list[str] = []
    copied: list[Sample] = []
    if stored is not None and (stored.dense_kept or stored.experts_kept):
        copies, copied = _storage_samples(model, stored, repeats, progress)
    elapsed = time.perf_counter() - started
    _, shapes = resolve_shapes(model)
    hardware = dataclasses.replace(hardware, name=name, dtype=dtype)
    start = dataclasses.replace(base, name="inflight", weights_as_stored=False, block_decode_s=0.0,
                                block_decode_rows_s=0.0, as_stored={}, fitted_storage={})
    result = fit_profile(samples, shapes, hardware, start, dtype)
    as_stored, decode_times = None, {}
    if copied:
        # Each type's decoding against Q4_1's, as timed; the fit starts from Q4_1's time (half of it
        # in a step of more rows, a guess the fit replaces), which puts the decoding on the side of
        # the roofline that binds in a step of one token.
        decode_times = block_decode_times()
        reference = decode_times.get("Q4_1", 0.0)
        weights = {kind: t / reference for kind, t in decode_times.items()} if reference else {}
        as_stored_start = dataclasses.replace(start, weights_as_stored=True, block_decode_weights=weights,
                                              block_decode_s=reference, block_decode_rows_s=reference / 2)
        as_stored = (fit_profile(samples + copied, shapes, hardware, as_stored_start, dtype, matmul_storage=stored),
                     samples + copied)
    rel = np.abs(result.predicted_s - result.measured_s) / result.measured_s
    info = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model_name,
        "dtype": dtype,
        "matmul_storage": stored._asdict() if stored else None,
        "storage_copies": copies,
        "block_decode_ps": {kind: round(t * 1e12, 2) for kind, t in decode_times.items()},
        "torch_threads": torch.get_num_threads(),
        "num_samples": len(samples),
        "num_outliers": int(result.outliers.sum()),
        "mean_abs_error_perc_by_roofline": result.errors_by_roofline,
        "median_abs_error_perc": round(100 * float(np.median(rel[~result.outliers])), 2),
        "p90_abs_error_perc": round(100 * float(np.percentile(rel[~result.outliers], 90)), 2),
        "measure_s": round(elapsed, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "repeats": repeats,
        "grid": [c._asdict() for c in cases],
    }
    if as_stored is not None:
        info["as_stored_mean_abs_error_perc_by_roofline"] = as_stored[0].errors_by_roofline
    profile = dataclasses.replace(result.profile, calibration=info,
                                  source=f"inflight on {name}: fitted by `inflight sim calibrate`")
    if as_stored is not None and stored is not None:
        fitted = as_stored[0].profile
        profile = dataclasses.replace(profile, fitted_storage=stored.identity(), as_stored={
            f.name: getattr(fitted, f.name) for f in dataclasses.fields(fitted) if f.name not in _NOT_FITTED})
    return result._replace(profile=profile, hardware=hardware), samples, as_stored


# Steps timed again on copies of the model. With one model, a step's weight bytes, its blocks'
# decoding and its layers' fixed costs are all a fixed cost per step: a copy with its decoder
# matrices in another block type (BF16: other bytes, the same decoding) tells the bytes apart, and
# one of other widths (random weights in the model's types: other parameters a layer) the decoding
# from the layers' cost. Without them (a checkpoint that is not a GGUF file) the profile has no
# `as_stored` factors, and its own pricing holds for the model's own type alone (docs/simulator.md).
STORAGE_GRID = [*(StepCase(b, 64, 3) for b in (1, 2, 4, 16)), StepCase(1, 512, 3), StepCase(0, 0, 1, 512)]
# A copy keeps at most this many bytes of matrices (its first layers only, past it).
STORAGE_COPY_BYTES = 1 << 30


def _storage_samples(model: str | None, stored: MatmulStorage, repeats: int,
                     progress: Callable[[str], None] | None) -> tuple[list[str], list[Sample]]:
    """`STORAGE_GRID`'s steps on copies of `model` (a GGUF file): its decoder matrices in BF16
    (Q8_0 where they are 16-bit already), and twice as wide (half, past a hidden size of 1024) in
    its own types; each sample with its copy's storage and shapes. Returns what the copies were,
    none for a checkpoint that is not a GGUF file or a width that does not halve."""
    import tempfile
    from pathlib import Path

    from inflight.model.gguf_copy import resized_copy, retyped_copy
    from inflight.model.loader import resolve_model
    from inflight.perf.shapes import num_linear_params
    from inflight.sim.shapes import resolve_shapes

    source = resolve_model(model)
    if source.kind != "gguf":
        return [], []
    _, shapes = resolve_shapes(model)
    kind = "Q8_0" if stored.dense >= 2 else "BF16"
    layer_bytes = 2 * num_linear_params(shapes) / max(1, shapes.num_layers)
    factor = 2.0 if shapes.hidden_size <= 1024 else 0.5
    copies = {f"{kind} copy": lambda folder: retyped_copy(
                  source.path, kind, folder, min(shapes.num_layers, max(2, int(STORAGE_COPY_BYTES // layer_bytes)))),
              f"{factor:g}x as wide": lambda folder: resized_copy(
                  source.path, factor, max(2, min(shapes.num_layers // 4,
                                                  int(STORAGE_COPY_BYTES // (factor ** 2 * layer_bytes)))), folder)}
    made, samples = [], []
    with tempfile.TemporaryDirectory(prefix="inflight-calibrate-") as folder:
        for name, write in copies.items():
            if progress:
                progress(f"the model again: {name}")
            try:
                path = write(Path(folder))
            except ValueError as exc:
                if progress:
                    progress(f"no such copy: {exc}")
                continue
            engine = _timed_engine(str(path), STORAGE_GRID, 1024, 1024)
            storage = engine.parts.loaded.matmul_storage
            _, copy_shapes = resolve_shapes(str(path))
            samples += [s._replace(shapes=copy_shapes, storage=storage)
                        for seed in range(repeats) for s in measure(engine, STORAGE_GRID, seed, progress)]
            del engine
            path.unlink()
            made.append(name)
    return made, samples


# The matrices a block type's decoding is timed on (in features, out features): 4M weights, whose
# blocks stay in the last-level cache (8 MB in BF16), so that what is timed is the cores' work.
DECODE_SHAPES = [(1024, 1024)] * 4


def block_decode_times(kinds: Sequence[str] | None = None, rounds: int = 4) -> dict[str, float]:
    """Seconds a weight of each block type (`loader.BLOCK_TYPES`, or `kinds`; Q4_1 always) takes
    in a one-row matmul read from the cache, as the kernels decode it: `DECODE_SHAPES`' matmuls of
    random blocks (`gguf_copy.random_blocks`), the types taking turns for `rounds` rounds, each
    turn two passes to warm the cache and the best of five after. Empty where the kernels do not
    read blocks (no AVX2)."""
    import torch

    from inflight.model.gguf_copy import random_blocks
    from inflight.model.linear import Linear, blocks_usable
    from inflight.model.loader import BLOCK_TYPES

    if not blocks_usable():
        return {}
    rng = np.random.default_rng(0)
    numel = sum(k * n for k, n in DECODE_SHAPES)
    linears = {kind: [Linear(torch.empty(n, k, device="meta"), None, "inflight",
                             gguf_blocks=(kind, torch.from_numpy(random_blocks(kind, n, k, rng))))
                      for k, n in DECODE_SHAPES]
               for kind in dict.fromkeys(["Q4_1", *(kinds or BLOCK_TYPES)])}
    x = torch.randn(1, DECODE_SHAPES[0][0])
    best = dict.fromkeys(linears, float("inf"))
    for _ in range(rounds):
        for kind, matmuls in linears.items():
            for i in range(7):
                start = time.perf_counter()
                for linear in matmuls:
                    linear(x)
                if i >= 2:
                    best[kind] = min(best[kind], time.perf_counter() - start)
    return {kind: seconds / numel for kind, seconds in best.items()}


def _timed_engine(model: str | None, cases: Sequence[StepCase], num_kv_blocks: int, max_num_tokens: int,
                  quantization: str = "none") -> Any:
    """An engine on the CPU that can run every case, warmed up."""
    from inflight.bench.local import warm_up
    from inflight.config import EngineConfig
    from inflight.engine.engine import LLMEngine

    config = EngineConfig.from_kwargs(model, device="cpu", num_kv_blocks=num_kv_blocks,
                                      max_num_tokens=max_num_tokens, max_model_len=2 * max_num_tokens,
                                      max_batch_size=max(c.num_decodes for c in cases) + 1,
                                      quantization=quantization)
    engine = LLMEngine(config)
    warm_up(engine)
    return engine


# Nominal int8 peak of a CPU, as a multiple of its fp32 FMA peak, by the int8 kernel's branch
# (`csrc` int8_isa): vpdpbusd makes four byte products in each 32-bit lane where an FMA makes one;
# AVX2's vpmaddubsw makes four too but needs vpmaddwd and an add after it (about half the rate);
# the portable loops, one. The fitted efficiency absorbs the rest.
INT8_PEAK_FACTOR = {"avx512-vnni": 4.0, "avx-vnni": 4.0, "avx2": 2.0, "generic": 1.0}
# What an int8 fit may change of an engine profile: all but who it is and where it came from.
_NOT_FITTED = {"name", "kind", "source", "calibration", "int8", "as_stored", "fitted_storage"}


def calibrate_int8(model: str | None, hardware: HardwareProfile, base: EngineProfile, *,
                   cases: Sequence[StepCase] | None = None, torch_threads: int | None = 1,
                   num_kv_blocks: int = 4096, max_num_tokens: int = 2048, repeats: int = 2,
                   progress: Callable[[str], None] | None = None
                   ) -> tuple[FitResult, EngineProfile, list[Sample]]:
    """Times the grid on an engine with `--quantization int8` and fits a whole engine profile to
    it (`fit_profile`, its matmuls' efficiency of the hardware's int8 peak: nominal by the
    kernels' int8 branch, `INT8_PEAK_FACTOR`, where the hardware has none). The int8 kernels
    differ from the fp32 ones at every batch size, so every factor is fitted again. Returns the
    fit (its hardware with the int8 peak) and `base` (a machine calibrated by `calibrate`) with
    the fitted factors as its `int8` ones, which the simulator uses for `--quantization int8`."""
    import torch

    from inflight.model.kernels import cpu_kernels
    from inflight.sim.shapes import resolve_shapes

    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError("int8 runs on inflight's CPU kernels, which are not available here")
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    cases = list(cases or default_grid())
    engine = _timed_engine(model, cases, num_kv_blocks, max_num_tokens, quantization="int8")
    started = time.perf_counter()
    samples = [s for seed in range(repeats) for s in measure(engine, cases, seed, progress)]
    elapsed = time.perf_counter() - started
    _, shapes = resolve_shapes(model)
    isa = kernels.int8_isa()
    if not hardware.peak_flops_int8 > 0:
        hardware = dataclasses.replace(hardware, peak_flops_int8=INT8_PEAK_FACTOR[isa] * hardware.peak_flops)
    start = dataclasses.replace(base.for_int8() if base.int8 else base, eight_bit_flops_efficiency=0.0,
                                quantized_lm_head=True, int8={})  # the engine quantizes its LM head too
    result = fit_profile(samples, shapes, hardware, start, hardware.dtype, weight_dtype="int8")
    fitted = result.profile
    factors = {f.name: getattr(fitted, f.name) for f in dataclasses.fields(fitted) if f.name not in _NOT_FITTED}
    factors["eight_bit_flops_efficiency"] = fitted.flops_efficiency  # of the int8 peak
    rel = np.abs(result.predicted_s - result.measured_s) / result.measured_s
    info = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "int8_isa": isa,
        "peak_flops_int8": hardware.peak_flops_int8, "torch_threads": torch.get_num_threads(),
        "num_samples": len(samples), "num_outliers": int(result.outliers.sum()),
        "mean_abs_error_perc_by_roofline": result.errors_by_roofline,
        "median_abs_error_perc": round(100 * float(np.median(rel[~result.outliers])), 2),
        "p90_abs_error_perc": round(100 * float(np.percentile(rel[~result.outliers], 90)), 2),
        "measure_s": round(elapsed, 1), "repeats": repeats}
    profile = dataclasses.replace(base, int8=factors, calibration={**base.calibration, "int8": info})
    return result, profile, samples
