"""The decoder of every architecture in `architectures.py` (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3,
OLMo 2, Granite, SmolLM3, Phi-2, Phi-3, StableLM, StarCoder2, Command R, Gemma 2 and 3, LFM2, ...) on
packed tokens: each runs its own layer plan, each layer with its own attention window and rotary
table.

Every token-wise operation runs on one flattened `[num_tokens, hidden]` tensor holding the new
tokens of all requests in the step; only attention looks at request boundaries, through the
`AttentionMetadata` the runner built (Orca's selective batching).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from inflight.config import ModelConfig
from inflight.errors import ModelLoadError
from inflight.model.architectures import Architecture, ExpertNames, architecture
from inflight.model.attention import AttentionMetadata, PagedAttention, alibi_slopes
from inflight.model.experts import RoutedExperts
from inflight.model.kernels import cpu_kernels
from inflight.model.latent import LatentWeights, latent_attention
from inflight.model.layer_plan import (
    OUTPUT,
    Mixer,
    Op,
    Reg,
    Step,
    compiled_ops,
    for_mixer,
    released_after,
    with_scaled_residual,
)
from inflight.model.linear import GreedyHead, Linear, linear_backend
from inflight.model.loader import ROPE_CHUNK, rope_table_positions
from inflight.model.token_ops import CpuKernelTokenOps, KVStore, TorchTokenOps

if TYPE_CHECKING:
    from inflight.model.loader import GGUFRows, StoredRows, WidenedRows


def rope_inv_freq(config: ModelConfig, long_context: bool = False) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, `[head_dim / 2]`, with the model's rope
    scaling applied (`long_context`: longrope's long factors). A partial rotary (`rotary_dim`)
    rotates pairs (i, i + rotary_dim / 2) of each head; the loader moved those dims to pairs
    (i, i + head_dim / 2) (`pair_rotary_dims`), so the others get frequency 0: cos 1, sin 0."""
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif kind == "longrope":
        inv_freq = inv_freq / torch.tensor(scaling["long_factor" if long_context else "short_factor"])
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(scaling, config.rope_theta, dim)
    elif kind == "frequency_divisors":  # a GGUF file's rope_freqs (Llama 3.1's scaling as llama.cpp stores it)
        inv_freq = inv_freq / torch.tensor(scaling["divisors"])
    elif kind is not None:
        raise ModelLoadError(f"unsupported rope scaling type {kind!r}")
    return torch.cat([inv_freq, torch.zeros(config.head_dim // 2 - dim // 2)])


def _yarn_inv_freq(scaling: dict[str, Any], theta: float, dim: int) -> torch.Tensor:
    """YaRN's frequencies: each one interpolated (divided by the factor) where its wavelength is
    long against the original context, kept where it is short, and blended along a linear ramp
    between the dims at which a frequency turns `beta_fast` and `beta_slow` times over the
    original context (rounded outwards unless `truncate` is false), as transformers and llama.cpp
    compute them."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    base = float(theta)

    def dim_turning(turns: float) -> float:  # the dim whose frequency turns `turns` times over the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(float(scaling.get("beta_fast") or 32)), dim_turning(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    kept = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(config: ModelConfig) -> float:
    """What longrope and YaRN multiply cos and sin by: the config's `attention_factor`, else
    longrope's sqrt(1 + ln(s) / ln(original length)) for the context's stretch s, YaRN's
    0.1 ln(factor) + 1 (or the ratio of two such terms, with DeepSeek's `mscale` and
    `mscale_all_dim`); 1 for every other rotary."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "yarn":
        factor = float(scaling["factor"])
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return _yarn_mscale(factor)
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def uses_long_factors(config: ModelConfig, max_model_len: int) -> bool:
    """Whether a longrope model serving contexts of `max_model_len` rotates with its long
    factors: where that goes past the original context, as llama.cpp chooses by its context size
    (transformers switches per forward pass, at the pass's longest sequence)."""
    scaling = config.rope_scaling or {}
    return (scaling.get("rope_type", scaling.get("type")) == "longrope"
            and max_model_len > int(scaling["original_max_position_embeddings"]))


def pair_rotary_dims(rows: torch.Tensor, num_heads: int, head_dim: int, rotary_dim: int,
                     interleaved: bool = False) -> torch.Tensor:
    """The q or k rows `[heads * head_dim, ...]` of a partial rotary (the first `rotary_dim` dims
    of each head rotated as pairs (i, i + rotary_dim / 2), or (2i, 2i + 1) where `interleaved`)
    reordered within each head so that those pairs sit at (i, i + head_dim / 2), the
    pass-through dims in the rest: the same order for q and k, so their dot products are
    unchanged, and one rotary kernel serves both."""
    half, rot = head_dim // 2, rotary_dim // 2
    rest = (head_dim - rotary_dim) // 2
    first, second = (range(0, rotary_dim, 2), range(1, rotary_dim, 2)) if interleaved else (
        range(rot), range(rot, rotary_dim))
    order = [*first, *range(rotary_dim, rotary_dim + rest), *second, *range(rotary_dim + rest, head_dim)]
    assert len(order) == head_dim and half == rot + rest
    index = torch.tensor([h * head_dim + i for h in range(num_heads) for i in order])
    return rows.index_select(0, index)


def xielu_numbers(alpha_p: float, alpha_n: float, beta: float, eps: float) -> tuple[float, float, float, float]:
    """Apertus's xIELU's stored numbers as its formula reads them: (softplus(alpha_p),
    beta + softplus(alpha_n), beta, eps), in fp32 as transformers computes them."""
    f32 = torch.float32
    a_p = torch.nn.functional.softplus(torch.tensor(alpha_p, dtype=f32))
    a_n = torch.tensor(beta, dtype=f32) + torch.nn.functional.softplus(torch.tensor(alpha_n, dtype=f32))
    return float(a_p), float(a_n), float(torch.tensor(beta, dtype=f32)), float(torch.tensor(eps, dtype=f32))


class DecoderLayer(NamedTuple):
    """One decoder layer's weights, which the plan's steps name: the fused matmuls and the scales
    of the norms the architecture has."""

    qkv: Linear
    o: Linear
    gate_up: Linear | None = None  # (a routed-experts layer has its MLP in `experts`)
    down: Linear | None = None
    input_norm: torch.Tensor | None = None  # before attention (Llama)
    post_norm: torch.Tensor | None = None  # before the MLP (Llama's post_attention_layernorm)
    attn_out_norm: torch.Tensor | None = None  # of attention's output (OLMo 2)
    mlp_out_norm: torch.Tensor | None = None  # of the MLP's output (OLMo 2)
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # q's and k's RMSNorm scales (Qwen3, OLMo 2)
    residual_scale: float = 1.0  # what each contribution to the residual stream is multiplied by (Granite)
    # Which of the model's rotary tables rotates q and k (`ROPE_*`; SmolLM3's NoPE layers: none).
    rope: int = 0
    window: int | None = None  # the layer's attention window (None: full attention)
    experts: RoutedExperts | None = None  # the MLP of a routed-experts plan (Mixtral, Qwen2/3-MoE, OLMoE, Granite MoE)
    sinks: torch.Tensor | None = None  # attention sinks, a score per query head (gpt-oss)
    norm_biases: dict[str, torch.Tensor] | None = None  # a LayerNorm's bias by its norm field, where it has one
    xielu: tuple[float, float, float, float] | None = None  # Apertus's xIELU's numbers (`xielu_numbers`)
    # LFM2's short convolution's taps `[hidden, kernel]`, in a layer that convolves instead of attending
    conv: torch.Tensor | None = None
    latent: LatentWeights | None = None  # DeepSeek's latent attention's weights beyond `qkv` and `o`

    @property
    def mixer(self) -> str:
        """How the layer mixes its tokens (`Mixer`): by its convolution, else by attention."""
        return Mixer.CONV if self.conv is not None else Mixer.ATTENTION


NORMS = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm")
MATMULS = ("qkv", "o", "gate_up", "down")
# The rotary tables a layer can read: the model's, the identity (a NoPE layer "rotates" by angle
# 0: the same op, with cos 1 and sin 0) and the local layers' own base (Gemma 3).
ROPE_GLOBAL, ROPE_NONE, ROPE_LOCAL = 0, 1, 2


class LlamaModel:
    """Holds the weights (QKV and gate/up fused) and runs one packed forward step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 gguf_blocks: dict[str, tuple[str, StoredRows]] | None = None,
                 embedding: GGUFRows | WidenedRows | None = None, int8: bool = False,
                 int8_activations: bool = False, bf16_activations: bool = False,
                 packed: dict[str, torch.Tensor] | None = None) -> None:
        """`gguf_blocks`: weights as stored, in `loader.BLOCK_TYPES` (a GGUF file's blocks, a
        checkpoint's 16-bit matrices: `load_blocks`), which the weight matmuls read instead of
        fp32 where the CPU kernels can; `embedding`: the token embedding read by row
        (`load_embedding`), in place of the checkpoint's (then only its shape); `int8`: every
        matmul quantized to int8 (W8A8, `Linear`), the LM head too (the embedding's lookup stays
        as it is);
        `int8_activations`: every matmul kept as quantized GGUF blocks, the LM head too, multiplies
        them by int8 activations (`Linear`), as llama.cpp does; `bf16_activations` likewise every
        matmul kept in bf16 by bf16 activations; `packed`: matrices as an earlier load packed
        them (`packed_cache`, by their first weight's name), used in place of packing again."""
        self.config = config
        self.device = device

        taken: set[str] = set()

        def take(name: str) -> torch.Tensor:
            try:
                tensor = weights[name]
            except KeyError:
                raise ModelLoadError(f"checkpoint lacks weight {name}") from None
            taken.add(name)
            return tensor if tensor.is_meta else tensor.to(device)  # meta: kept as its GGUF blocks

        def biases(*names: str) -> tuple[str, ...] | None:
            """The bias names of these matmuls' weights, where the checkpoint has them."""
            found = tuple(n.removesuffix(".weight") + ".bias" for n in names)
            return found if all(b in weights for b in found) else None

        blocks = gguf_blocks or {}
        arch = architecture(config.architecture)
        partial = config.rotary_dim is not None and config.rotary_dim < config.head_dim
        if (partial and config.latent_attention is None) or arch.interleaved_rotary:
            weights = self._pair_rotary_dims(config, arch, weights)
            paired = self._pair_rotary_dims(config, arch, {name: raw() if callable(raw) else raw
                                                           for name, (_, raw) in blocks.items()})
            blocks = {name: (kind, paired[name]) for name, (kind, _) in blocks.items()}  # rows alike
        self.embed_tokens: torch.Tensor | GGUFRows | WidenedRows = take("model.embed_tokens.weight")
        if embedding is not None:
            self.embed_tokens = embedding
        self.dtype = self.embed_tokens.dtype
        # Learned absolute positions (GPT-2's, OPT's): a row per position, added to the embeddings.
        self.embed_positions = take("model.embed_positions.weight") if config.position_offset is not None else None
        self._position_offset = config.position_offset or 0
        # BLOOM's LayerNorm of the embeddings
        self.embed_norm = take("model.embed_norm.weight") if arch.embedding_norm else None
        self.embed_norm_bias = take("model.embed_norm.bias") if arch.embedding_norm and (
            "model.embed_norm.bias" in weights) else None
        if self.embed_positions is not None and (
                self.embed_positions.shape[0] < config.max_position_embeddings + self._position_offset):
            raise ModelLoadError(f"the checkpoint's {self.embed_positions.shape[0]} learned positions do not reach "
                                 f"max_position_embeddings = {config.max_position_embeddings}")
        backend = linear_backend(device, self.dtype)
        # Every matmul's packing (GGUF blocks, 16-bit or int8), by its first weight's name: what
        # `packed_cache` keeps for the next load.
        self.packed: dict[str, torch.Tensor] = {}

        def linear(*names: str, bias: tuple[str, ...] | None = None) -> Linear:
            stored = [take(n) for n in names]
            if len(stored) == 1:
                weight = stored[0]
            elif all(part.is_meta for part in stored):  # shape only (torch.cat on meta would import dynamo: 3 s)
                weight = torch.empty((sum(part.shape[0] for part in stored), stored[0].shape[1]), device="meta")
            else:
                weight = torch.cat(stored)
            b = torch.cat([take(n) for n in bias]) if bias else None
            parts = [part for n in names if (part := blocks.get(n)) is not None]
            quantized = None
            if len(parts) == len(names):  # packed from where they lie (`loader._blocks_kept` says which fuse)
                quantized = ([kind for kind, _ in parts], [raw() if callable(raw) else raw for _, raw in parts])
            made = Linear(weight, b, backend, gguf_blocks=quantized, int8=int8, int8_activations=int8_activations,
                          bf16_activations=bf16_activations, packed=(packed or {}).get(names[0]))
            if made.blocks is not None:
                self.packed[names[0]] = made.blocks
            return made

        # The norms' kind: LayerNorms where the plan's are (the final norm too), else RMSNorms.
        self._layer_norm = arch.layer_norm
        self.final_norm = take(arch.final_norm + ".weight")
        self.final_norm_bias = take(arch.final_norm + ".bias") if (
            self._layer_norm and arch.final_norm + ".bias" in weights) else None
        # With int8 the LM head too, as llama.cpp's Q8_0 files hold it: +0.16% perplexity on the
        # embedded model, the task's scores unchanged, a 64-request decode step's head 5.6 ms
        # against 18.7 in fp32 (docs/models.md). A tied head is quantized from the embedding apart.
        self.lm_head = linear("lm_head.weight", bias=biases("lm_head.weight"))  # (Phi-2's has one)
        # Greedy rows' tokens straight from a head of quantized blocks (`greedy_tokens`), where
        # nothing reshapes the logits after it.
        self.greedy_head = (GreedyHead.of(self.lm_head) if config.logit_scale == 1
                            and config.final_logit_softcap is None else None)
        self.layers: list[DecoderLayer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            convolves = config.conv_layers is not None and config.conv_layers[i]
            layer_matmuls = {**arch.matmuls, **arch.conv_matmuls} if convolves else arch.matmuls
            if arch.latent is not None and config.latent_attention is not None and (
                    config.latent_attention.q_lora_rank is None):  # the query's own projection, not a rank's
                layer_matmuls = {**layer_matmuls, "qkv": (arch.latent.q, *layer_matmuls["qkv"][1:])}
            fused = {field: [p + n for n in suffixes] for field, suffixes in layer_matmuls.items()}
            sparse = arch.experts is not None and (config.moe_layers is None or config.moe_layers[i])
            if sparse:  # the MLP's weights are the experts'
                fused = {field: names for field, names in fused.items() if field not in ("gate_up", "down")}
            matmuls: dict[str, Any] = {field: linear(*names, bias=biases(*names)) for field, names in fused.items()}
            if arch.experts is not None:
                matmuls["experts"] = self._experts(arch.experts, config, linear, biases, take, p) if sparse else (
                    RoutedExperts(None, [matmuls.pop("gate_up")], [matmuls.pop("down")], 1, False))
            local = config.sliding_window is not None and (
                config.sliding_window_layers is None or config.sliding_window_layers[i])
            rotates = config.rope_layers is None or config.rope_layers[i]
            self.layers.append(DecoderLayer(
                **matmuls,
                residual_scale=config.residual_scale,
                rope=ROPE_NONE if not rotates else ROPE_LOCAL if local and config.local_rope_theta else ROPE_GLOBAL,
                window=config.sliding_window if local else None,
                **self._layer_extras(arch, take, p, config.qk_norm and not convolves, weights.__contains__,
                                     config.xielu[i] if config.xielu else None),
                conv=take(p + arch.conv_weight).reshape(config.hidden_size, -1).contiguous() if convolves and
                arch.conv_weight else None,
                latent=self._latent(config, arch, take, linear, p, weights.__contains__, self.dtype, backend)
                if arch.latent is not None else None,
            ))
        unused = sorted(set(weights) - taken)
        if unused:  # a weight the plan does not read is a feature it would silently leave out
            shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
            raise ModelLoadError(f"the checkpoint has weights the {config.architecture} plan does not use: {shown}")
        kernels = cpu_kernels() if device.type == "cpu" and self.dtype == torch.float32 else None
        self.attention = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim, kernels,
                                        scale=config.attention_scale, windows=[layer.window for layer in self.layers],
                                        softcap=config.attn_logit_softcap, conv_kernel=config.conv_kernel,
                                        alibi_slopes=alibi_slopes(config.num_heads, config.alibi_max_bias)
                                        if config.alibi_max_bias is not None else None)
        shape = (config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps)
        self.ops = CpuKernelTokenOps(*shape, kernels) if kernels is not None else TorchTokenOps(*shape)
        # The experts' activation of a gate/up matmul's output (gpt-oss's clamped SwiGLU, else SwiGLU's).
        swiglu = config.clamped_swiglu
        self._expert_act: Callable[[torch.Tensor], torch.Tensor] = (
            self.ops.silu_and_mul if swiglu is None else lambda x: self.ops.clamped_swiglu(x, *swiglu))
        self._long_context = False
        # Whether the queries' scaling by position (`ModelConfig.query_scaling`) is computed: where
        # the engine serves past the original context (`use_context`; before it the scaling is 1).
        # The compiled stack has no such step: the layers then run in Python, over the same kernels.
        self._query_scaled = self._scales_queries(config.max_position_embeddings)
        # Rotary tables cover the positions an engine serves (`use_context`), grown where a step
        # reaches past them: a 131072-position model's full tables would take 134 MB (head_dim
        # 128) mostly unread at a 2048-token context. Not on a GPU, whose steps would wait on the
        # check: every position there.
        self.rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ensure_rope(config.max_position_embeddings if device.type != "cpu" else 0)
        plan = arch.plan if config.qk_norm else tuple(step for step in arch.plan if step.op != Op.QK_NORM)
        self.plan: tuple[Step, ...] = plan if config.residual_scale == 1 else with_scaled_residual(plan)
        self.decoder_stack = self._decoder_stack(kernels)

    @staticmethod
    def _pair_rotary_dims(config: ModelConfig, arch: Architecture,
                          weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint with every layer's q and k rows (and biases) in `pair_rotary_dims`'
        order, in separate or fused q/k/v projections, and the scales of a q/k norm before the
        rotary alike (GLM-4.5's: a head's, or the whole projection's)."""
        heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
        rot, interleaved = config.rotary_dim or dim, arch.interleaved_rotary
        qk_norm = arch.extra_weights.get("qk_norm")  # q's and k's scales
        out = dict(weights)
        for i in range(config.num_layers):
            for name in arch.matmuls["qkv"]:
                for suffix in (".weight", ".bias"):
                    full = f"model.layers.{i}.{name.removesuffix('.weight')}{suffix}"
                    if full not in weights:
                        continue
                    t = weights[full]
                    if len(arch.matmuls["qkv"]) == 1:  # fused: q, k, v rows one after another
                        q, k, v = t.split([heads * dim, kv_heads * dim, kv_heads * dim])
                        out[full] = torch.cat([pair_rotary_dims(q, heads, dim, rot, interleaved),
                                               pair_rotary_dims(k, kv_heads, dim, rot, interleaved), v])
                    elif "q_proj" in name or "k_proj" in name:
                        out[full] = pair_rotary_dims(t, heads if "q_proj" in name else kv_heads, dim, rot,
                                                     interleaved)
            for name, count in zip(qk_norm, (heads, kv_heads), strict=True) if qk_norm else ():
                full = f"model.layers.{i}.{name}"
                if full in weights:  # one head's scale, or every head's
                    t = weights[full]
                    out[full] = pair_rotary_dims(t, 1 if t.shape[0] == dim else count, dim, rot, interleaved)
        return out

    @staticmethod
    def _experts(names: ExpertNames, config: ModelConfig, linear: Callable[..., Linear],
                 biases: Callable[..., tuple[str, ...] | None], take: Callable[[str], torch.Tensor],
                 prefix: str) -> RoutedExperts:
        """A layer's routed experts; each matmul with its bias where the checkpoint has one (gpt-oss)."""
        def matmul(*names: str) -> Linear:
            full = [prefix + n for n in names]
            return linear(*full, bias=biases(*full))

        gate_up, down = [], []
        for e in range(config.num_experts):
            gate, up, down_name = names.of(e)
            gate_up.append(matmul(gate, up))
            down.append(matmul(down_name))
        shared = None
        if names.shared:  # gated by a one-row matmul (Qwen2-MoE) or not (GLM-4.5)
            shared_gate, shared_up, shared_down = names.shared
            shared = (matmul(shared_gate, shared_up), matmul(shared_down),
                      matmul(names.shared_gate) if names.shared_gate is not None else None)
        # (ERNIE 4.5's is stored [1, experts])
        choice_bias = take(prefix + names.choice_bias).float().reshape(-1) if names.choice_bias is not None else None
        return RoutedExperts(matmul(names.router), gate_up, down, config.num_experts_per_tok,
                             config.norm_topk_prob, shared, scoring=config.expert_scoring,
                             choice_bias=choice_bias, scale=config.routed_scaling, groups=config.expert_groups,
                             sparsemixer_eps=config.sparsemixer_eps)

    @staticmethod
    def _latent(config: ModelConfig, arch: Architecture, take: Callable[[str], torch.Tensor],
                linear: Callable[..., Linear], prefix: str, present: Callable[[str], bool],
                dtype: torch.dtype, backend: str) -> LatentWeights:
        """A latent-attention layer's norms and up-projections, from one `kv_b_proj` or, as
        llama.cpp's files hold them, the key's part transposed and the value's: a matmul a head on
        inflight's CPU kernels (the file's blocks where kept as stored, else fp32 panels), whose
        sums for a token are the same whatever rows share the call; else in the model's `dtype`
        for batched matmuls over the heads (PyTorch's, whose sums for a row change with the rows
        beside it: a request's logprobs moved by 5e-7 with the requests sharing its step and with
        the proposals it verified)."""
        names, shape = arch.latent, config.latent_attention
        if names is None or shape is None:
            raise ModelLoadError(f"{config.architecture}: a latent-attention architecture needs kv_lora_rank and "
                                 "the heads' widths")
        k_up: torch.Tensor | list[Linear]
        v_up: torch.Tensor | list[Linear]
        if present(prefix + names.kv_up):
            k_up, v_up = LatentWeights.split_kv_up(take(prefix + names.kv_up).to(dtype), shape, config.num_heads)
        elif present(prefix + names.k_up_transposed):
            k_up = take(prefix + names.k_up_transposed).to(dtype).transpose(1, 2).contiguous()
            v_up = take(prefix + names.v_up).to(dtype).contiguous()
        else:  # a matrix a head, as stored (the loader's `_gguf_head_names`)
            heads = range(config.num_heads)
            k_up, v_up = ([linear(f"{prefix}{name.removesuffix('.weight')}.{h}.weight") for h in heads]
                          for name in (names.k_up_transposed, names.v_up))
        if backend == "inflight" and isinstance(k_up, torch.Tensor) and isinstance(v_up, torch.Tensor):
            # Head h's query part times k_up[h] `[nope, rank]`, its latent times v_up[h].T.
            k_up = [Linear(k.t().contiguous(), None, backend) for k in k_up]
            v_up = [Linear(v.contiguous(), None, backend) for v in v_up]
        ranked = shape.q_lora_rank is not None
        return LatentWeights(
            kv_norm=take(prefix + names.kv_norm), k_up=k_up, v_up=v_up,
            q_norm=take(prefix + names.q_norm) if ranked else None,
            q_up=linear(prefix + names.q_up) if ranked else None)

    @staticmethod
    def _layer_extras(arch: Architecture, take: Callable[[str], torch.Tensor], prefix: str,
                      qk_norm: bool, present: Callable[[str], bool],
                      xielu: tuple[float, float, float, float] | None = None) -> dict[str, Any]:
        """The layer's norms (a LayerNorm's bias where the checkpoint has one) and other weights as
        the architecture names them (`DecoderLayer` fields: one weight as itself, several as a
        tuple; the q/k norm's only where it runs, `ModelConfig.qk_norm`); an xIELU's numbers as
        `xielu_numbers` makes them, of `xielu` (a GGUF file's, `ModelConfig.xielu`) or else the
        checkpoint's scalars."""
        extras: dict[str, Any] = {name: take(prefix + suffix) for name, suffix in arch.norms.items()}
        if arch.layer_norm:
            biases = {name: prefix + suffix.removesuffix(".weight") + ".bias" for name, suffix in arch.norms.items()}
            extras["norm_biases"] = {name: take(bias) for name, bias in biases.items() if present(bias)} or None
        for name, names in arch.extra_weights.items():
            if name == "xielu":
                stored = xielu if xielu is not None else tuple(float(take(prefix + n)) for n in names)
                extras[name] = xielu_numbers(*stored)
            elif qk_norm or name != "qk_norm":
                held = tuple(take(prefix + n) for n in names)
                extras[name] = held[0] if len(held) == 1 else held
        return extras

    def _decoder_stack(self, kernels: ModuleType | None) -> Any:
        """The compiled interpreter of `self.plan` (`DecoderStack` in `csrc/cpu_kernels.cpp`), where
        it knows every op of the plan and every matmul runs on its kernels: the same kernels as
        `_layers` in the same order, without Python between them. None elsewhere."""
        layers = self.layers
        if kernels is None or not compiled_ops(self.plan, kernels.plan_ops()):
            return None
        if not self.attention.reads_pool_in_place(self.dtype):
            return None
        experts = [_expert_matmuls(layer.experts) if layer.experts is not None else [] for layer in layers]
        latent_q = [[*([layer.latent.q_up] if layer.latent.q_up is not None else []), *layer.latent.head_matmuls]
                    if layer.latent is not None else [] for layer in layers]
        if any(m is not None and m.backend != "inflight"
               for layer, own, q_up in zip(layers, experts, latent_q, strict=True)
               for m in [*(getattr(layer, f) for f in MATMULS), *own, *q_up]):
            return None
        norms = _norm_fields(self.plan)
        norm_biases = [(layer.norm_biases or {}).get(f) for layer in layers for f in norms]
        steps = self._layer_steps()
        mixers = list(steps)
        plans = [[(step.op, int(step.src), int(step.dst), _param_index(step, norms), [int(r) for r in release])
                  for step, release in steps[mixer]] for mixer in mixers]
        matmuls = [getattr(layer, f) for layer in layers for f in MATMULS]  # None: the MLP is the experts'
        empty = torch.empty(0)  # (a layer that convolves has no q/k norm)
        qk_norms = [scale for layer in layers for scale in layer.qk_norm or (empty, empty)] if Op.QK_NORM in {
            step.op for step in self.plan} else []
        cfg = self.config
        stack = kernels.DecoderStack(
            plans, [mixers.index(layer.mixer) for layer in layers], int(OUTPUT), len(layers),
            [getattr(layer, f) for layer in layers for f in norms],
            norm_biases if any(b is not None for b in norm_biases) else [], qk_norms,
            *_stack_linears(matmuls), [layer.window or 0 for layer in layers],
            [layer.rope for layer in layers], [layer.residual_scale for layer in layers], cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, self.attention.scale, self.attention.softcap or 0.0,
        )
        if Op.ROUTED_EXPERTS in {step.op for step in self.plan}:
            alpha, limit = cfg.clamped_swiglu or (0.0, 0.0)  # limit 0: SwiGLU
            for i, (layer, own) in enumerate(zip(layers, experts, strict=True)):
                assert layer.experts is not None
                shared = [m for m in layer.experts.shared or () if m is not None]
                stack.set_experts(i, *_stack_linears(own), layer.experts.router is not None, len(shared),
                                  layer.experts.top_k, layer.experts.normalize, alpha, limit,
                                  layer.experts.scoring == "sigmoid", layer.experts.choice_bias, layer.experts.scale,
                                  *layer.experts.groups,
                                  layer.experts.sparsemixer_eps if layer.experts.scoring == "sparsemixer" else -1.0)
        if self.attention.alibi_slopes is not None:
            stack.set_alibi(self.attention.alibi_slopes)
        if any(layer.sinks is not None for layer in layers):
            stack.set_sinks([layer.sinks for layer in layers if layer.sinks is not None])
        if Op.XIELU in {step.op for step in self.plan}:
            stack.set_xielu([number for layer in layers for number in layer.xielu or ()])
        if any(layer.conv is not None for layer in layers):
            stack.set_conv([layer.conv if layer.conv is not None else empty for layer in layers])
        if (shape := cfg.latent_attention) is not None:
            latent = [layer.latent for layer in layers if layer.latent is not None]
            assert len(latent) == len(layers)
            stack.set_latent(shape.kv_lora_rank, shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim,
                             shape.rope_interleaved, [w.kv_norm for w in latent],
                             [w.k_up if isinstance(w.k_up, torch.Tensor) else empty for w in latent],
                             [w.v_up if isinstance(w.v_up, torch.Tensor) else empty for w in latent],
                             [w.q_norm if w.q_norm is not None else empty for w in latent],
                             *_stack_linears([w.q_up for w in latent]),
                             *_stack_linears([m for w in latent for m in w.head_matmuls]))
        return stack

    def _layer_steps(self) -> dict[str, list[tuple[Step, tuple[Reg, ...]]]]:
        """Each kind of layer's steps of `self.plan` (`for_mixer`), each with the registers released
        after it (`released_after`): what both interpreters run."""
        return {mixer: _released_steps(for_mixer(self.plan, mixer))
                for mixer in dict.fromkeys(layer.mixer for layer in self.layers)}

    def _ensure_rope(self, positions: int) -> None:
        """Rotary tables covering at least `positions` positions (`loader.rope_table_positions`)."""
        have = self.rope_tables[0][0].shape[0] if self.rope_tables else 0
        if self.rope_tables and positions <= have:
            return
        length = rope_table_positions(positions)
        config = self.config
        if config.latent_attention is not None:  # the rotated part of the key alone, not the pool's row
            config = dataclasses.replace(config, head_dim=config.latent_attention.qk_rope_head_dim, rotary_dim=None)
        grown = self._rope_tables(config, have, length)
        if have:
            grown = [(torch.cat([cos, more_cos]), torch.cat([sin, more_sin]))
                     for (cos, sin), (more_cos, more_sin) in zip(self.rope_tables, grown, strict=True)]
        self.rope_tables = grown

    def _rope_tables(self, config: ModelConfig, first: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin `[end - first, head_dim]` of positions [first, end) of each rotary the layers
        read (`ROPE_*`; the local one only where a layer reads it)."""
        table = self._rope_table(rope_inv_freq(config, self._long_context), first, end, rope_attention_factor(config))
        identity = (torch.ones_like(table[0]), torch.zeros_like(table[1])) if any(
            layer.rope == ROPE_NONE for layer in self.layers) else table
        local = table
        if any(layer.rope == ROPE_LOCAL for layer in self.layers):
            assert config.local_rope_theta is not None
            unscaled = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            local = self._rope_table(rope_inv_freq(unscaled), first, end)
        return [table, identity, local]

    def _rope_table(self, inv_freq: torch.Tensor, first: int, end: int,
                    factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        # Chunk by chunk, each small enough for one thread: a position's values never depend on
        # how far the table reaches or how many threads built it.
        chunks = []
        for start in range(first, end, ROPE_CHUNK):
            positions = torch.arange(start, start + ROPE_CHUNK, device=self.device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq.to(self.device))
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if factor != 1:  # on the rotated dims only: a partial rotary's others (frequency 0) pass through
                scale = torch.where(torch.cat([inv_freq, inv_freq]).to(self.device) != 0, factor, 1.0)
                cos, sin = cos * scale, sin * scale
            chunks.append((cos, sin))
        return (torch.cat([c for c, _ in chunks]).to(self.dtype).contiguous(),
                torch.cat([s for _, s in chunks]).to(self.dtype).contiguous())

    def _scales_queries(self, max_model_len: int) -> bool:
        scaling = self.config.query_scaling
        return scaling is not None and max_model_len > scaling[1]

    def use_context(self, max_model_len: int) -> None:
        """Sets the rotary for an engine serving contexts of up to `max_model_len` tokens: a
        longrope model's long or short factors (`uses_long_factors`), and whether queries are
        scaled by position (`ModelConfig.query_scaling`) past the original context; nothing for
        others."""
        self._query_scaled = self._scales_queries(max_model_len)
        long_context = uses_long_factors(self.config, max_model_len)
        if long_context != self._long_context:
            self._long_context = long_context
            self.rope_tables = []  # the other factors: built again
        self._ensure_rope(min(max_model_len, self.config.max_position_embeddings))

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
        return self.logits(self.final_hidden(input_ids, positions, kv_caches, attn_meta, logits_indices))

    @torch.inference_mode()
    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Runs one step over packed tokens and returns the LM head's input (the final norm's
        output) at the rows of `logits_indices`, for `logits` or `greedy_tokens`."""
        if positions.device.type == "cpu" and positions.numel():
            self._ensure_rope(int(positions.max()) + 1)  # a step past what use_context asked for
        hidden = self.embed_tokens.index_select(0, input_ids)
        if self.config.embedding_scale != 1:
            hidden = hidden * self.config.embedding_scale
        if self.embed_positions is not None:
            rows = positions + self._position_offset if self._position_offset else positions  # (OPT's from row 2)
            hidden = hidden + self.embed_positions.index_select(0, rows)
        if self.embed_norm is not None:
            hidden = self.ops.layer_norm(hidden, self.embed_norm, self.embed_norm_bias)
        if self.decoder_stack is not None and not self._query_scaled:
            mlp = self._compiled_layers(hidden, positions, kv_caches, attn_meta)
        else:
            mlp = self._layers(hidden, positions, kv_caches, attn_meta)
        # After the last layer only the rows that sample a token matter.
        hidden = hidden.index_select(0, logits_indices) + mlp.index_select(0, logits_indices)
        return (self.ops.layer_norm(hidden, self.final_norm, self.final_norm_bias) if self._layer_norm
                else self.ops.rms_norm(hidden, self.final_norm))

    @torch.inference_mode()
    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The fp32 logits of `final_hidden`'s rows."""
        logits = self.lm_head(normed).float()
        if self.config.logit_scale != 1:
            logits = logits / self.config.logit_scale
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The argmax of each of `final_hidden`'s rows' logits, exactly as `logits` and
        `argmax_rows` would choose it (int64); only where `greedy_head` is set."""
        assert self.greedy_head is not None
        return self.greedy_head(normed)

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_meta: AttentionMetadata) -> torch.Tensor:
        """Every decoder layer over the step's tokens, `self.plan` interpreted step by step: updates
        the residual stream `hidden` in place and returns the plan's output register."""
        ops, attention = self.ops, self.attention
        reg: list[Any] = [None] * len(Reg)
        steps = self._layer_steps()
        query_scale = None
        if self._query_scaled:  # as transformers computes it: fp32 position / original, floor, log
            assert self.config.query_scaling is not None
            beta, original = self.config.query_scaling
            query_scale = (1 + beta * torch.log(1 + torch.floor(positions / original))).to(hidden.dtype)[:, None, None]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            cos, sin = self.rope_tables[layer.rope]
            for (op, src, dst, param, _), release in steps[layer.mixer]:
                x = reg[src]
                weight: Any = getattr(layer, param) if param is not None else None
                if op == Op.MATMUL:
                    reg[dst] = weight(x)
                elif op == Op.ADD_RMS_NORM:
                    reg[dst] = ops.rms_norm(hidden, weight) if x is None else ops.add_rms_norm_(hidden, x, weight)
                elif op in (Op.ADD_LAYER_NORM, Op.LAYER_NORM):
                    bias = layer.norm_biases.get(param) if layer.norm_biases and param else None
                    if op == Op.LAYER_NORM:
                        reg[dst] = ops.layer_norm(x, weight, bias)
                    else:
                        reg[dst] = (ops.layer_norm(hidden, weight, bias) if x is None
                                    else ops.add_layer_norm_(hidden, x, weight, bias))
                elif op in (Op.ROTARY_STORE_KV, Op.STORE_KV):  # the register holds the (q, k, v) heads from here
                    store = KVStore(k_cache, v_cache, attn_meta.slot_mapping)
                    reg[dst] = (ops.rotary(x, positions, cos, sin, store) if op == Op.ROTARY_STORE_KV
                                else ops.store_kv(x, store))
                    if query_scale is not None:  # the rotated queries, as attention reads them
                        reg[dst][0].mul_(query_scale)
                elif op == Op.ROTARY:  # in place: the register holds the fused projection still
                    reg[dst] = ops.rotary_(x, positions, cos, sin)
                elif op == Op.ATTENTION:
                    q, k, v = x
                    reg[dst] = attention.forward(q, k, v, k_cache, v_cache, attn_meta, kv_stored=True,
                                                 window=layer.window, sinks=layer.sinks)
                elif op == Op.SILU_AND_MUL:
                    reg[dst] = ops.silu_and_mul(x)
                elif op == Op.GELU_TANH_AND_MUL:
                    reg[dst] = ops.gelu_tanh_and_mul(x)
                elif op == Op.RELU_SQUARED:
                    reg[dst] = ops.relu_squared(x)
                elif op == Op.GELU_TANH:
                    reg[dst] = ops.gelu_tanh(x)
                elif op == Op.RELU:
                    reg[dst] = torch.relu(x)
                elif op == Op.GELU:
                    reg[dst] = F.gelu(x)
                elif op == Op.XIELU:
                    assert layer.xielu is not None
                    reg[dst] = ops.xielu(x, *layer.xielu)
                elif op == Op.ADD:
                    reg[dst].add_(x)
                elif op == Op.QK_NORM:
                    reg[dst] = ops.qk_norm_(x, weight)
                elif op == Op.ADD_RESIDUAL:
                    if x is not None:
                        hidden.add_(x)
                    reg[dst] = hidden
                elif op == Op.RMS_NORM:
                    reg[dst] = ops.rms_norm(x, weight)
                elif op == Op.SCALE:
                    reg[dst] = x * weight
                elif op == Op.ROUTED_EXPERTS:
                    reg[dst] = weight(x, self._expert_act)
                elif op == Op.LATENT_ATTENTION:  # the layer's share of the pool holds each token's latent row
                    assert self.config.latent_attention is not None
                    reg[dst] = latent_attention(x, weight, self.config.latent_attention, self.config.num_heads,
                                                positions, cos, sin, k_cache, attn_meta, attention)
                elif op == Op.SHORT_CONV:  # the layer's share of the pool holds each token's b * x
                    assert attn_meta.conv_slots is not None
                    reg[dst] = ops.short_conv_(x, weight, k_cache, attn_meta.slot_mapping, attn_meta.conv_slots)
                else:
                    raise ValueError(f"no implementation of the plan's op {op!r}")
                for r in release:
                    reg[r] = None
        return reg[OUTPUT]

    def _compiled_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                         kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                         attn_meta: AttentionMetadata) -> torch.Tensor:
        """`self.plan` through the compiled `DecoderStack`: the same kernels in the same order."""
        tables = attn_meta.prefill_tables
        return self.decoder_stack.forward(
            hidden, positions, [cos for cos, _ in self.rope_tables], [sin for _, sin in self.rope_tables],
            [k for k, _ in kv_caches], [v for _, v in kv_caches],
            attn_meta.slot_mapping, attn_meta.num_decode_tokens, attn_meta.decode_block_tables,
            attn_meta.decode_context_lens, *(
                (tables.block_tables, tables.query_starts, tables.query_lens, tables.context_starts)
                if tables is not None else (None,) * 4),
            attn_meta.block_size, attn_meta.conv_slots,
        )


def _released_steps(plan: tuple[Step, ...]) -> list[tuple[Step, tuple[Reg, ...]]]:
    """Each step of `plan` with the registers released after it (`released_after`)."""
    return list(zip(plan, released_after(plan), strict=True))


def _expert_matmuls(experts: RoutedExperts) -> list[Linear]:
    """A routed-experts MLP's matmuls in `DecoderStack.set_experts`' order."""
    return [*([experts.router] if experts.router is not None else []), *experts.gate_up, *experts.down,
            *(m for m in experts.shared or () if m is not None)]


def _stack_linears(matmuls: Sequence[Linear | None]) -> tuple[list[torch.Tensor], list[torch.Tensor | None],
                                                              list[torch.Tensor | None], list[int]]:
    """Matmuls as `DecoderStack` takes them: packed weights, blocks, biases, out_features (None, a
    matmul the plan does not read, as an empty weight)."""
    empty = torch.empty(0)
    return ([m.weight if m is not None else empty for m in matmuls],
            [m.blocks if m is not None else None for m in matmuls],
            [m.bias if m is not None else None for m in matmuls],
            [m.out_features if m is not None else 0 for m in matmuls])


def _norm_fields(plan: tuple[Step, ...]) -> tuple[str, ...]:
    """The `DecoderLayer` norm fields `plan` reads, in the order `DecoderStack` is given them."""
    return tuple(dict.fromkeys(step.param for step in plan if step.param in NORMS))


def _param_index(step: Step, norms: tuple[str, ...]) -> int:
    """The index `DecoderStack` knows a step's weight by: its place among the layer's norms or
    its matmuls (-1: the step has none, or it is not a tensor the stack holds by index)."""
    if step.param in norms:
        return norms.index(step.param)
    if step.param in MATMULS:
        return MATMULS.index(step.param)
    return -1
