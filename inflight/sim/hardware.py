"""Hardware profiles: datasheet peaks plus the efficiency factors and overheads that turn them
into step times. Built in: a few GPUs and `cpu-local` (this project's 2-core dev machine);
`inflight sim calibrate` fits a profile for the machine at hand and writes it as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.errors import ConfigError

SCHEMA = "inflight-sim-hardware/1"
_GB = 1e9
_GIB = 1024**3


@dataclass(frozen=True)
class HardwareProfile:
    """One device (a GPU, or a CPU socket). Peaks are per device, for `dtype`; `--tp N` uses N of
    them. The efficiency factors scale the peaks to what the engine's kernels reach; the
    overheads are the per-step CPU work (scheduling, building inputs, launching, outputs)."""

    name: str
    kind: str  # "gpu" or "cpu"
    peak_flops: float  # FLOP/s, dense matmul in `dtype`
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    interconnect_bandwidth: float = 0.0  # bytes/s per device and direction, for all-reduce
    dtype: str = "bfloat16"  # what the engine runs on this device by default
    # How compute and memory time combine in one kernel: "max" (they overlap, the slower bound
    # wins: the roofline) or "sum" (they do not, as for small matmuls on one CPU thread).
    roofline: str = "max"
    flops_efficiency: float = 0.6  # linear layers, compute-bound
    bandwidth_efficiency: float = 0.8  # linear layers, weight-bound
    attention_flops_efficiency: float = 0.4
    attention_bandwidth_efficiency: float = 0.7  # KV reads
    step_overhead_s: float = 2e-3
    request_overhead_s: float = 20e-6  # per request scheduled in the step
    allreduce_latency_s: float = 10e-6
    # How a CPU BLAS treats the few-row matmuls of small decode batches: one row is a
    # matrix-vector product; 2 to `small_batch_max_rows` rows run one product per row, each row
    # after the first costing `small_batch_row_s` more (another pass over the weights); more
    # rows run as a GEMM, which first packs the weights: `gemm_step_s` more, once per step.
    # GPUs: 1 and zeros.
    small_batch_max_rows: int = 1
    small_batch_row_s: float = 0.0
    gemm_step_s: float = 0.0
    source: str = ""
    calibration: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ConfigError(f"hardware {self.name}: kind must be gpu or cpu, got {self.kind!r}")
        if self.roofline not in ("max", "sum"):
            raise ConfigError(f"hardware {self.name}: roofline must be max or sum, got {self.roofline!r}")
        positive = ("peak_flops", "memory_bandwidth", "memory_bytes", "flops_efficiency",
                    "bandwidth_efficiency", "attention_flops_efficiency", "attention_bandwidth_efficiency")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"hardware {self.name}: {name} must be > 0")
        if self.small_batch_max_rows < 1:
            raise ConfigError(f"hardware {self.name}: small_batch_max_rows must be >= 1")
        for name in ("step_overhead_s", "request_overhead_s", "allreduce_latency_s", "interconnect_bandwidth",
                     "small_batch_row_s", "gemm_step_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"hardware {self.name}: {name} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields - {"schema"}
        if data.get("schema") != SCHEMA or unknown:
            what = f"unknown fields {sorted(unknown)}" if unknown else f"schema is not {SCHEMA}"
            raise ConfigError(f"not a hardware profile: {what}")
        return cls(**{k: v for k, v in data.items() if k in fields})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def _gpu(name: str, tflops: float, tb_s: float, mem_gb: float, link_gb_s: float, latency_s: float,
         source: str) -> HardwareProfile:
    return HardwareProfile(name, "gpu", tflops * 1e12, tb_s * 1e12, mem_gb * _GB, link_gb_s * _GB,
                           allreduce_latency_s=latency_s, source=source)


# Dense bf16 tensor-core peaks and HBM bandwidth from NVIDIA's datasheets (SXM parts); the link
# is NVLink (or PCIe for L4) per direction. Efficiency factors are typical of vLLM-class
# kernels, not measured here: calibrate on the real machine for figures you act on.
BUILTIN_HARDWARE: dict[str, HardwareProfile] = {
    "h100": _gpu("h100", 989.4, 3.35, 80, 450, 8e-6, "H100 SXM5 80GB datasheet"),
    "h200": _gpu("h200", 989.4, 4.8, 141, 450, 8e-6, "H200 SXM 141GB datasheet"),
    "a100-80gb": _gpu("a100-80gb", 312, 2.039, 80, 300, 10e-6, "A100 SXM4 80GB datasheet"),
    "l4": _gpu("l4", 121, 0.3, 24, 32, 25e-6, "L4 datasheet (PCIe Gen4 x16, no NVLink)"),
    # 2 vCPUs of an AMD EPYC (Zen 5): 2 cores x 2 AVX-512 FMA x 16 fp32 lanes x 2 FLOP x 2.6 GHz.
    # The bandwidth is a nominal share of the host's. The factors and overheads are those fitted
    # by `inflight sim calibrate` on that machine (one torch thread, the embedded model in fp32;
    # benchmarks/sim/results/cpu-local.json). inflight's own GEMM prefetches the next weight
    # panel, so weight streaming and compute overlap ("max"), and the few-row regime that MKL's
    # per-call weight repacking used to cause is nearly gone; see docs/simulator.md.
    "cpu-local": HardwareProfile(
        "cpu-local", "cpu", peak_flops=332e9, memory_bandwidth=50 * _GB, memory_bytes=16 * _GIB,
        dtype="float32", roofline="max", flops_efficiency=0.680, bandwidth_efficiency=0.681,
        attention_flops_efficiency=0.257, attention_bandwidth_efficiency=0.455,
        step_overhead_s=0.50e-3, request_overhead_s=48e-6,
        small_batch_max_rows=8, small_batch_row_s=0.34e-3, gemm_step_s=8.2e-3,
        source="2-vCPU AMD EPYC dev machine: nominal peaks, factors fitted on 2026-11-29 (commit b7bf522)",
    ),
}


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (case-insensitive) or a profile JSON written by calibrate."""
    key = name_or_path.strip().lower()
    if key in BUILTIN_HARDWARE:
        return BUILTIN_HARDWARE[key]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"unknown hardware {name_or_path!r}: give one of {', '.join(BUILTIN_HARDWARE)} "
                          "or a profile JSON written by `inflight sim calibrate`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read hardware profile {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a hardware profile")
    try:
        return HardwareProfile.from_dict(data)
    except TypeError as exc:
        raise ConfigError(f"{path}: malformed hardware profile ({exc})") from None
