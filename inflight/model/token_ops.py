"""The token-wise operations of a decoder layer: RMSNorm and LayerNorm (with the residual add
folded in; RMSNorm over q and k too), rotary embedding and the MLP's activation (SwiGLU's,
GeGLU's, an ungated one's).

`TorchTokenOps` is plain PyTorch and runs on any device and dtype. `CpuKernelTokenOps` does the
same arithmetic in fp32 with the compiled CPU kernels (`kernels.py`), one call where PyTorch
needs several: at a decode step's few rows each op's dispatch costs more than its arithmetic.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F


class KVStore(NamedTuple):
    """Where a layer's new K/V go: its pool tensors `[num_slots, KV, D]` and one slot per token."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


class TorchTokenOps:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.eps = eps

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return weight * normed.to(x.dtype)

    def add_rms_norm_(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`hidden += delta` in place, then the norm of the result."""
        hidden.add_(delta)
        return self.rms_norm(hidden, weight)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """LayerNorm of each row, times `weight`, plus `bias` where there is one (computed in fp32,
        as transformers' Command R computes it)."""
        if x.dtype == torch.float32:
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        normed = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(),
                              self.eps)
        return normed.to(x.dtype)

    def add_layer_norm_(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """`hidden += delta` in place, then the LayerNorm of the result."""
        hidden.add_(delta)
        return self.layer_norm(hidden, weight, bias)

    def rotary(
        self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Splits the fused projection `[N, (H + 2 KV) * D]` into q `[N, H, D]`, k and v
        `[N, KV, D]`, with the rotary embedding applied to q and k (cos/sin: `[max_pos, D]`).
        With `kv_store`, also writes each token's k and v into its slot of the KV pool."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos_p = cos.index_select(0, positions).unsqueeze(1)
        sin_p = sin.index_select(0, positions).unsqueeze(1)
        q = _rotate_half(q.view(n, self.num_heads, self.head_dim), cos_p, sin_p)
        k = _rotate_half(k.view(n, self.num_kv_heads, self.head_dim), cos_p, sin_p)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if kv_store is not None:
            _store(kv_store, k, v)
        return q, k, v

    def rotary_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of the fused projection's q and k, in place; returns `qkv`."""
        n = qkv.shape[0]
        q, k, _ = self.rotary(qkv, positions, cos, sin)
        qkv[:, :self.q_size].copy_(q.reshape(n, self.q_size))
        qkv[:, self.q_size:self.q_size + self.kv_size].copy_(k.reshape(n, self.kv_size))
        return qkv

    def store_kv(self, qkv: torch.Tensor, kv_store: KVStore) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Writes each token's k and v of the fused projection to its slot of the KV pool; returns
        q `[N, H, D]`, k and v `[N, KV, D]`, as `rotary` does."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.reshape(n, -1, self.head_dim) for t in (q, k, v))
        _store(kv_store, k, v)
        return q, k, v

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def relu_squared(self, up: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(up))

    def gelu_tanh(self, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(up, approximate="tanh")

    def xielu(self, up: torch.Tensor, alpha_p: float, alpha_n: float, beta: float, eps: float) -> torch.Tensor:
        """Apertus's xIELU with its numbers after the softplus (`xielu_numbers`): alpha_p x^2 + beta x
        where x > 0, else (expm1(min(x, eps)) - x) alpha_n + beta x."""
        return torch.where(up > 0, alpha_p * up * up + beta * up,
                           (torch.expm1(torch.clamp(up, max=eps)) - up) * alpha_n + beta * up)

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's experts' gate: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g the
        gate clamped above at `limit`."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))

    def short_conv_(self, bcx: torch.Tensor, taps: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
                    conv_slots: torch.Tensor) -> torch.Tensor:
        """LFM2's short convolution: `bcx` `[N, 3H]` holds each token's b, c and x thirds; b * x is
        written to the token's slot of `pool` `[num_slots, H]` (in the pool's dtype), then each token
        gets c * the sum over the convolution's taps `[H, K]` of the values at its `conv_slots`
        `[N, K]` (the K positions up to its own, oldest first; -1 before the first position: 0)."""
        b, c, x = bcx.chunk(3, dim=-1)
        pool.index_copy_(0, slot_mapping, (b * x).to(pool.dtype))
        read = pool.index_select(0, conv_slots.clamp(min=0).flatten()).view(*conv_slots.shape, -1).to(bcx.dtype)
        read = torch.where(conv_slots.unsqueeze(-1) >= 0, read, torch.zeros((), dtype=read.dtype, device=read.device))
        out = torch.zeros_like(c)
        for j in range(conv_slots.shape[1]):  # in tap order, as the compiled kernel sums them
            out = out + taps[:, j].to(bcx.dtype) * read[:, j]
        return c * out

    def qk_norm_(self, qkv: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q and k of the fused projection `[N, (H + 2 KV) * D]` RMS-normalized in place, by
        `scales` (q's, k's), in groups of each scale's length: a head (D) or the whole
        projection (H * D, KV * D). Returns `qkv`."""
        n = qkv.shape[0]
        start = 0
        for size, scale in ((self.q_size, scales[0]), (self.kv_size, scales[1])):
            part = qkv[:, start:start + size]
            group = scale.shape[0]
            part.copy_(self.rms_norm(part.reshape(-1, group), scale).view(n, size))
            start += size
        return qkv


def _store(kv_store: KVStore, k: torch.Tensor, v: torch.Tensor) -> None:
    """Each token's k and v `[N, KV, D]` into its slot of the KV pool, in the pool's dtype."""
    kv_store.k_cache.index_copy_(0, kv_store.slot_mapping, k.to(kv_store.k_cache.dtype))
    kv_store.v_cache.index_copy_(0, kv_store.slot_mapping, v.to(kv_store.v_cache.dtype))


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class CpuKernelTokenOps(TorchTokenOps):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, kernels: ModuleType) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, eps)
        self.kernels = kernels
        self.head_counts = [num_heads, num_kv_heads, num_kv_heads]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, self.eps)

    def add_rms_norm_(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.add_rms_norm_(hidden, delta.contiguous(), weight, self.eps)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.layer_norm(x.contiguous(), weight, bias, self.eps)

    def add_layer_norm_(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.add_layer_norm_(hidden, delta.contiguous(), weight, bias, self.eps)

    def rotary(
        self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if kv_store is None:
            self.kernels.rotary_qk_(qkv, positions, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            self.kernels.rotary_qk_(qkv, positions, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                                    *kv_store)
        return self._heads(qkv)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's q `[N, H, D]`, k and v `[N, KV, D]`, views. One view split once
        along the heads: a few microseconds, where split() and a view of each part, or three
        slices, cost 10-20 (a decode step does this 30 times)."""
        heads = qkv.view(qkv.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split_with_sizes(self.head_counts, dim=1)
        return q, k, v

    def rotary_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.kernels.rotary_qk_(qkv, positions, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        return qkv

    def store_kv(self, qkv: torch.Tensor, kv_store: KVStore) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.kernels.store_kv_(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *kv_store)
        return self._heads(qkv)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up.contiguous())

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.gelu_tanh_and_mul(gate_up.contiguous())

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return self.kernels.clamped_swiglu(gate_up.contiguous(), alpha, limit)

    def relu_squared(self, up: torch.Tensor) -> torch.Tensor:
        return self.kernels.relu_squared(up.contiguous())

    def gelu_tanh(self, up: torch.Tensor) -> torch.Tensor:
        return self.kernels.gelu_tanh(up.contiguous())

    def xielu(self, up: torch.Tensor, alpha_p: float, alpha_n: float, beta: float, eps: float) -> torch.Tensor:
        return self.kernels.xielu(up.contiguous(), alpha_p, alpha_n, beta, eps)

    def short_conv_(self, bcx: torch.Tensor, taps: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
                    conv_slots: torch.Tensor) -> torch.Tensor:
        return self.kernels.short_conv_(bcx, taps, pool, slot_mapping, conv_slots)

    def qk_norm_(self, qkv: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.kernels.qk_norm_(qkv, scales[0], scales[1], self.num_heads, self.num_kv_heads, self.head_dim, self.eps)
        return qkv
