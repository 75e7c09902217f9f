"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) on packed tokens.

Every token-wise operation runs on one flattened `[num_tokens, hidden]` tensor holding the new
tokens of all requests in the step; only attention looks at request boundaries, through the
`AttentionMetadata` the runner built (Orca's selective batching).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from inflight.config import ModelConfig
from inflight.errors import ModelLoadError
from inflight.model.attention import AttentionMetadata, PagedAttention
from inflight.model.kernels import cpu_attention_kernels


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the model's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope scaling type {kind!r}")


class LlamaModel:
    """Holds the weights (QKV and gate/up fused) and runs one packed forward step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        self.config = config
        self.device = device

        def take(name: str) -> torch.Tensor:
            try:
                return weights[name].to(device)
            except KeyError:
                raise ModelLoadError(f"checkpoint lacks weight {name}") from None

        self.embed_tokens = take("model.embed_tokens.weight")
        self.dtype = self.embed_tokens.dtype
        self.final_norm = take("model.norm.weight")
        self.lm_head = take("lm_head.weight")
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([take(f"{attn}{n}_proj.bias") for n in "qkv"])
            self.layers.append({
                "input_norm": take(p + "input_layernorm.weight"),
                "qkv": torch.cat([take(f"{attn}{n}_proj.weight") for n in "qkv"]).contiguous(),
                "qkv_bias": qkv_bias,
                "o": take(attn + "o_proj.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]).contiguous(),
                "down": take(p + "mlp.down_proj.weight"),
            })
        kernel = cpu_attention_kernels() if device.type == "cpu" and self.dtype == torch.float32 else None
        self.attention = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim, kernel)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self._rope_inv_freq = rope_inv_freq(config).to(device)
        self._rope_cos, self._rope_sin = self._rope_table(config.max_position_embeddings)

    def _rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(positions, self._rope_inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Runs one step over packed tokens and returns fp32 logits `[len(logits_indices), vocab]`:
        the LM head runs only on the rows whose next token is wanted."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        cos = self._rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self._rope_sin.index_select(0, positions).unsqueeze(1)
        hidden = self.embed_tokens.index_select(0, input_ids)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = self._rms_norm(hidden, layer["input_norm"])
            qkv = F.linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self._rotate(q.view(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)
            k = self._rotate(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attn = self.attention.forward(q, k, v, k_cache, v_cache, attn_meta)
            hidden = hidden + F.linear(attn, layer["o"])
            x = self._rms_norm(hidden, layer["post_norm"])
            gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer["down"])
        hidden = self._rms_norm(hidden.index_select(0, logits_indices), self.final_norm)
        return F.linear(hidden, self.lm_head).float()
