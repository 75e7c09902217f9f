"""Small frozen configs, one per component, validated on construction."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from inflight.errors import ConfigError


def option(default: Any, help: str, **argparse_options: Any) -> Any:
    """A config field that is also a command-line option (`--kebab-case`) of every CLI that runs
    an engine, with this help text (`inflight.options` builds the flags from the fields)."""
    return field(default=default, metadata={"help": help, **argparse_options})


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def json_object(value: Any, name: str) -> dict[str, Any]:
    """An option's JSON object, from JSON text or a mapping; ConfigError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name}: not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


# Element types by name and their bytes: all priced by the simulator; the engine computes in and
# stores the first three (`ENGINE_KV_DTYPES`).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}
ENGINE_KV_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "f16": "float16", "bf16": "bfloat16",
                  "float8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "fp8_e5m2": "fp8"}


class MatmulStorage(NamedTuple):
    """A model's matmul weights as inflight's CPU kernels read them in fp32: the bytes a parameter
    takes (a GGUF file's blocks as repacked, a checkpoint's 16-bit matrices, fp32 for those widened)
    and the share of parameters kept so, whose blocks each step decodes into registers or fp32
    panels; each averaged over its part: the matmuls every token reads (attention's, the dense
    MLPs', shared experts', routers), the routed experts' and the LM head. The step-time model
    prices weight reads at these bytes, and the decoding per kept parameter
    (`perf.cost_model.CostModel`); read from a checkpoint's header by `model.loader.matmul_storage`."""

    dense: float
    experts: float
    head: float
    dense_kept: float = 0.0
    experts_kept: float = 0.0
    head_kept: float = 0.0
    # The kept parameters by block type: (type, its share of the part's parameters) pairs, whose
    # decoding is priced per type (`decoded`); empty where not known.
    dense_types: tuple[tuple[str, float], ...] = ()
    experts_types: tuple[tuple[str, float], ...] = ()
    head_types: tuple[tuple[str, float], ...] = ()

    def decoded(self, part: str, weights: Mapping[str, float]) -> float:
        """The share of `part`'s parameters a step decodes, each type's share times its decoding's
        cost against Q4_1's (`weights`, a calibration's `block_decode_weights`; 1 for a type it
        did not time); the kept share where the types are not known."""
        types = getattr(self, f"{part}_types")
        if not types:
            return float(getattr(self, f"{part}_kept"))
        return sum(share * weights.get(kind, 1.0) for kind, share in types)

    def identity(self) -> dict[str, float]:
        """Its bytes and kept shares, which tell a calibrated model's storage (`fitted_storage`)."""
        return {key: value for key, value in self._asdict().items() if not key.endswith("_types")}


def normalize_dtype(name: str | None, default: str, what: str) -> str:
    """`name` as one of DTYPE_BYTES' keys (`auto` or None: `default`)."""
    if name in (None, "auto"):
        return default
    key = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown {what} {name!r}: give auto, {', '.join(DTYPE_BYTES)}")
    return key


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA): each token's keys and values are one
    `kv_lora_rank`-wide latent (RMS-normalized) that every head's keys (`qk_nope_head_dim` wide)
    and values (`v_head_dim` wide) are projected up from, beside a key part of `qk_rope_head_dim`
    that every head shares and the rotary turns; each head's query is as wide as its key, made by
    one projection or, where `q_lora_rank` is set, through a normalized rank of that width. The
    pool keeps the latent and the rotated part, one row of `kv_lora_rank + qk_rope_head_dim` a
    token a layer; attention reads it as one key head shared by all query heads, the queries taken
    into the latent's space (`ModelConfig.head_dim` is that row's width, `num_kv_heads` 1)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # The rotated dims as interleaved pairs (2i, 2i + 1), DeepSeek's layout (transformers'
    # `rope_interleave`, V2's always); False: NeoX's halves.
    rope_interleaved: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Llama-family decoder, read from GGUF metadata or a config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Attention over the last `sliding_window` positions only (Mistral's, Qwen2's with
    # use_sliding_window), in the layers `sliding_window_layers` marks (None: every layer).
    sliding_window: int | None = None
    sliding_window_layers: tuple[bool, ...] | None = None
    # Granite's multipliers (llama.cpp's attention.scale, embedding_scale, residual_scale,
    # logit_scale): the attention's softmax scale (None: head_dim ** -0.5), the embeddings'
    # factor, the factor of each attention and MLP output joining the residual stream, and the
    # divisor of the logits.
    attention_scale: float | None = None
    # Per layer, whether it rotates q and k (SmolLM3's NoPE layers do not); None: every layer.
    rope_layers: tuple[bool, ...] | None = None
    # Learned absolute positions (GPT-2's, OPT's): a table of vectors (`model.embed_positions`)
    # added to the token embeddings, position p's at row p + this offset (OPT's 2); None: none.
    position_offset: int | None = None
    # ALiBi (BLOOM's, MPT's): no rotary and no position table; head h's score of the key at
    # position j for the query at i plus slope_h * (j - i), the slopes `alibi_slopes(num_heads,
    # this)` (llama.cpp's max_alibi_bias, MPT's alibi_bias_max); None: no ALiBi.
    alibi_max_bias: float | None = None
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # How many leading dims of each head the rotary embedding turns (Phi-4-mini's
    # partial_rotary_factor, llama.cpp's rope.dimension_count); None: all of them.
    rotary_dim: int | None = None
    # The rotary base of the sliding-window layers, without rope scaling (Gemma 3's
    # rope_local_base_freq); None: the same rotary as the other layers.
    local_rope_theta: float | None = None
    # Llama 4's and Ministral 3's queries scaled by position: (beta, original context), each query
    # times 1 + beta * ln(1 + floor(position / original)); None: unscaled.
    query_scaling: tuple[float, int] | None = None
    # Gemma 2's soft-capping: attention scores and final logits become cap * tanh(x / cap).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE): each token's MLP is the weighted sum of the
    # `num_experts_per_tok` experts (of `num_experts`, each `moe_intermediate_size` wide) its
    # router scores highest, their weights renormalized to sum to 1 where `norm_topk_prob`; in the
    # layers `moe_layers` marks (None: every layer), the others a dense MLP. 0 experts: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] | None = None
    # Qwen2-MoE's shared expert: in every expert layer an MLP of this width that every token
    # runs beside its routed experts, its output scaled by a sigmoid gate; None: none.
    shared_expert_intermediate_size: int | None = None
    # gpt-oss's experts' activation, (alpha, limit): (clamp(up, -limit, limit) + 1) * g *
    # sigmoid(alpha * g), g the gate clamped above at limit; None: SwiGLU's silu(gate) * up.
    clamped_swiglu: tuple[float, float] | None = None
    # Whether the MLP is gated (gate, up and down matrices); False: up and down alone (Arcee's).
    gated_mlp: bool = True
    # How a router scores its experts: "softmax" over all (weights renormalized over the chosen
    # where `norm_topk_prob`), or "sigmoid" (GLM-4.5's, DeepSeek's): each expert's sigmoid, the
    # choice by those plus a per-expert bias the checkpoint holds, the chosen experts' sigmoids
    # renormalized where `norm_topk_prob`; either way times `routed_scaling`.
    expert_scoring: str = "softmax"
    routed_scaling: float = 1.0
    # DeepSeek's group-limited choice, (groups, kept): the experts in `groups` equal runs of ids,
    # each group scored by its best expert (softmax scoring: DeepSeek-V2's) or its best two's sum
    # (sigmoid scoring, by the scores the choice is made on: V3's), a token's experts chosen within
    # its `kept` best groups only; (1, 1): from all of them.
    expert_groups: tuple[int, int] = (1, 1)
    # Phi-3.5-MoE's router (`expert_scoring` "sparsemixer"): each choice weighted by a softmax over
    # the experts whose logits lie within a relative 2 x this of the chosen one's (its
    # `router_jitter_noise`).
    sparsemixer_eps: float = 0.0
    # Apertus's xIELU, per layer: (alpha_p, alpha_n, beta, eps) as a GGUF file stores them (alpha_p and
    # alpha_n before their softplus); None: read from the checkpoint's weights (or no xIELU).
    xielu: tuple[tuple[float, float, float, float], ...] | None = None
    # Whether the plan's q/k norm steps run (GLM-4.5's `use_qk_norm`; a plan without them: moot).
    qk_norm: bool = True
    # Multi-token-prediction layers the checkpoint holds after the `num_layers` it runs (GLM-4.5's
    # `num_nextn_predict_layers`): not read, as llama.cpp and transformers leave them.
    mtp_layers: int = 0
    # LFM2's short convolutions: the layers `conv_layers` marks mix tokens by a depthwise causal
    # convolution of `conv_kernel` taps (each token and the ones before it) in place of attention;
    # None: every layer attends.
    conv_layers: tuple[bool, ...] | None = None
    conv_kernel: int = 0
    # DeepSeek's latent attention (MLA) in every layer; None: attention over K and V heads.
    latent_attention: LatentAttention | None = None
    # The sampling settings the checkpoint ships (a Hugging Face generation_config.json, a GGUF
    # file's general.sampling.* keys) under SamplingParams' names, max_new_tokens as max_tokens:
    # what an engine uses where a request leaves a setting unset (`EngineConfig.generation_config`).
    sampling_defaults: dict[str, float] | None = None

    @property
    def num_attention_layers(self) -> int:
        """The layers that attend (and keep K and V): all but the short convolutions."""
        return self.num_layers - sum(self.conv_layers or ())

    @property
    def kv_rows(self) -> int:
        """The rows an attending layer keeps per token and KV head: K and V, or with latent
        attention the one row both are read from."""
        return 1 if self.latent_attention is not None else 2

    @property
    def pool_values_per_token(self) -> int:
        """The values one token keeps in the paged pool: each attending layer's K and V (latent
        attention's one row), each convolution's input (`conv_layers`: the `hidden_size` values
        its later tokens read)."""
        return (self.kv_rows * self.num_attention_layers * self.num_kv_heads * self.head_dim
                + sum(self.conv_layers or ()) * self.hidden_size)

    def __post_init__(self) -> None:
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _require(self.head_dim % 2 == 0, "head_dim must be even for rotary embeddings")
        _require(self.conv_layers is None or (len(self.conv_layers) == self.num_layers and self.conv_kernel >= 1),
                 f"conv_layers needs a flag per layer ({self.num_layers}) and conv_kernel >= 1")
        _require(self.num_experts == 0 or 0 < self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})")
        groups, kept = self.expert_groups
        _require(groups == kept == 1 or (
            self.num_experts % groups == 0 and 1 <= kept < groups
            and self.num_experts_per_tok <= kept * (self.num_experts // groups)
            and (self.expert_scoring == "softmax" or self.num_experts // groups >= 2)),
            f"expert_groups {self.expert_groups}: groups must divide num_experts ({self.num_experts}), fewer kept "
            f"than there are, holding num_experts_per_tok ({self.num_experts_per_tok}), two experts or more a group "
            "where the groups are scored by their best two")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool. Its size is the first of these that is set: `num_kv_blocks`, then
    `kv_cache_memory_bytes` (as vLLM's option of that name), then `kv_cache_memory_fraction` of
    the device's available memory when the engine starts."""

    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory_fraction: float = option(0.1, "KV pool size as a fraction of the memory available at start")
    kv_cache_memory_bytes: int | None = option(None, "KV pool size in bytes (overrides --kv-cache-memory-fraction)")
    num_kv_blocks: int | None = option(None, "KV pool size in blocks (overrides both)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes computed before")
    kv_cache_dtype: str = option("auto", "the KV pool's element type: auto (the activations'), float32, bfloat16 "
                                         "or float16 (2 bytes a value: stored rounded to nearest, widened to "
                                         "fp32 as attention reads it); `inflight sim` also prices fp8 and int8")

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(0 < self.kv_cache_memory_fraction <= 1,
                 f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1,
                 f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                 f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        object.__setattr__(self, "kv_cache_dtype", normalize_dtype(self.kv_cache_dtype, "auto", "kv_cache_dtype"))


class SchedulingPolicy(StrEnum):
    CONTINUOUS = "continuous"  # first come, first served
    PRIORITY = "priority"  # by request priority, preempting less urgent requests (engine/priority.py)
    STATIC = "static"
    SLO = "slo"  # priority, then TTFT deadline; a token budget that follows the TBT target (engine/slo.py)


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
# The numeric keys of `SpeculativeConfig`: (type, the values admitted, how the error says so).
_SPECULATIVE_BOUNDS: dict[str, tuple[type | tuple[type, ...], Callable[[Any], bool], str]] = {
    "num_speculative_tokens": (int, lambda v: v >= 1, "an integer >= 1"),
    "prompt_lookup_max": (int, lambda v: v >= 1, "an integer >= 1"),
    "prompt_lookup_min": (int, lambda v: v >= 1, "an integer >= 1"),
    "suffix_decoding_max_tree_depth": (int, lambda v: v >= 1, "an integer >= 1"),
    "suffix_decoding_max_cached_requests": (int, lambda v: v >= 0, "an integer >= 0"),
    "suffix_decoding_max_spec_factor": ((int, float), lambda v: v > 0, "> 0"),
    "suffix_decoding_min_token_prob": ((int, float), lambda v: 0 <= v <= 1, "in [0, 1]"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's shape (`--speculative-config '{"method": "ngram",
    "num_speculative_tokens": 4}'`): a request's next tokens proposed cheaply and verified in one
    step. `num_speculative_tokens` is the most a request proposes in one step; with `adaptive`
    each step proposes 0 to that many per request, whichever the step-time model says gives the
    batch the most tokens per second. ngram: the longest of the last `prompt_lookup_max` down to
    `prompt_lookup_min` tokens found earlier in the prompt or output proposes what followed it.
    suffix (Snowflake's suffix decoding, vLLM's names): the longest suffix of the request's tokens
    (up to `suffix_decoding_max_tree_depth`) seen before, in its own tokens or in the outputs of
    the last `suffix_decoding_max_cached_requests` requests, proposes the most frequent
    continuation, token by token while it is at least `suffix_decoding_min_token_prob` of what
    followed, at most `suffix_decoding_max_spec_factor` times the match's length. draft_model:
    `model` (a smaller model with the same tokenizer, any form inflight loads) proposes its greedy
    tokens, run by the engine on a KV pool of its own."""

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24
    # About 2.4 KB per cached output token (9 contexts a token, kept by hash in Python dicts).
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name, (kind, admits, what) in _SPECULATIVE_BOUNDS.items():
            value = getattr(self, name)
            _require(isinstance(value, kind) and not isinstance(value, bool) and admits(value),
                     f"speculative_config: {name} must be {what}, got {value!r}")
        _require(self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                 f"({self.prompt_lookup_max})")
        _require(isinstance(self.adaptive, bool), f"speculative_config: adaptive must be true or false, "
                                                  f"got {self.adaptive!r}")
        if self.method == "draft_model":
            _require(isinstance(self.model, str) and bool(self.model),
                     'speculative_config: method "draft_model" needs "model", the draft\'s path (a smaller model '
                     'with the same tokenizer)')
        else:
            _require(self.model is None, f'speculative_config: "model" is for method "draft_model", not '
                                         f'{self.method!r}')

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From JSON text, a mapping, or a config already made; ConfigError naming what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        _require(not unknown, f"speculative_config: unknown key {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**value)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step. `max_model_len` bounds prompt + output of any request."""

    max_batch_size: int = option(64, "most requests in one step")
    max_num_tokens: int = option(512, "token budget of one step, prefill and decode together")
    max_model_len: int = option(2048, "most tokens of one request, prompt and output")
    enable_chunked_prefill: bool = option(True, "split a prompt that does not fit the step's budget across steps")
    scheduling_policy: SchedulingPolicy = option(
        SchedulingPolicy.CONTINUOUS, "continuous (first come, first served), priority, slo or static")
    max_waiting_requests: int | None = option(None, "requests beyond this many waiting are refused (429 over "
                                                    "HTTP; default: unbounded)")
    # Thrash guard: for this many steps after a preemption, a waiting request is admitted only
    # if it can run to its maximum length beside the running requests' worst-case growth, so
    # the pool is not overcommitted straight into the next preemption (0: no throttle).
    preemption_cooldown_steps: int = option(32, "after a preemption, steps during which a request is admitted "
                                                "only with room for its whole length (0: none)")
    # Always admit as in that cooldown: TensorRT-LLM's GUARANTEED_NO_EVICT.
    guaranteed_no_evict: bool = option(
        False, "admit a request only if the KV cache holds it to its max_tokens beside every running "
               "request's maximum (TensorRT-LLM's GUARANTEED_NO_EVICT): no KV preemption, fewer at once")
    priority_max_bypass: int = option(64, "priority policy: a waiting request overtaken this many times by more "
                                          "urgent ones is served next (aging)")
    ttft_slo_ms: float | None = option(None, "slo policy: the TTFT target (orders waiting requests by deadline)")
    tbt_slo_ms: float | None = option(None, "slo policy: the TBT target (sets each step's token budget)")
    reject_late: bool = option(False, "slo policy: refuse (429) a request that would miss its TTFT target on "
                                      "arrival")
    slo_cost_profile: str = option("auto", "slo policy: hardware profile (name or JSON) that predicts step times, "
                                           "refitted online (auto: cpu-local on a CPU, h100 on a GPU)")
    speculative_config: str | dict[str, Any] | None = option(
        None, 'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4} (also '
              '"suffix", or "draft_model" with "model": PATH; "adaptive": false proposes every token found)',
        metavar="JSON")
    # `speculative_config` read and checked.
    speculative: SpeculativeConfig | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        _require(self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}")
        _require(self.max_num_tokens >= 1, f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        _require(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(self.max_waiting_requests is None or self.max_waiting_requests >= 1,
                 "max_waiting_requests must be >= 1")
        _require(self.preemption_cooldown_steps >= 0, "preemption_cooldown_steps must be >= 0")
        _require(self.priority_max_bypass >= 1, f"priority_max_bypass must be >= 1, got {self.priority_max_bypass}")
        try:
            object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        except ValueError:
            choices = ", ".join(p.value for p in SchedulingPolicy)
            raise ConfigError(
                f"scheduling_policy must be one of {choices}, got {self.scheduling_policy!r}"
            ) from None
        for name in ("ttft_slo_ms", "tbt_slo_ms"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be > 0, got {value}")
        slo = self.scheduling_policy is SchedulingPolicy.SLO
        if slo:
            _require(self.ttft_slo_ms is not None or self.tbt_slo_ms is not None,
                     "scheduling_policy slo needs a target: ttft_slo_ms, tbt_slo_ms or both")
            _require(self.enable_chunked_prefill, "scheduling_policy slo needs chunked prefill (its budget cuts "
                                                  "prompts into chunks)")
        _require(not self.reject_late or (slo and self.ttft_slo_ms is not None),
                 "reject_late needs scheduling_policy slo and a ttft_slo_ms")
        speculative = None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative", speculative)
        _require(speculative is None or self.scheduling_policy is not SchedulingPolicy.STATIC,
                 "speculative decoding needs a continuous-batching policy (static runs whole batches)")


DTYPES = ("auto", "float32", "float16", "bfloat16")
GENERATION_CONFIGS = ("auto", "vllm")
QUANTIZATIONS = ("none", "int8", "int8-activations", "bf16-activations")


def canonical_overrides(value: str | dict[str, Any] | None) -> str | None:
    """`hf_overrides` as one JSON text (keys sorted; None for none), from JSON text or a mapping;
    ConfigError naming what is wrong."""
    if value is None:
        return None
    value = json_object(value, "hf_overrides")
    return json.dumps(value, sort_keys=True) if value else None


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine; the model's own shapes come from its file."""

    model: str | None = option(None, "GGUF file or Hugging Face model directory (default: the embedded "
                                     "SmolLM2-135M-Instruct)")
    dtype: str = option("auto", "activations' type (auto: float32 on a CPU, bfloat16 on a GPU)",
                        choices=DTYPES)
    device: str = option("auto", "auto, cpu or cuda[:N]")
    seed: int = option(0, "seed of the engine's sampling")
    quantization: str = option("none", "weights computed as stored (none), or int8: W8A8, each decoder matmul's "
                                       "weights int8 per output channel and its activations per token and "
                                       "group of 64 inputs, integer dot products (VNNI where the CPU has it); "
                                       "LM head, norms and attention stay fp32; or int8-activations: a GGUF "
                                       "file's quantized blocks as stored times activations quantized per row "
                                       "and 32 inputs, integer dot products (llama.cpp's arithmetic); or "
                                       "bf16-activations: matrices stored in bf16 times activations rounded "
                                       "to bf16 (AVX512_BF16's dot products where the CPU has them)",
                                choices=QUANTIZATIONS)
    generation_config: str = option(
        "auto", "sampling defaults for what a request leaves unset: auto (the model's own: a checkpoint's "
                "generation_config.json, a GGUF file's general.sampling.* keys) or vllm (inflight's, as vLLM's "
                "option of that name); the model's end-of-generation tokens apply either way",
        choices=GENERATION_CONFIGS)
    hf_overrides: str | dict[str, Any] | None = option(
        None, "a JSON object of config.json keys that replace the model's own, as vLLM's --hf-overrides (a "
              "multimodal config's decoder settings: text_config's); for a GGUF file its rotary settings "
              "only: rope_scaling or rope_parameters, rope_theta, max_position_embeddings. Qwen3 past 32k: "
              '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\'')
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    step_history: int = 4096
    # `hf_overrides` read and checked: one JSON text, keys sorted (None: none).
    model_overrides: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _require(self.generation_config in GENERATION_CONFIGS, f"generation_config must be one of "
                 f"{', '.join(GENERATION_CONFIGS)}, got {self.generation_config!r}")
        _require(self.step_history >= 1, "step_history must be >= 1")
        object.__setattr__(self, "model_overrides", canonical_overrides(self.hf_overrides))

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """Builds a config from flat, field-named options (`max_batch_size=8, block_size=32`)."""
        sections: dict[type, dict[str, Any]] = {CacheConfig: {}, SchedulerConfig: {}, cls: {}}
        fields_of = {c: {f.name for f in dataclasses.fields(c) if f.init} for c in sections}
        for key, value in kwargs.items():
            owner = next((c for c in (CacheConfig, SchedulerConfig, cls) if key in fields_of[c]), None)
            if owner is None or key in ("cache", "scheduler", "model"):
                raise ConfigError(f"unknown engine option {key!r}")
            sections[owner][key] = value
        return cls(
            model=model,
            cache=CacheConfig(**sections[CacheConfig]),
            scheduler=SchedulerConfig(**sections[SchedulerConfig]),
            **sections[cls],
        )
