"""Hardware profiles: what a datasheet gives (peak FLOP/s per compute type, memory bandwidth and
size, the interconnect's bandwidth). How close an engine's kernels come to those peaks, and what
its steps cost besides, belongs to the engine: `inflight.sim.engine_profile`.

Built in: a few NVIDIA GPUs and `cpu-local` (this project's 2-core dev machine, nominal peaks).
`inflight sim calibrate` writes a profile file holding a machine's hardware and the inflight
engine's factors fitted on it; `load_profiles` reads either kind of file, and the files of
earlier versions, which mixed both in one record.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.errors import ConfigError

SCHEMA = "inflight-sim-hardware/2"
LEGACY_SCHEMA = "inflight-sim-hardware/1"  # hardware and engine factors in one record
_GB = 1e9
_GIB = 1024**3
_T = 1e12


@dataclass(frozen=True)
class HardwareProfile:
    """One device (a GPU, or a CPU socket). Peaks are per device: `peak_flops` for `dtype` (the
    type an engine computes in by default: bf16 on a GPU, fp32 on a CPU), and the dense 8-bit
    tensor-core peaks where the device has them (0: it has none, and 8-bit weights are then
    dequantized to `dtype` in the matmul). `--tp N` uses N devices linked by the interconnect."""

    name: str
    kind: str  # "gpu" or "cpu"
    peak_flops: float  # FLOP/s, dense matmul in `dtype`
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    interconnect_bandwidth: float = 0.0  # bytes/s per device and direction, for all-reduce
    dtype: str = "bfloat16"
    peak_flops_fp8: float = 0.0
    peak_flops_int8: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ConfigError(f"hardware {self.name}: kind must be gpu or cpu, got {self.kind!r}")
        for name in ("peak_flops", "memory_bandwidth", "memory_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"hardware {self.name}: {name} must be > 0")
        for name in ("interconnect_bandwidth", "peak_flops_fp8", "peak_flops_int8"):
            if getattr(self, name) < 0:
                raise ConfigError(f"hardware {self.name}: {name} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        return cls(**_fields_of(cls, data, SCHEMA, "hardware profile"))

    def save(self, path: Path) -> None:
        write_json(path, self.to_dict())


def _fields_of(cls: type, data: dict[str, Any], schema: str, what: str) -> dict[str, Any]:
    """The dataclass fields of a record that says it is `schema`; anything else is an error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields - {"schema"}
    if data.get("schema") != schema or unknown:
        problem = f"unknown fields {sorted(unknown)}" if unknown else f"schema is not {schema}"
        raise ConfigError(f"not a {what}: {problem}")
    return {k: v for k, v in data.items() if k in fields}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _gpu(name: str, tflops: float, fp8_tflops: float, int8_tops: float, tb_s: float, mem_gib: float,
         link_gb_s: float, source: str) -> HardwareProfile:
    return HardwareProfile(name, "gpu", tflops * _T, tb_s * _T, mem_gib * _GIB, link_gb_s * _GB,
                           peak_flops_fp8=fp8_tflops * _T, peak_flops_int8=int8_tops * _T, source=source)


# Dense (not 2:4 sparse) tensor-core peaks and HBM bandwidth from NVIDIA's datasheets, SXM parts;
# the link is NVLink (PCIe for L4), per direction: half the datasheet's bidirectional figure. The
# memory is the total the CUDA driver reports (`torch.cuda.mem_get_info`, what vLLM's
# gpu_memory_utilization and TensorRT-LLM's KV fraction take their share of): an "80GB" part
# shows 79.2 GiB (85.0e9 bytes), not 80e9.
BUILTIN_HARDWARE: dict[str, HardwareProfile] = {
    "h100": _gpu("h100", 989.4, 1978.9, 1978.9, 3.35, 79.2, 450, "H100 SXM5 80GB datasheet"),
    "h200": _gpu("h200", 989.4, 1978.9, 1978.9, 4.8, 139.8, 450, "H200 SXM 141GB datasheet"),
    "a100-80gb": _gpu("a100-80gb", 312, 0, 624, 2.039, 79.2, 300, "A100 SXM4 80GB datasheet (no FP8 tensor cores)"),
    "l4": _gpu("l4", 121, 242.5, 242.5, 0.3, 22.0, 32, "L4 datasheet (PCIe Gen4 x16, no NVLink)"),
    # 2 vCPUs of an AMD EPYC (Zen 5): 2 cores x 2 AVX-512 FMA x 16 fp32 lanes x 2 FLOP x 2.6 GHz.
    # The bandwidth is a nominal share of the host's. inflight's factors fitted on it are the
    # built-in `cpu-local` engine profile (inflight/sim/engine_profile.py).
    "cpu-local": HardwareProfile("cpu-local", "cpu", peak_flops=332e9, memory_bandwidth=50 * _GB,
                                 memory_bytes=16 * _GIB, dtype="float32",
                                 source="2-vCPU AMD EPYC (Zen 5) dev machine: nominal peaks"),
}


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (case-insensitive), or the hardware of a profile file."""
    from inflight.sim.engine_profile import load_profiles

    return load_profiles(name_or_path)[0]


def read_profile_file(name_or_path: str, known: str) -> dict[str, Any]:
    """The JSON object of a profile file; `known` lists the built-in names for the error."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"unknown hardware {name_or_path!r}: give one of {known} "
                          "or a profile JSON written by `inflight sim calibrate`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read profile {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a profile")
    return data
