"""DeepSeek's multi-head latent attention (MLA), as the plan's `latent_attention` step runs it.

A token's keys and values are one low-rank latent (`kv_lora_rank` wide, RMS-normalized) that each
head's key and value are projected up from, beside a small key part every head shares, which the
rotary turns. The pool keeps that latent and that part, one row a token a layer (576 values in
DeepSeek V2 and V3: a ninth of the keys and values of V2-Lite's 16 heads, a seventy-first of V3's
128 heads'), and attention never builds the heads' keys or values: each head's
query is taken into the latent's space instead (q_nope @ W_UK: the key's up-projection, absorbed
into the query), so that one key head of `kv_lora_rank + qk_rope_head_dim` serves every query
head, and the weighted sum of the rows it reads is projected up to each head's value after
attention (W_UV). This is the form DeepSeek's, vLLM's and llama.cpp's decoders run; its scores are
those of the expanded form (the same sums in another order), which transformers computes.

Attention reads the row as both key and value: the value's first `kv_lora_rank` entries are the
latent, and the rest of each output (the rotated part's weighted sum) is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from inflight.config import LatentAttention

if TYPE_CHECKING:
    from inflight.model.attention import AttentionMetadata, PagedAttention
    from inflight.model.linear import Linear

# The epsilon of the latent's and the query rank's RMSNorms: transformers' default for them in
# every latent-attention model (the layers' norms take the config's `rms_norm_eps`).
LATENT_NORM_EPS = 1e-6


class LatentWeights(NamedTuple):
    """A latent-attention layer's weights beside its fused projection and its output matmul."""

    kv_norm: torch.Tensor  # the latent's RMSNorm scale `[kv_lora_rank]`
    # each head's key up-projection `[heads, qk_nope_head_dim, kv_lora_rank]` in fp32, or as stored a
    # matmul a head (`[kv_lora_rank, qk_nope_head_dim]`: the query's part into the latent's space)
    k_up: torch.Tensor | list[Linear]
    # each head's value up-projection `[heads, v_head_dim, kv_lora_rank]`, or a matmul a head
    v_up: torch.Tensor | list[Linear]
    q_norm: torch.Tensor | None = None  # the query rank's RMSNorm scale (None: no rank)
    q_up: Linear | None = None  # the query rank's up-projection to every head's query

    @property
    def head_matmuls(self) -> list[Linear]:
        """The up-projections' matmuls a head (the key's, then the value's), where kept as stored."""
        return [*self.k_up, *self.v_up] if isinstance(self.k_up, list) and isinstance(self.v_up, list) else []

    @staticmethod
    def split_kv_up(kv_up: torch.Tensor, shape: LatentAttention, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A checkpoint's `kv_b_proj` `[heads * (nope + v), kv_lora_rank]`, each head's key rows then
        its value rows, as (k_up, v_up)."""
        per_head = kv_up.view(num_heads, shape.qk_nope_head_dim + shape.v_head_dim, shape.kv_lora_rank)
        k_up, v_up = per_head.split([shape.qk_nope_head_dim, shape.v_head_dim], dim=1)
        return k_up.contiguous(), v_up.contiguous()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm computed in fp32, as transformers' DeepSeek norms compute it."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, LATENT_NORM_EPS)
    return weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotary embedding of `x`'s last dim, pairs (2i, 2i + 1) where `interleaved` (DeepSeek's
    layout), else (i, i + half); the result in halves either way (the same for queries and keys,
    so their dot products are those of the stored layout)."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _per_head(matmuls: list[Linear], x: torch.Tensor) -> torch.Tensor:
    """Head h of `x` `[tokens, heads, in]` through `matmuls[h]`, `[tokens, heads, out]`."""
    return torch.stack([up(x[:, h]) for h, up in enumerate(matmuls)], dim=1)


def latent_attention(x: torch.Tensor, weights: LatentWeights, shape: LatentAttention, num_heads: int,
                     positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                     meta: AttentionMetadata, attention: PagedAttention) -> torch.Tensor:
    """One layer's latent attention over the step's tokens. `x` `[tokens, q + kv_lora_rank +
    qk_rope_head_dim]` is the fused projection (q: the query rank's width, or every head's query
    where there is none); `cos` and `sin` the model's rotary table (the rotated dims' frequencies
    first); `pool` this layer's rows `[slots, 1, kv_lora_rank + qk_rope_head_dim]`. Writes each
    token's row to its slot and returns each head's value `[tokens, heads * v_head_dim]`."""
    tokens = x.shape[0]
    rank, rope, nope = shape.kv_lora_rank, shape.qk_rope_head_dim, shape.qk_nope_head_dim
    q, kv = x.split([x.shape[1] - rank - rope, rank + rope], dim=1)
    if weights.q_up is not None:
        assert weights.q_norm is not None
        q = weights.q_up(_rms_norm(q, weights.q_norm))
    q_nope, q_rope = q.reshape(tokens, num_heads, nope + rope).split([nope, rope], dim=2)
    freq_cos, freq_sin = cos[positions, :rope // 2], sin[positions, :rope // 2]
    k_rope = _rotate(kv[:, rank:], freq_cos, freq_sin, shape.rope_interleaved)
    row = torch.cat([_rms_norm(kv[:, :rank], weights.kv_norm), k_rope], dim=1)
    pool.view(-1, rank + rope).index_copy_(0, meta.slot_mapping, row.to(pool.dtype))
    # Each head's query in the latent's space: q_nope @ W_UK, a matmul a head on inflight's CPU
    # kernels (the file's blocks or fp32 panels: a token's sums whatever rows share the call), else
    # one batched matmul over the heads.
    if isinstance(weights.k_up, list):
        q_latent = _per_head(weights.k_up, q_nope)
    else:
        q_latent = torch.bmm(q_nope.transpose(0, 1), weights.k_up).transpose(0, 1)
    query = torch.cat([q_latent, _rotate(q_rope, freq_cos[:, None], freq_sin[:, None], shape.rope_interleaved)], dim=2)
    stored = row.view(tokens, 1, rank + rope)
    read = attention.forward(query.contiguous(), stored, stored, pool, pool, meta, kv_stored=True)
    latent = read.view(tokens, num_heads, rank + rope)[:, :, :rank]
    # Each head's value: the latent's weighted sum @ W_UV.
    if isinstance(weights.v_up, list):
        values = _per_head(weights.v_up, latent)
    else:
        values = torch.bmm(latent.transpose(0, 1), weights.v_up.transpose(1, 2)).transpose(0, 1)
    return values.reshape(tokens, num_heads * shape.v_head_dim)
