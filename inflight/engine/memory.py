"""Process-wide allocator settings, page-backed buffers for CPU inference, and the check that
a model fits in memory before it is loaded."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from inflight.config import ENGINE_KV_DTYPES, EngineConfig, ModelConfig, SchedulerConfig
from inflight.errors import ConfigError
from inflight.model import packed_cache
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import keeps_blocks
from inflight.model.loader import ModelSource, WeightFootprint, load_model_config, weight_footprint

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_configured = False


def keep_freed_memory() -> None:
    """Stops glibc from handing freed tensors back to the kernel.

    By default glibc serves allocations above 128 KiB with fresh mmap()s and unmaps them on
    free, so every step's activations (megabytes each) are page-faulted in anew: on a 2-core
    CPU that made a gather of cached KV blocks 8x slower than the copy itself. Raising the mmap
    and trim thresholds lets freed blocks be reused from the heap. A no-op off glibc.
    """
    global _configured
    if _configured:
        return
    _configured = True
    libc = _libc()
    if libc is None:
        return
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except AttributeError:  # not glibc
        return
    if not ok:
        logger.debug("mallopt refused the allocator settings")


_MADV_HUGEPAGE = 14  # Linux
_HUGE_PAGE = 2 * 1024 * 1024


def huge_page_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory Linux is asked to back with 2 MiB pages.

    The KV pool is read in 12 KiB blocks at random places: with 4 KiB pages nearly every block
    costs TLB misses, and the decode-attention kernel read a scattered pool 1.1-1.2x faster
    from 2 MiB pages (`benchmarks/kernels_bench.py`). The buffer is over-allocated by one huge
    page so that a 2 MiB-aligned view of it can be advised (MADV_HUGEPAGE) before it is first
    touched; the zeroing then faults it in as huge pages where the kernel has them (transparent
    huge pages "always" or "madvise"). Elsewhere, or if madvise fails, it is plain memory.
    """
    numel, itemsize = math.prod(shape), dtype.itemsize
    pad = _HUGE_PAGE // itemsize
    raw = torch.empty(numel + pad, dtype=dtype)
    offset = (-raw.data_ptr() % _HUGE_PAGE) // itemsize
    view = raw.narrow(0, offset, numel)
    libc = _libc()
    if libc is not None and numel * itemsize >= _HUGE_PAGE:
        length = numel * itemsize // _HUGE_PAGE * _HUGE_PAGE
        if libc.madvise(ctypes.c_void_p(view.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused; the buffer keeps normal pages")
    return view.zero_().view(shape)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


# --- does the model fit -----------------------------------------------------------------------

_GIB = 1024 ** 3


def available_memory_bytes(device: torch.device) -> int:
    """Memory this process can still take: CUDA's free memory on a GPU; on CPU the kernel's
    MemAvailable, or less where a cgroup (a container's limit) allows less."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        raise ConfigError("cannot read available memory; set num_kv_blocks or kv_cache_memory_bytes")
    limited = _cgroup_available()
    return available if limited is None else min(available, limited)


def _cgroup_available() -> int | None:
    """cgroup v2's limit less what the group uses (its reclaimable page cache not counted)."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((root / "memory.current").read_text())
        stat = dict(line.split() for line in (root / "memory.stat").read_text().splitlines())
        return max(0, int(limit) - used + int(stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        return None


def select_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for `kv_cache_dtype` (already normalized) beside activations of
    `dtype`: auto is `dtype`; the simulator's other types are refused in one line."""
    if name == "auto":
        return dtype
    if name not in ENGINE_KV_DTYPES:
        raise ConfigError(f"kv_cache_dtype {name} is priced by `inflight sim` only; the engine stores "
                          f"{', '.join(ENGINE_KV_DTYPES)} (or auto: the activations' type)")
    return getattr(torch, name)


def activation_bytes(model: ModelConfig, scheduler: SchedulerConfig, dtype: torch.dtype) -> int:
    """The largest step's working memory: `max_num_tokens` tokens through a layer (hidden states,
    q/k/v, the MLP's widest activations) and their logits twice over (logits and log-softmax:
    prompt logprobs ask for every token's). The PyTorch attention path's score matrices are not
    counted (the compiled kernels keep none)."""
    tokens = scheduler.max_num_tokens
    mlp = max(model.intermediate_size, (model.moe_intermediate_size or 0) * max(model.num_experts_per_tok, 1)
              + (model.shared_expert_intermediate_size or 0))
    width = 4 * model.hidden_size + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim + 3 * mlp
    return tokens * width * dtype.itemsize + 2 * tokens * model.vocab_size * 4


@dataclass(frozen=True)
class MemoryPlan:
    """What one engine of `config` will take, estimated before anything is allocated."""

    weights: WeightFootprint
    kv_pool: int
    activations: int
    available: int
    kv_bytes_per_block: int
    kv_option: str  # how the pool is sized ("" where it is a share of what is left)

    @property
    def total(self) -> int:
        return self.weights.peak + self.kv_pool + self.activations


def plan_memory(config: EngineConfig, source: ModelSource, dtype: torch.dtype, device: torch.device,
                packed: bool) -> MemoryPlan:
    model = load_model_config(source)
    weights = weight_footprint(source, dtype, packed=packed,
                               blocks=keeps_blocks(dtype, device),
                               int8=config.quantization == "int8",
                               positions=config.scheduler.max_model_len if device.type == "cpu" else None)
    cache = config.cache
    kv_dtype = select_kv_dtype(cache.kv_cache_dtype, dtype)
    per_block = model.pool_values_per_token * cache.block_size * kv_dtype.itemsize
    available = available_memory_bytes(device)
    if cache.num_kv_blocks is not None:
        kv, option = cache.num_kv_blocks * per_block, f"num_kv_blocks={cache.num_kv_blocks}"
    elif cache.kv_cache_memory_bytes is not None:
        kv, option = cache.kv_cache_memory_bytes, f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    else:  # a share of what the loaded model leaves (`engine._blocks_for_budget`)
        kv, option = int(cache.kv_cache_memory_fraction * max(0, available - weights.peak)), ""
    return MemoryPlan(weights, kv, activation_bytes(model, config.scheduler, dtype), available, per_block, option)


def check_memory(config: EngineConfig, source: ModelSource, dtype: torch.dtype, device: torch.device,
                 packed: bool, copies: int = 1) -> MemoryPlan:
    """Refuses, before anything is allocated, an engine (or `copies` of it, each its own
    process: what they share is a GGUF file's page cache and, once a large file's packed
    matrices are kept on disk, that mapped copy, counted once) that would not fit in the memory
    available, with one line: what it needs, what is free, and which option would fit. On CPU
    only (a GPU's weights and pool are sized by other rules)."""
    plan = plan_memory(config, source, dtype, device, packed)
    shared = 0
    if copies > 1 and keeps_blocks(dtype, device):
        entry = packed_cache.locate(source, config.quantization, cpu_kernels())
        shared = min(packed_cache.kept_bytes(entry), plan.weights.peak) if entry is not None else 0
    need = shared + copies * (plan.total - shared)
    if device.type != "cpu" or need <= plan.available:
        return plan
    each = "" if copies == 1 else f" each of {copies} replicas"
    mapped = f", {shared / _GIB:.1f} of the weights kept on disk and mapped once" if shared else ""
    said = (f"{source.name} needs about {need / _GIB:.1f} GiB (weights {plan.weights.peak / _GIB:.1f} as inflight "
            f"loads them, KV pool {plan.kv_pool / _GIB:.1f}, activations {plan.activations / _GIB:.1f}{each}{mapped}) "
            f"and {plan.available / _GIB:.1f} GiB is available")
    share = shared + (plan.available - shared) // copies  # what each replica has, the mapped weights counted in
    room = share - plan.weights.peak - plan.activations  # for the pool
    if plan.kv_option and room >= plan.kv_bytes_per_block:
        blocks = room // plan.kv_bytes_per_block
        raise ConfigError(f"{said}: {plan.kv_option} is too large; num_kv_blocks={blocks} "
                          f"({blocks * config.cache.block_size} tokens) would fit")
    per_token = plan.activations / config.scheduler.max_num_tokens
    pool = plan.kv_pool if plan.kv_option else plan.kv_bytes_per_block
    tokens = int((share - plan.weights.peak - pool) // per_token)
    if tokens >= 1:
        raise ConfigError(f"{said}: max_num_tokens={tokens} (now {config.scheduler.max_num_tokens}) would fit")
    fewer = "" if copies == 1 else " or fewer replicas"
    raise ConfigError(f"{said}: the weights alone do not fit; a smaller model{fewer} would")
