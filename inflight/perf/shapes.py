"""Parameter counts of a decoder's shapes, which the cost model prices."""

from __future__ import annotations

from inflight.config import ModelConfig


def num_linear_params(cfg: ModelConfig) -> int:
    """Parameters of the per-token matmuls of all layers (QKV, output, gate/up, down)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp)


def num_params(cfg: ModelConfig) -> int:
    """All parameters (embedding, layers, norms, LM head unless tied)."""
    embed = cfg.vocab_size * cfg.hidden_size
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    return num_linear_params(cfg) + embed * (1 if cfg.tie_word_embeddings else 2) + norms
