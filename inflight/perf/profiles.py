"""What a step costs is read from two profiles.

- **Hardware** (`HardwareProfile`): what a datasheet gives, per device: peak FLOP/s per compute
  type, memory bandwidth and size, the interconnect's bandwidth. Built in: a few NVIDIA GPUs and
  `cpu-local` (the project's 2-core dev machine, nominal peaks).
- **Engine** (`EngineProfile`): how close an engine's kernels come to those peaks, and what its
  steps cost besides the arithmetic (CPU work per step and per request, kernel launches per
  layer, CUDA graphs, its all-reduce). Two engines on one GPU differ here, not in the hardware.
  Built in: `vllm`, `sglang` and `trtllm`, each fitted to that engine's published figures (their
  `source` names them; docs/simulator.md has the table), `inflight` on a GPU (assumed: the CUDA
  path has not run on one yet), and `inflight-cpu`, fitted by `inflight sim calibrate` on the
  dev machine.

`inflight sim calibrate` writes a profile file holding a machine's hardware and the inflight
engine's factors fitted on it; `load_profiles` reads either kind of file, and the files of
earlier versions, which mixed both in one record.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from inflight.errors import ConfigError

HARDWARE_SCHEMA = "inflight-sim-hardware/2"
LEGACY_SCHEMA = "inflight-sim-hardware/1"  # hardware and engine factors in one record
_GB = 1e9
_GIB = 1024**3
_T = 1e12


class _Record:
    """A profile dataclass as a JSON record under its `SCHEMA`, read back only under it."""

    SCHEMA: ClassVar[str]
    WHAT: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.SCHEMA, **dataclasses.asdict(self)}  # type: ignore[call-overload]  # a dataclass

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**_fields_of(cls, data, cls.SCHEMA, cls.WHAT))

    def save(self, path: Path) -> None:
        write_json(path, self.to_dict())


@dataclass(frozen=True)
class HardwareProfile(_Record):
    """One device (a GPU, or a CPU socket). Peaks are per device: `peak_flops` for `dtype` (the
    type an engine computes in by default: bf16 on a GPU, fp32 on a CPU), and the dense 8-bit
    tensor-core peaks where the device has them (0: it has none, and 8-bit weights are then
    dequantized to `dtype` in the matmul). `--tp N` uses N devices linked by the interconnect."""

    SCHEMA: ClassVar[str] = HARDWARE_SCHEMA
    WHAT: ClassVar[str] = "hardware profile"

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
    # built-in `cpu-local` engine profile (inflight/perf/profiles.py).
    "cpu-local": HardwareProfile("cpu-local", "cpu", peak_flops=332e9, memory_bandwidth=50 * _GB,
                                 memory_bytes=16 * _GIB, dtype="float32",
                                 source="2-vCPU AMD EPYC (Zen 5) dev machine: nominal peaks"),
}


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (case-insensitive), or the hardware of a profile file."""
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


ENGINE_SCHEMA = "inflight-sim-engine/1"
PROFILE_SCHEMA = "inflight-sim-profile/1"  # a calibrated machine: its hardware and engine together
ROOFLINES = ("max", "sum", "smooth")


@dataclass(frozen=True)
class EngineProfile(_Record):
    """One engine's kernels and step loop, on the `kind` of device it was fitted for.

    - Linear layers and attention reach `*_efficiency` of the device's peaks; 8-bit matmuls on
      8-bit tensor cores reach `eight_bit_flops_efficiency` of theirs, which is lower than a
      16-bit matmul's share of its own (0: the same). Compute and memory
      time combine by `roofline`: `max` (perfect overlap), `sum` (none), or `smooth`:
      `(c**k + m**k) ** (1/k)` with `k = roofline_exponent`, between the two near the ridge.
    - Per step: `step_overhead_s` + `request_overhead_s` per scheduled request (CPU work:
      scheduling, inputs, sampling, outputs). With `overlap_scheduling` it runs while the device
      computes the step, which then takes the longer of the two.
    - Per layer and step: `layer_overhead_s` (launches and gaps of its kernels, eager), or
      `graph_layer_overhead_s` in a step replayed from a CUDA graph: with `cuda_graphs`, a step of
      decodes only, of at most `cuda_graph_max_batch` requests (0: any).
    - With TP, each all-reduce costs `allreduce_latency_s` + `allreduce_peer_latency_s` per peer,
      plus its bytes over `allreduce_bandwidth_efficiency` of the link.
    - A CPU BLAS's few-row matmuls: 2 to `small_batch_max_rows` rows run one product per row,
      each row after the first costing `small_batch_row_s` more; more rows run as a GEMM that
      packs the weights first, `gemm_step_s` per step. GPUs: 1 and zeros.
    """

    SCHEMA: ClassVar[str] = ENGINE_SCHEMA
    WHAT: ClassVar[str] = "engine profile"

    name: str
    kind: str = "gpu"
    roofline: str = "max"
    roofline_exponent: float = 2.0
    flops_efficiency: float = 0.6
    eight_bit_flops_efficiency: float = 0.0  # of the 8-bit peak, for fp8/int8 matmuls; 0: flops_efficiency
    # With 8-bit weights the LM head is 8-bit too (inflight's `--quantization int8`, as llama.cpp's
    # files), not kept in the activations' type (quantized checkpoints for GPU engines).
    quantized_lm_head: bool = False
    bandwidth_efficiency: float = 0.8
    attention_flops_efficiency: float = 0.4
    attention_bandwidth_efficiency: float = 0.7
    step_overhead_s: float = 2e-3
    request_overhead_s: float = 20e-6
    overlap_scheduling: bool = False
    layer_overhead_s: float = 0.0
    cuda_graphs: bool = False
    cuda_graph_max_batch: int = 0
    graph_layer_overhead_s: float = 0.0
    allreduce_latency_s: float = 10e-6
    allreduce_peer_latency_s: float = 0.0
    allreduce_bandwidth_efficiency: float = 1.0
    small_batch_max_rows: int = 1
    small_batch_row_s: float = 0.0
    gemm_step_s: float = 0.0
    # Factors fitted with a checkpoint's matrices priced as a step reads them (`MatmulStorage`: a
    # GGUF file's blocks at their own bytes, and `block_decode_s` a parameter for decoding them);
    # otherwise every weight in the compute type, nothing decoded.
    weights_as_stored: bool = False
    block_decode_s: float = 0.0  # in a step of one token (each matmul a vector's)
    block_decode_rows_s: float = 0.0  # in a step of more
    # Each block type's decoding against Q4_1's, which the two rates above are of (a type missing:
    # 1), timed by the calibration (`sim.calibrate.block_decode_times`).
    block_decode_weights: dict[str, float] = field(default_factory=dict, compare=False)
    source: str = ""
    calibration: dict[str, Any] = field(default_factory=dict, compare=False)
    # inflight on a CPU: the factors fitted on its engine with `--quantization int8` (int8
    # matmuls, `inflight sim calibrate --quantization int8`), which replace this profile's when the
    # simulated engine runs so (`for_int8`); empty where none was fitted.
    int8: dict[str, Any] = field(default_factory=dict, compare=False)
    # inflight on a CPU: the factors fitted with the weights priced as stored, on the calibrated
    # model and its copies in other storage types and widths (`weights_as_stored`), which price a
    # checkpoint stored otherwise than `fitted_storage` (the calibrated model's `MatmulStorage`,
    # whose own steps this profile's factors fit best): `for_storage`.
    as_stored: dict[str, Any] = field(default_factory=dict, compare=False)
    fitted_storage: dict[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f"engine profile {self.name}"
        if self.kind not in ("gpu", "cpu"):
            raise ConfigError(f"{where}: kind must be gpu or cpu, got {self.kind!r}")
        if self.roofline not in ROOFLINES:
            raise ConfigError(f"{where}: roofline must be one of {', '.join(ROOFLINES)}, got {self.roofline!r}")
        if not self.roofline_exponent >= 1:
            raise ConfigError(f"{where}: roofline_exponent must be >= 1")
        for name in ("flops_efficiency", "bandwidth_efficiency", "attention_flops_efficiency",
                     "attention_bandwidth_efficiency", "allreduce_bandwidth_efficiency"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{where}: {name} must be > 0")
        if self.small_batch_max_rows < 1 or self.cuda_graph_max_batch < 0:
            raise ConfigError(f"{where}: small_batch_max_rows must be >= 1 and cuda_graph_max_batch >= 0")
        if self.eight_bit_flops_efficiency < 0:
            raise ConfigError(f"{where}: eight_bit_flops_efficiency must be >= 0")
        for name in ("step_overhead_s", "request_overhead_s", "layer_overhead_s", "graph_layer_overhead_s",
                     "allreduce_latency_s", "allreduce_peer_latency_s", "small_batch_row_s", "gemm_step_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}: {name} must be >= 0")

    def for_int8(self) -> EngineProfile:
        """This engine with `--quantization int8`: its int8 factors in place of its own."""
        if not self.int8:
            raise ConfigError(f"engine profile {self.name} has no int8 factors")
        return dataclasses.replace(self, **self.int8, int8={})

    def for_storage(self, storage: dict[str, float]) -> EngineProfile:
        """This engine pricing a checkpoint stored as `storage` (`MatmulStorage._asdict()`): its
        own factors for the model it was calibrated on (the same bytes and kept shares,
        `MatmulStorage.identity`), its `as_stored` ones for any other storage (itself where it has
        none)."""
        if not self.as_stored or {k: storage.get(k) for k in self.fitted_storage} == self.fitted_storage:
            return self
        return dataclasses.replace(self, **self.as_stored, as_stored={}, fitted_storage={})

    def graphed(self, num_requests: int, decode_only: bool) -> bool:
        """Whether a step runs from a captured CUDA graph."""
        return (self.cuda_graphs and decode_only and num_requests > 0
                and (self.cuda_graph_max_batch == 0 or num_requests <= self.cuda_graph_max_batch))



def save_profile(path: Path, hardware: HardwareProfile, engine: EngineProfile) -> None:
    """A calibrated machine: its hardware and the engine's factors fitted on it, in one file."""
    write_json(path, {"schema": PROFILE_SCHEMA, "hardware": hardware.to_dict(), "engine": engine.to_dict()})


# Fitted against cpu-local's nominal peaks on 2 AMD EPYC Zen 4 cores (one torch thread;
# benchmarks/sim/results/cpu-local.json, docs/simulator.md). The factors are effective values of
# those nominal peaks, not measurements of the hardware. Its own: the embedded model's steps, its
# Q4_1 blocks priced as fp32 weights ("bandwidth" over 1 stands for their decoding too), which fit
# that model best. `as_stored`: the same steps and those of two copies of it (its matrices in
# BF16, and twice as wide), each matrix at its stored bytes and each kept parameter's decoding
# priced (the cores' work, beside the multiply-adds; each block type's weighed by its timed cost
# against Q4_1's), which price any checkpoint stored otherwise (`for_storage`). inflight's own
# GEMM prefetches the next weight panel, so weight streaming and compute overlap.
_EMBEDDED_STORAGE = {"dense": 0.625, "experts": 0.625, "head": 1.0625, "dense_kept": 1.0, "experts_kept": 1.0,
                     "head_kept": 1.0}
INFLIGHT_CPU = EngineProfile(
    "inflight-cpu", kind="cpu", roofline="max", flops_efficiency=0.321, bandwidth_efficiency=1.040,
    attention_flops_efficiency=0.162, attention_bandwidth_efficiency=0.313, step_overhead_s=0.50e-3,
    request_overhead_s=26e-6, layer_overhead_s=0.0, allreduce_latency_s=0.0, small_batch_max_rows=2,
    small_batch_row_s=0.88e-3, gemm_step_s=3.6e-3,
    source="inflight on cpu-local: factors fitted by `inflight sim calibrate` on 2 AMD EPYC Zen 4 cores, "
           "2026-12-07 (commit e562134); as_stored on the same cores, 2026-12-08 (the decoding by block type)",
    fitted_storage=_EMBEDDED_STORAGE,
    as_stored={"roofline": "sum", "flops_efficiency": 0.329, "bandwidth_efficiency": 1.898,
               "attention_flops_efficiency": 0.139, "attention_bandwidth_efficiency": 0.515,
               "step_overhead_s": 0.50e-3, "request_overhead_s": 31e-6, "layer_overhead_s": 30e-6,
               "small_batch_max_rows": 2, "small_batch_row_s": 3.8e-3, "gemm_step_s": 1.6e-3, "weights_as_stored": True,
               "block_decode_s": 49.4e-12, "block_decode_rows_s": 9.7e-12,
               "block_decode_weights": {
                   "Q4_1": 1.0, "Q4_0": 1.02, "Q4_K": 1.01, "Q5_0": 1.0, "Q8_0": 1.05, "Q5_1": 1.01, "Q5_K": 1.01,
                   "Q6_K": 1.0, "Q3_K": 1.0, "Q2_K": 1.0, "IQ4_NL": 1.2, "IQ4_XS": 1.2, "MXFP4": 1.19, "F16": 1.01,
                   "BF16": 1.01, "IQ1_S": 1.0, "IQ1_M": 1.0, "IQ2_XXS": 1.1, "IQ2_XS": 1.0, "IQ2_S": 1.0,
                   "IQ3_XXS": 1.0, "IQ3_S": 1.03, "TQ1_0": 1.02, "TQ2_0": 1.01}},
)

BUILTIN_ENGINES: dict[str, EngineProfile] = {
    "vllm": EngineProfile(
        "vllm", roofline="smooth", roofline_exponent=3.0, flops_efficiency=0.6, bandwidth_efficiency=0.75,
        attention_flops_efficiency=0.4, attention_bandwidth_efficiency=0.7, step_overhead_s=2.70e-3,
        request_overhead_s=15e-6, layer_overhead_s=54e-6, cuda_graphs=True, cuda_graph_max_batch=256,
        graph_layer_overhead_s=10e-6, allreduce_latency_s=18e-6, allreduce_peer_latency_s=2e-6,
        allreduce_bandwidth_efficiency=0.388,
        source="vLLM 0.6.0: step and per-layer overheads fitted to its offline throughput and TPOT for "
               "Llama-3.1-8B on one A100, its all-reduce to the TPOT of Llama-3.1-70B on 4 H100s, in "
               "sgl-project/sglang benchmark/benchmark_vllm_060 (120affb)"),
    "sglang": EngineProfile(
        "sglang", roofline="smooth", roofline_exponent=3.0, flops_efficiency=0.507, bandwidth_efficiency=0.634,
        attention_flops_efficiency=0.4, attention_bandwidth_efficiency=0.7, step_overhead_s=0.2e-3,
        request_overhead_s=3e-6, layer_overhead_s=27.6e-6, cuda_graphs=True,
        cuda_graph_max_batch=160, graph_layer_overhead_s=10e-6, allreduce_latency_s=59e-6,
        allreduce_peer_latency_s=2e-6, allreduce_bandwidth_efficiency=0.388,
        source="SGLang 0.3.0 (no overlapped scheduling before 0.4): efficiencies and per-layer overhead fitted "
               "to its offline throughput and TPOT for Llama-3.1-8B on one A100, its all-reduce latency to the "
               "TPOT of Llama-3.1-70B on 4 H100s (vLLM's link terms), its CPU costs per step and per request to "
               "all three, in sgl-project/sglang benchmark/benchmark_vllm_060 (120affb)"),
    "trtllm": EngineProfile(
        "trtllm", roofline="smooth", roofline_exponent=2.308, flops_efficiency=0.67, eight_bit_flops_efficiency=0.552,
        bandwidth_efficiency=0.571,
        attention_flops_efficiency=0.45, attention_bandwidth_efficiency=0.9, step_overhead_s=0.25e-3,
        request_overhead_s=5e-6, layer_overhead_s=33.8e-6, cuda_graphs=True,
        cuda_graph_max_batch=0, graph_layer_overhead_s=8e-6, allreduce_latency_s=23.9e-6,
        allreduce_peer_latency_s=1e-6, allreduce_bandwidth_efficiency=0.592,
        source="TensorRT-LLM 0.14 and 0.17, its C++ executor (scheduling between steps, not overlapped), "
               "admitting with GUARANTEED_NO_EVICT within trtllm-bench's engine limits: fitted to five points "
               "of NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md (258c754): Llama-3.1-8B and 70B "
               "FP8 offline throughput on H100 (128/2048, 2048/128, 70B TP4 128/2048) and bf16 mean ITL at 8 "
               "QPS; its 16-bit matmuls to the first-token latency of a 2048-token prompt, Llama-2-7B fp16 on "
               "A100, in docs/source/performance.md (77d24b5)"),
    # inflight's CUDA path is eager PyTorch: no CUDA graphs, one launch per op, Python between
    # them. Assumed, not measured (issue #22 runs it on a GPU).
    "inflight": EngineProfile(
        "inflight", roofline="smooth", roofline_exponent=3.0, flops_efficiency=0.55, bandwidth_efficiency=0.75,
        attention_flops_efficiency=0.3, attention_bandwidth_efficiency=0.6, step_overhead_s=3e-3,
        request_overhead_s=40e-6, layer_overhead_s=120e-6, allreduce_latency_s=15e-6,
        allreduce_peer_latency_s=2e-6, allreduce_bandwidth_efficiency=0.6,
        source="assumed for eager PyTorch on a GPU; not fitted (inflight's CUDA path has not run on a GPU)"),
    "inflight-cpu": INFLIGHT_CPU,
}

# Built-in hardware that comes with the inflight engine's factors fitted on it.
CALIBRATED: dict[str, EngineProfile] = {"cpu-local": INFLIGHT_CPU}

_DEFAULT_ENGINE = {"gpu": "vllm", "cpu": "inflight-cpu"}


def load_profiles(hardware: str, engine: str | None = None) -> tuple[HardwareProfile, EngineProfile]:
    """The hardware (a built-in name or a profile file) and the engine profile to simulate on it:
    `engine` by name or file; by default, the engine fitted with the hardware (a calibrated
    machine), else vllm on a GPU and inflight-cpu on a CPU. `inflight` means the calibrated
    engine where there is one, else inflight's built-in profile for the device."""
    hw, calibrated = _read_hardware(hardware)
    if engine is None or engine.strip().lower() == "inflight":
        if calibrated is not None:
            return hw, calibrated
        engine = _DEFAULT_ENGINE[hw.kind] if engine is None or hw.kind == "cpu" else "inflight"
    profile = _read_engine(engine)
    if profile.kind != hw.kind:
        raise ConfigError(f"engine profile {profile.name} is for a {profile.kind}; {hw.name} is a {hw.kind}")
    return hw, profile


def default_engine(hardware: HardwareProfile) -> EngineProfile:
    return CALIBRATED.get(hardware.name) or BUILTIN_ENGINES[_DEFAULT_ENGINE[hardware.kind]]


def _read_hardware(name_or_path: str) -> tuple[HardwareProfile, EngineProfile | None]:
    key = name_or_path.strip().lower()
    if key in BUILTIN_HARDWARE:
        return BUILTIN_HARDWARE[key], CALIBRATED.get(key)
    data = read_profile_file(name_or_path, ", ".join(BUILTIN_HARDWARE))
    try:
        schema = data.get("schema")
        if schema == PROFILE_SCHEMA:
            return HardwareProfile.from_dict(data["hardware"]), EngineProfile.from_dict(data["engine"])
        if schema == LEGACY_SCHEMA:
            return _split_legacy(data)
        if schema == HARDWARE_SCHEMA:
            return HardwareProfile.from_dict(data), None
    except (TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{name_or_path}: malformed profile ({exc})") from None
    raise ConfigError(f"{name_or_path}: not a hardware profile (schema {schema!r})")


def _read_engine(name_or_path: str) -> EngineProfile:
    key = name_or_path.strip().lower()
    if key in BUILTIN_ENGINES:
        return BUILTIN_ENGINES[key]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"unknown engine profile {name_or_path!r}: give one of {', '.join(BUILTIN_ENGINES)} "
                          "or an engine profile JSON")
    data = read_profile_file(name_or_path, ", ".join(BUILTIN_ENGINES))
    try:
        return EngineProfile.from_dict(data["engine"] if data.get("schema") == PROFILE_SCHEMA else data)
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"{name_or_path}: malformed engine profile ({exc})") from None


_LEGACY_HARDWARE = ("name", "kind", "peak_flops", "memory_bandwidth", "memory_bytes", "interconnect_bandwidth",
                    "dtype", "source")


def _split_legacy(data: dict[str, Any]) -> tuple[HardwareProfile, EngineProfile]:
    """A profile of the first schema: the hardware and the engine's factors in one record."""
    engine_fields = {f.name for f in dataclasses.fields(EngineProfile)}
    unknown = set(data) - set(_LEGACY_HARDWARE) - engine_fields - {"schema"}
    if unknown:
        raise ConfigError(f"not a hardware profile: unknown fields {sorted(unknown)}")
    hw = HardwareProfile(**{k: data[k] for k in _LEGACY_HARDWARE if k in data})
    engine = {k: v for k, v in data.items() if k in engine_fields and k not in ("name", "kind", "source")}
    return hw, EngineProfile(name="inflight", kind=hw.kind, source=data.get("source", ""), **engine)
