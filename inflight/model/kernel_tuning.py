"""The fp32 matmul kernel's per-machine choices, made by a short timing once per build.

Cores differ in what the panel matmul (`packed_linear`, and the fp32 panels of `gguf_blocks_gemm`)
wants: how many rows one microkernel pass takes (the build's most, or fewer accumulators and
activation streams) and whether a pass prefetches the next weight panel, apart for a panel taken
in one pass (a step of a few rows, bound by streaming weights from DRAM) and in several. The
first load of a build times each choice against the build's default on matrices larger than the
last-level cache, alternated round by round, takes the other value only where its median time
is at least `MARGIN` shorter (so noise keeps the default), and records the choice and the timings
beside the compiled module (`gemm_tuning.json`); later loads read it. A record made on another
CPU, by another version of this procedure, or that does not parse is made again. No choice
changes a result: each output is the same in-order sum whichever rows share a pass
(`tests/test_kernel_tuning.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from inflight.model.loader import write_atomically

logger = logging.getLogger(__name__)

TUNING_FILE = "gemm_tuning.json"
VERSION = 1
MARGIN = 0.05  # the other value must be this much faster (median of the rounds' ratios)


@dataclass(frozen=True)
class GemmTuning:
    max_rows: int
    prefetch_one_pass: bool = True
    prefetch_passes: bool = True


@dataclass(frozen=True)
class TuningShape:
    """What is timed: `num_matrices` weights of [out_features, in_features] (together past the
    last-level cache), through steps of each of `one_pass_rows` and `passes_rows`."""

    out_features: int = 8192
    in_features: int = 2048
    num_matrices: int = 4
    rounds: int = 5


def cpu_identity() -> str:
    """The CPU's model name, family and model: a record made on another kind of core is redone."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        pass
    return ", ".join(f"{key} {fields[key]}" for key in ("model name", "cpu family", "model") if key in fields)


def prefers_other(default_s: list[float], other_s: list[float], margin: float = MARGIN) -> tuple[bool, float]:
    """Whether the other value wins: the median over rounds of other / default below 1 - margin.
    Returns the decision and that median."""
    ratio = statistics.median(o / d for d, o in zip(default_s, other_s, strict=True))
    return ratio < 1.0 - margin, ratio


def _time_steps(module: ModuleType, weights: list[torch.Tensor], xs: list[torch.Tensor], n: int) -> float:
    start = time.perf_counter()
    for x in xs:
        for w in weights:
            module.packed_linear(x, w, None, n)
    return time.perf_counter() - start


def tune(module: ModuleType, shape: TuningShape = TuningShape()) -> dict:
    """Times the choices on this machine and returns the record `apply` keeps (the choice under
    "choice", each comparison under "trials"); sets nothing."""
    started = time.perf_counter()
    most = int(module.gemm_max_rows())
    record = {"version": VERSION, "cpu": cpu_identity(), "threads": torch.get_num_threads(), "isa": module.isa(),
              "shape": asdict(shape)}
    if module.isa() == "generic":  # the portable fallback: slow to time, and nothing to gain there
        return {**record, "choice": asdict(GemmTuning(max_rows=most)), "trials": [], "seconds": 0.0}
    n, k = shape.out_features, shape.in_features
    generator = torch.Generator().manual_seed(0)
    dense = torch.rand(n, k, generator=generator) - 0.5
    weights = [module.pack_linear_weight(dense) for _ in range(shape.num_matrices)]
    del dense

    def steps(*rows: int) -> list[torch.Tensor]:
        return [torch.rand(m, k, generator=generator) for m in rows]

    one_pass = steps(1, 4, most)
    passes = steps(3 * most - 2, 64)
    fewer_rows = max(1, (most * 3 + 4) // 5)  # 14 -> 9, 6 -> 4, 4 -> 3
    candidates: list[tuple[str, Callable[[GemmTuning], GemmTuning], list[torch.Tensor]]] = [
        ("prefetch_one_pass", lambda t: replace(t, prefetch_one_pass=not t.prefetch_one_pass), one_pass),
        ("prefetch_passes", lambda t: replace(t, prefetch_passes=not t.prefetch_passes), passes),
    ]
    if fewer_rows < most:
        candidates.append(("max_rows", lambda t: replace(t, max_rows=fewer_rows), passes))
    saved = module.gemm_tuning()
    choice = GemmTuning(max_rows=most)
    trials = []
    try:
        for setting, other_of, xs in candidates:
            other = other_of(choice)
            times: dict[GemmTuning, list[float]] = {choice: [], other: []}
            for round_ in range(shape.rounds + 1):  # round 0 warms both up
                for tuning in (choice, other) if round_ % 2 == 0 else (other, choice):
                    module.set_gemm_tuning(*astuple(tuning))
                    elapsed = _time_steps(module, weights, xs, n)
                    if round_ > 0:
                        times[tuning].append(elapsed)
            wins, ratio = prefers_other(times[choice], times[other])
            trials.append({
                "setting": setting, "default": getattr(choice, setting), "other": getattr(other, setting),
                "rows": [x.size(0) for x in xs], "default_ms": [round(t * 1e3, 2) for t in times[choice]],
                "other_ms": [round(t * 1e3, 2) for t in times[other]], "median_ratio": round(ratio, 4),
                "chosen": getattr(other if wins else choice, setting),
            })
            choice = other if wins else choice
    finally:
        module.set_gemm_tuning(*saved)
    return {**record, "choice": asdict(choice), "trials": trials, "seconds": round(time.perf_counter() - started, 2)}


def _valid(record: object, module: ModuleType) -> GemmTuning | None:
    if not isinstance(record, dict) or record.get("version") != VERSION or record.get("cpu") != cpu_identity():
        return None
    try:
        tuning = GemmTuning(**record["choice"])
    except (KeyError, TypeError):
        return None
    if not (isinstance(tuning.max_rows, int) and 1 <= tuning.max_rows <= module.gemm_max_rows()):
        return None
    if not all(isinstance(flag, bool) for flag in (tuning.prefetch_one_pass, tuning.prefetch_passes)):
        return None
    return tuning


def apply(module: ModuleType, build_dir: Path, shape: TuningShape = TuningShape()) -> GemmTuning:
    """Sets the module's tuning from `build_dir`'s record, timing and recording it first where
    there is none for this CPU (one process at a time: others wait for its record)."""
    path = build_dir / TUNING_FILE
    with _held(build_dir / "gemm_tuning.lock"):
        try:
            tuning = _valid(json.loads(path.read_text()), module)
        except (OSError, ValueError):
            tuning = None
        if tuning is None:
            logger.info("timing the fp32 matmul's choices on this CPU (once per kernel build)")
            record = tune(module, shape)
            tuning = GemmTuning(**record["choice"])
            failed = write_atomically(path, json.dumps(record, indent=1) + "\n")
            if failed is not None:
                logger.warning("could not keep the matmul tuning in %s (%s); it is timed again next time", path, failed)
    module.set_gemm_tuning(*astuple(tuning))
    return tuning


@contextlib.contextmanager
def _held(lock_path: Path) -> Iterator[None]:
    """An exclusive lock on `lock_path`, dropped with its holder; none where it cannot be made
    (a read-only cache: then the record cannot be kept either)."""
    try:
        held = open(lock_path, "w")
    except OSError:
        yield
        return
    with held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def describe(build_dir: Path) -> str:
    """One line on the kept record: the choice and each comparison's median time ratio."""
    try:
        record = json.loads((build_dir / TUNING_FILE).read_text())
        parts = [f"{t['setting']}={t['chosen']} (other/default {t['median_ratio']:.3f})" for t in record["trials"]]
    except (OSError, ValueError, KeyError, TypeError):
        return "no tuning record"
    if not parts:
        return f"the defaults ({record['isa']} build: not timed)"
    return f"{', '.join(parts)}; timed in {record['seconds']} s on {record['threads']} threads"
