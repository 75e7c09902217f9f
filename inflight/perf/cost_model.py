"""Time of one forward step from its composition, by roofline.

Each request in a step computes `num_new_tokens` tokens and ends with `context_len` tokens of
KV. Per device, with tensor parallelism over `tp` devices:

- linear layers: `2 * tokens * params` FLOPs (the LM head only on sampled rows) against the peak
  FLOP/s of their compute type (the 8-bit tensor-core peak for fp8 or int8 weights where the
  device has one), and every weight read once, in its own type, against the memory bandwidth: a
  checkpoint's matrices kept as stored (a GGUF file's blocks, `MatmulStorage`) at their own bytes;
- attention, per request: `4 * layers * heads * head_dim` FLOPs per (query, key) pair, causal,
  against the peak, and its KV (read whole, new tokens written, in the KV cache's type) against
  the bandwidth;
- compute and memory time combine by the engine's roofline (max, sum or smooth max);
- with `tp > 1`, two all-reduces of the step's activations per layer over the interconnect;
- a fixed cost per layer (kernel launches and the gaps between them; less in a step replayed
  from a CUDA graph) and a CPU overhead per step and per scheduled request, which an engine
  that overlaps scheduling hides behind the device's work;
- where the engine profile says so (a CPU BLAS), matmuls of a few rows run one row at a time,
  each extra row costing about another pass over the weights, and larger ones pay once per step
  for packing the weights;
- where the engine profile says so (inflight's CPU kernels, which read a checkpoint's blocks as
  stored), each stored parameter a step reads costs a fixed time for decoding its block, once per
  step, beside its bytes.

Peaks come from the hardware profile; efficiencies and overheads from the engine profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from inflight.config import DTYPE_BYTES, MatmulStorage, ModelConfig, normalize_dtype
from inflight.errors import ConfigError
from inflight.perf.profiles import EngineProfile, HardwareProfile, default_engine
from inflight.perf.shapes import (
    expert_params,
    experts_touched,
    num_active_linear_params,
    num_dense_linear_params,
    num_expert_layers,
    num_linear_params,
    num_params,
)

COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


class SeqWork(NamedTuple):
    """One request's share of a step."""

    num_new_tokens: int
    context_len: int  # tokens in its KV after the step, new ones included
    # LM-head rows: 1 (True) when the step yields its next token, 1 + k when it verifies k
    # proposed tokens (speculative decoding), 0 (False) for a prompt chunk short of its end.
    samples: int


class StepTimeModel(Protocol):
    """Seconds of one step from its composition: `CostModel`, or a stand-in."""

    def step_time(self, batch: Sequence[SeqWork]) -> float: ...


class StepWork(NamedTuple):
    """What one step asks of one device, before any efficiency factor."""

    num_requests: int
    num_tokens: int
    linear_compute_s: float  # the linear layers' FLOPs over their compute type's peak
    linear_bytes: float
    attention: list[tuple[float, float]]  # per request: (FLOPs, KV bytes)
    num_layers: int  # layers the step runs: the model's, or none in an empty step
    graphed: bool  # replayed from a CUDA graph
    num_allreduces: int
    allreduce_bytes: float  # what each device sends over the link, all of the step's all-reduces
    kept_params: float = 0.0  # matmul parameters a step decodes from blocks, in Q4_1's decoding cost


class StepCost(NamedTuple):
    linear_s: float
    attention_s: float
    comm_s: float
    launch_s: float  # the per-layer fixed cost
    overhead_s: float  # CPU work of the step
    overlapped: bool = False  # the overhead runs while the device computes

    @property
    def device_s(self) -> float:
        return self.linear_s + self.attention_s + self.comm_s + self.launch_s

    @property
    def total_s(self) -> float:
        if self.overlapped:
            return max(self.device_s, self.overhead_s)
        return self.device_s + self.overhead_s


def combine(compute_s: float, memory_s: float, engine: EngineProfile) -> float:
    """A kernel's time from its compute-bound and memory-bound times, by the engine's roofline."""
    if engine.roofline == "max":
        return max(compute_s, memory_s)
    if engine.roofline == "sum":
        return compute_s + memory_s
    top = max(compute_s, memory_s)
    if top <= 0:
        return 0.0
    k = engine.roofline_exponent
    return top * ((compute_s / top) ** k + (memory_s / top) ** k) ** (1 / k)


class CostModel:
    def __init__(self, model: ModelConfig, hardware: HardwareProfile, tp: int = 1, dtype: str | None = None,
                 engine: EngineProfile | None = None, weight_dtype: str | None = None,
                 kv_cache_dtype: str | None = None, matmul_storage: MatmulStorage | None = None) -> None:
        """`matmul_storage`: the matmul weights as a step reads them (a checkpoint's matrices kept
        as stored: their bytes, and their blocks' decoding), where the engine profile was fitted so
        (`weights_as_stored`, or its `as_stored` factors for a checkpoint stored otherwise than the
        one it was calibrated on: `EngineProfile.for_storage`); None, an 8-bit `weight_dtype`, or
        a profile fitted before: every weight in the weight type, nothing decoded."""
        dtype = normalize_dtype(dtype, hardware.dtype, "dtype")
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype {dtype} is a storage type; compute runs in {', '.join(COMPUTE_DTYPES)}")
        if tp < 1 or model.num_heads % tp:
            raise ConfigError(f"--tp {tp} must be >= 1 and divide the model's {model.num_heads} heads")
        if tp > 1 and hardware.interconnect_bandwidth <= 0:
            raise ConfigError(f"hardware {hardware.name} has no interconnect for --tp {tp}")
        self.model = model
        self.hardware = hardware
        self.engine = engine or default_engine(hardware)
        if self.engine.kind != hardware.kind:
            raise ConfigError(f"engine profile {self.engine.name} is for a {self.engine.kind}; "
                              f"{hardware.name} is a {hardware.kind}")
        self.tp = tp
        self.dtype = dtype
        self.weight_dtype = normalize_dtype(weight_dtype, dtype, "weight dtype")
        if matmul_storage is not None and self.weight_dtype == dtype:
            self.engine = self.engine.for_storage(matmul_storage._asdict())
        self.matmul_storage = matmul_storage if self.weight_dtype == dtype and self.engine.weights_as_stored else None
        self.kv_cache_dtype = normalize_dtype(kv_cache_dtype, dtype, "KV cache dtype")
        self.dtype_bytes = DTYPE_BYTES[dtype]
        a, w = self.dtype_bytes, DTYPE_BYTES[self.weight_dtype]
        hw = hardware
        eight_bit_peak = {"fp8": hw.peak_flops_fp8, "int8": hw.peak_flops_int8}.get(self.weight_dtype, 0.0)
        # Without 8-bit tensor cores the weights are dequantized into a matmul of the compute type.
        self.linear_peak_flops = eight_bit_peak or hw.peak_flops
        self.linear_flops_efficiency = ((eight_bit_peak and self.engine.eight_bit_flops_efficiency)
                                        or self.engine.flops_efficiency)
        linear = num_linear_params(model)
        head = model.vocab_size * model.hidden_size
        # The LM head and the embedding stay in the activations' type, as in quantized checkpoints,
        # unless the engine quantizes its head with the rest (`quantized_lm_head`: then it is an
        # 8-bit matmul among them, a tied one an 8-bit copy of the embedding).
        # A token computes with its routed experts only; a step reads the weights of every expert
        # one of its tokens chose (`experts_touched`) besides the dense ones.
        head_8bit = bool(eight_bit_peak) and self.engine.quantized_lm_head
        stored = self.matmul_storage or MatmulStorage(w, w, w if head_8bit else a)
        self._linear_s_per_token = 2 * num_active_linear_params(model) / tp / self.linear_peak_flops
        self._head_s_per_row = 2 * head / tp / (self.linear_peak_flops if head_8bit else hardware.peak_flops)
        routers = num_expert_layers(model) * model.num_experts * model.hidden_size
        self._linear_weight_bytes = (num_dense_linear_params(model) + routers) * stored.dense / tp
        self._expert_weight_bytes = num_expert_layers(model) * expert_params(model) * stored.experts / tp
        self._head_weight_bytes = head * stored.head / tp
        # Parameters whose blocks a step decodes (once, whatever its rows: into registers for a few
        # rows, into fp32 panels for more), where the profile prices that (`block_decode_s` in a
        # step of one token, whose matmuls are a vector's; `block_decode_rows_s` in a step of more).
        weights = self.engine.block_decode_weights  # each block type's decoding against Q4_1's
        self._linear_kept = (num_dense_linear_params(model) + routers) * stored.decoded("dense", weights) / tp
        self._expert_kept = num_expert_layers(model) * expert_params(model) * stored.decoded("experts", weights) / tp
        self._head_kept = head * stored.decoded("head", weights) / tp
        self._attn_flops_per_pair = 4 * model.num_attention_layers * (model.num_heads // tp) * model.head_dim
        # KV heads are split over the devices, replicated when there are fewer than devices.
        self.kv_heads_per_device = -(-model.num_kv_heads // tp)
        kv = DTYPE_BYTES[self.kv_cache_dtype]
        # What attention reads of each context token, and what the pool holds of it: K and V (latent
        # attention's one row, read as both), and each short convolution's input (LFM2's: a row of
        # hidden_size, of which a step reads a few)
        self._attn_bytes_per_token = (model.kv_rows * model.num_attention_layers * self.kv_heads_per_device
                                      * model.head_dim * kv)
        self.kv_bytes_per_token = self._attn_bytes_per_token + sum(model.conv_layers or ()) * -(
            -model.hidden_size // tp) * kv
        self.weight_bytes_per_device = (linear * w + (num_params(model) - linear) * a) / tp
        if self.matmul_storage is not None:  # the matrices as stored; a tied head the embedding's
            experts = num_expert_layers(model) * model.num_experts * expert_params(model)
            self.weight_bytes_per_device += ((linear - experts) * (stored.dense - w) + experts * (stored.experts - w)
                                             + head * (stored.head - a)) / tp
        elif head_8bit:  # an untied head 8-bit in place of its own type; a tied one an 8-bit copy
            self.weight_bytes_per_device += head * (w - (0 if model.tie_word_embeddings else a)) / tp

    # --- amounts --------------------------------------------------------------------------------

    def work(self, batch: Iterable[SeqWork]) -> StepWork:
        num_tokens = num_rows = num_requests = 0
        decode_only = True
        attention: list[tuple[float, float]] = []
        pair_flops, kv_bytes = self._attn_flops_per_pair, self._attn_bytes_per_token
        for n, context, samples in batch:
            num_tokens += n
            num_rows += samples
            num_requests += 1
            decode_only = decode_only and n == 1
            start = context - n
            pairs = n * start + n * (n + 1) // 2  # causal: query i sees start + i + 1 keys
            attention.append((pairs * pair_flops, (context + n) * kv_bytes))
        compute_s = num_tokens * self._linear_s_per_token + num_rows * self._head_s_per_row
        touched = experts_touched(self.model, num_tokens)
        weight_bytes = ((self._linear_weight_bytes if num_tokens else 0.0) + self._expert_weight_bytes * touched
                        + (self._head_weight_bytes if num_rows else 0.0))
        layers = self.model.num_layers if num_tokens else 0
        kept = ((self._linear_kept if num_tokens else 0.0) + self._expert_kept * touched
                + (self._head_kept if num_rows else 0.0))
        allreduces = 2 * layers if self.tp > 1 else 0
        # A ring all-reduce sends 2 (tp - 1) / tp of the message from each device.
        message = num_tokens * self.model.hidden_size * self.dtype_bytes
        sent = allreduces * 2 * (self.tp - 1) / self.tp * message
        return StepWork(num_requests, num_tokens, compute_s, weight_bytes, attention, layers,
                        self.engine.graphed(num_requests, decode_only), allreduces, sent, kept)

    # --- time -----------------------------------------------------------------------------------

    def cost(self, work: StepWork) -> StepCost:
        hw, eng = self.hardware, self.engine
        bytes_rate = hw.memory_bandwidth * eng.bandwidth_efficiency
        attn_flops_rate = hw.peak_flops * eng.attention_flops_efficiency
        kv_rate = hw.memory_bandwidth * eng.attention_bandwidth_efficiency
        # Decoding blocks is the cores' work beside the multiply-adds, both hidden under the weights'
        # reads as far as the roofline says.
        decode = work.kept_params * (eng.block_decode_s if work.num_tokens == 1 else eng.block_decode_rows_s)
        linear = combine(work.linear_compute_s / self.linear_flops_efficiency + decode,
                         work.linear_bytes / bytes_rate, eng)
        if 2 <= work.num_tokens <= eng.small_batch_max_rows:
            linear += (work.num_tokens - 1) * eng.small_batch_row_s
        elif work.num_tokens >= 2:
            linear += eng.gemm_step_s
        attention = sum(combine(f / attn_flops_rate, b / kv_rate, eng) for f, b in work.attention)
        comm = 0.0
        if work.num_allreduces:
            latency = eng.allreduce_latency_s + eng.allreduce_peer_latency_s * (self.tp - 1)
            link = hw.interconnect_bandwidth * eng.allreduce_bandwidth_efficiency
            comm = work.num_allreduces * latency + work.allreduce_bytes / link
        launch = work.num_layers * (eng.graph_layer_overhead_s if work.graphed else eng.layer_overhead_s)
        overhead = eng.step_overhead_s + eng.request_overhead_s * work.num_requests
        return StepCost(linear, attention, comm, launch, overhead, eng.overlap_scheduling)

    def step_time(self, batch: Sequence[SeqWork]) -> float:
        """Seconds of one step; an empty step costs the step overhead alone."""
        return self.cost(self.work(batch)).total_s

    # --- memory ---------------------------------------------------------------------------------

    def for_draft(self, shapes: ModelConfig, matmul_storage: MatmulStorage | None = None) -> CostModel:
        """The cost of a draft model's forward pass on the same device and types (its matrices
        kept as stored at `matmul_storage`): a pass inside the step (a forward and an argmax),
        without the step's own overhead (scheduling, sampling, output processing), which the step
        pays once."""
        draft = CostModel(shapes, self.hardware, self.tp, self.dtype, self.engine, self.weight_dtype,
                          self.kv_cache_dtype, matmul_storage)
        draft.engine = dataclasses.replace(draft.engine, step_overhead_s=0.0)  # after its storage chose its factors
        return draft

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def num_kv_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9,
                      kv_cache_memory_fraction: float = 0.1, kv_cache_memory_bytes: int | None = None) -> int:
        """KV blocks that fit on each device: `kv_cache_memory_bytes` if given (on a GPU too, as
        vLLM's option of that name); else a GPU gives `gpu_memory_utilization` of its memory to
        the engine, as vLLM does, and the KV pool gets what the weights leave of it, while a CPU
        engine gives its pool `kv_cache_memory_fraction` of the memory, as inflight does."""
        hw = self.hardware
        if kv_cache_memory_bytes is not None:
            budget = float(kv_cache_memory_bytes)
        elif hw.kind == "cpu":
            budget = kv_cache_memory_fraction * hw.memory_bytes
        else:
            budget = hw.memory_bytes * gpu_memory_utilization - self.weight_bytes_per_device
        num_blocks = int(budget // self.kv_bytes_per_block(block_size))
        if num_blocks < 1:
            need = self.weight_bytes_per_device / 1e9
            raise ConfigError(f"{hw.name} x{self.tp}: no room for the KV cache (weights take {need:.1f} GB "
                              f"per device of {hw.memory_bytes / 1e9:.0f} GB); raise --tp")
        return num_blocks

    def describe(self) -> str:
        """The engine profile and the types, for titles and run records."""
        types = self.dtype if self.weight_dtype == self.kv_cache_dtype == self.dtype else (
            f"{self.dtype}, weights {self.weight_dtype}, KV {self.kv_cache_dtype}")
        return f"{self.engine.name} ({types})"
