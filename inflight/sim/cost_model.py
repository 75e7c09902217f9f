"""Time of one forward step from its composition, by roofline.

Each request in a step computes `num_new_tokens` tokens and ends with `context_len` tokens of
KV. Per device, with tensor parallelism over `tp` devices:

- linear layers: `2 * tokens * params` FLOPs (the LM head only on sampled rows) against the peak
  FLOP/s, and every weight read once against the memory bandwidth; the slower bound wins;
- attention, per request: `4 * layers * heads * head_dim` FLOPs per (query, key) pair, causal,
  against the peak, and its KV (read whole, new tokens written) against the bandwidth;
- with `tp > 1`, two ring all-reduces of the step's activations per layer over the interconnect;
- a fixed overhead per step and per scheduled request (the CPU side of a step);
- where the profile says so (a CPU BLAS), matmuls of a few rows run one row at a time, each
  extra row costing about another pass over the weights, and larger ones pay once per step
  for packing the weights.

Peaks come from the hardware profile, scaled by its efficiency factors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from inflight.config import ModelConfig
from inflight.errors import ConfigError
from inflight.sim.hardware import HardwareProfile
from inflight.sim.shapes import num_linear_params, num_params

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class SeqWork(NamedTuple):
    """One request's share of a step."""

    num_new_tokens: int
    context_len: int  # tokens in its KV after the step, new ones included
    samples: bool  # whether the step yields its next token (an LM-head row)


class StepWork(NamedTuple):
    """What one step asks of one device, before any efficiency factor."""

    num_requests: int
    num_tokens: int
    linear_flops: float
    linear_bytes: float
    attention: list[tuple[float, float]]  # per request: (FLOPs, KV bytes)
    comm_s: float


class StepCost(NamedTuple):
    linear_s: float
    attention_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s + self.comm_s + self.overhead_s


class CostModel:
    def __init__(self, model: ModelConfig, hardware: HardwareProfile, tp: int = 1,
                 dtype: str | None = None) -> None:
        dtype = hardware.dtype if dtype in (None, "auto") else dtype
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {dtype!r}")
        if tp < 1 or model.num_heads % tp:
            raise ConfigError(f"--tp {tp} must be >= 1 and divide the model's {model.num_heads} heads")
        if tp > 1 and hardware.interconnect_bandwidth <= 0:
            raise ConfigError(f"hardware {hardware.name} has no interconnect for --tp {tp}")
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.dtype = dtype
        self.dtype_bytes = DTYPE_BYTES[dtype]
        b = self.dtype_bytes
        self._linear_flops_per_token = 2 * num_linear_params(model) / tp
        self._head_flops_per_row = 2 * model.vocab_size * model.hidden_size / tp
        self._linear_weight_bytes = num_linear_params(model) * b / tp
        self._head_weight_bytes = model.vocab_size * model.hidden_size * b / tp
        self._attn_flops_per_pair = 4 * model.num_layers * (model.num_heads // tp) * model.head_dim
        # KV heads are split over the devices, replicated when there are fewer than devices.
        self.kv_heads_per_device = -(-model.num_kv_heads // tp)
        self.kv_bytes_per_token = 2 * model.num_layers * self.kv_heads_per_device * model.head_dim * b
        self.weight_bytes_per_device = num_params(model) * b / tp

    # --- amounts --------------------------------------------------------------------------------

    def work(self, batch: Iterable[SeqWork]) -> StepWork:
        num_tokens = num_rows = num_requests = 0
        attention: list[tuple[float, float]] = []
        pair_flops, kv_bytes = self._attn_flops_per_pair, self.kv_bytes_per_token
        for n, context, samples in batch:
            num_tokens += n
            num_rows += samples
            num_requests += 1
            start = context - n
            pairs = n * start + n * (n + 1) // 2  # causal: query i sees start + i + 1 keys
            attention.append((pairs * pair_flops, (context + n) * kv_bytes))
        flops = num_tokens * self._linear_flops_per_token + num_rows * self._head_flops_per_row
        weight_bytes = ((self._linear_weight_bytes if num_tokens else 0.0)
                        + (self._head_weight_bytes if num_rows else 0.0))
        return StepWork(num_requests, num_tokens, flops, weight_bytes, attention, self.comm_time(num_tokens))

    def comm_time(self, num_tokens: int) -> float:
        """Two ring all-reduces of the activations per layer (after attention and after the MLP)."""
        if self.tp == 1 or num_tokens == 0:
            return 0.0
        hw = self.hardware
        size = num_tokens * self.model.hidden_size * self.dtype_bytes
        one = hw.allreduce_latency_s + 2 * (self.tp - 1) / self.tp * size / hw.interconnect_bandwidth
        return 2 * self.model.num_layers * one

    # --- time -----------------------------------------------------------------------------------

    def cost(self, work: StepWork) -> StepCost:
        hw = self.hardware
        flops_rate = hw.peak_flops * hw.flops_efficiency
        bytes_rate = hw.memory_bandwidth * hw.bandwidth_efficiency
        attn_flops_rate = hw.peak_flops * hw.attention_flops_efficiency
        kv_rate = hw.memory_bandwidth * hw.attention_bandwidth_efficiency
        combine = max if hw.roofline == "max" else _add
        linear = combine(work.linear_flops / flops_rate, work.linear_bytes / bytes_rate)
        if 2 <= work.num_tokens <= hw.small_batch_max_rows:
            linear += (work.num_tokens - 1) * hw.small_batch_row_s
        elif work.num_tokens >= 2:
            linear += hw.gemm_step_s
        attention = sum(combine(f / attn_flops_rate, b / kv_rate) for f, b in work.attention)
        overhead = hw.step_overhead_s + hw.request_overhead_s * work.num_requests
        return StepCost(linear, attention, work.comm_s, overhead)

    def step_time(self, batch: Sequence[SeqWork]) -> float:
        """Seconds of one step; an empty step costs the step overhead alone."""
        return self.cost(self.work(batch)).total_s

    # --- memory ---------------------------------------------------------------------------------

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


def _add(a: float, b: float) -> float:
    return a + b
