"""The architectures inflight runs, each as data: its decoder layer's plan, the checkpoint names
of the per-layer weights the plan reads beyond Llama's, and how llama.cpp stores its q and k rows.

Adding an architecture is adding a row here (and, for an op no interpreter knows, the op); the
model and the loaders read only these rows, never the architecture's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from inflight.errors import ModelLoadError
from inflight.model.layer_plan import (
    GEGLU_LAYER,
    LATENT_LAYER,
    LAYER_NORM_GELU_LAYER,
    LAYER_NORM_LAYER,
    LAYER_NORM_RELU_LAYER,
    LAYER_NORM_RELU_SQUARED_LAYER,
    LLAMA_LAYER,
    PARALLEL_GELU_LAYER,
    PARALLEL_LAYER,
    PARALLEL_TWO_NORM_GELU_LAYER,
    POST_NORM_LAYER,
    QK_NORM_AFTER_ROTARY_LAYER,
    QK_NORM_LAYER,
    RELU_SQUARED_LAYER,
    SANDWICH_NORM_LAYER,
    SANDWICH_QK_NORM_LAYER,
    SANDWICH_SWIGLU_LAYER,
    SHORT_CONV_LAYER,
    UNGATED,
    XIELU_LAYER,
    Op,
    Step,
    with_activation,
    with_routed_experts,
)

_LLAMA_MATMULS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}
_LLAMA_NORMS: dict[str, str] = {"input_norm": "input_layernorm.weight",
                                "post_norm": "post_attention_layernorm.weight"}


@dataclass(frozen=True)
class ExpertNames:
    """Where a checkpoint keeps a routed-experts layer's weights, under `model.layers.N.`: the
    router, and expert e's gate, up and down projections (`{e}` in their names)."""

    router: str
    gate: str
    up: str
    down: str
    # Checkpoint tensors that stack every expert's weights, `[experts, rows, cols]`, under
    # `model.layers.N.`: name -> the parts ("gate", "up", "down") they hold, in row order (Granite
    # MoE's input_linear holds gate and up). The loader splits them into the names above.
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # A shared expert every token runs (Qwen2-MoE): its gate, up and down projections, and the
    # one-row matmul whose sigmoid scales its output; () and None: none.
    shared: tuple[str, str, str] | tuple[()] = ()
    shared_gate: str | None = None
    # Stacks of every expert's biases, `[experts, rows]`, split as `stacked` splits the weights
    # (gpt-oss's gate_up_proj_bias: gate and up).
    stacked_biases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # gpt-oss's stacks: each expert's matrix stored as `[in, out]` (x @ W), and its parts
    # interleaved along the out dim (gate, up, gate, up, ...) instead of one after another.
    stacked_transposed: bool = False
    stacked_interleaved: bool = False
    # A per-expert bias added to the scores for the choice alone (GLM-4.5's
    # e_score_correction_bias, of a sigmoid router), under `model.layers.N.`; None: none.
    choice_bias: str | None = None

    def of(self, expert: int) -> tuple[str, str, str]:
        return self.gate.format(e=expert), self.up.format(e=expert), self.down.format(e=expert)

    @property
    def shared_matmuls(self) -> list[tuple[str, ...]]:
        """The shared expert's matmuls as the model fuses them: gate and up, then down."""
        return [self.shared[:2], self.shared[2:]] if self.shared else []

    def part(self, expert: int, part: str) -> str:
        """Expert `expert`'s weight `part`: "gate", "up" or "down"."""
        return self.of(expert)[("gate", "up", "down").index(part)]

    def stacks(self, name: str) -> tuple[tuple[str, ...], bool] | None:
        """The parts a checkpoint's stacked tensor `name` (under `model.layers.N.`) holds and
        whether they are biases; None for any other tensor."""
        if name in self.stacked:
            return self.stacked[name], False
        if name in self.stacked_biases:
            return self.stacked_biases[name], True
        return None


@dataclass(frozen=True)
class LatentNames:
    """Where a checkpoint keeps a latent-attention layer's weights beyond its fused projection
    (`Architecture.matmuls`' qkv: the query's low rank and the compressed KV's), under
    `model.layers.N.`: the query's projection where it has no low rank (`q_lora_rank` null: it
    takes the low rank's place in the fused projection), the low rank's norm and up-projection,
    the latent's norm, and the latent's up-projection to each head's key and value."""

    q: str = "self_attn.q_proj.weight"
    q_norm: str = "self_attn.q_a_layernorm.weight"
    q_up: str = "self_attn.q_b_proj.weight"
    kv_norm: str = "self_attn.kv_a_layernorm.weight"
    kv_up: str = "self_attn.kv_b_proj.weight"
    # `kv_up` in two, as llama.cpp's files since its absorbed MLA hold it (the names its converter
    # gives them on the way): the key's part transposed, `[heads, kv_lora_rank, qk_nope_head_dim]`,
    # and the value's, `[heads, v_head_dim, kv_lora_rank]`
    k_up_transposed: str = "self_attn.k_b_proj.weight"
    v_up: str = "self_attn.v_b_proj.weight"


@dataclass(frozen=True)
class Architecture:
    name: str
    plan: tuple[Step, ...] = LLAMA_LAYER
    # DecoderLayer matmul field -> the Hugging Face names (under `model.layers.N.`) of the weights
    # fused into it, in order (a checkpoint that stores them fused names one).
    matmuls: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(_LLAMA_MATMULS))
    # DecoderLayer norm field -> its Hugging Face name under `model.layers.N.` (a LayerNorm's bias
    # beside it, `.bias` for `.weight`, where the checkpoint has one).
    norms: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_NORMS))
    # The Hugging Face name of the norm after the last layer (its weight and bias under it).
    final_norm: str = "model.norm"
    # DecoderLayer field -> the Hugging Face names of the weights it holds (one as itself, several
    # together as a tuple), for the plan's steps beyond Llama's.
    extra_weights: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # llama.cpp's fixed NoPE pattern for the architecture's GGUF files: every n-th layer does not
    # rotate (SmolLM3: 4); None: every layer rotates.
    gguf_nope_interval: int | None = None
    # llama.cpp's converter interleaves each head's rotary halves in the q and k rows of the
    # Llama-style architectures it rotates as "normal" rope; those in NeoX order are stored as
    # Hugging Face has them.
    gguf_interleaved_qk: bool = True
    # The checkpoint (and llama.cpp's file alike) rotates each head's dims as interleaved pairs
    # (2i, 2i + 1), GPT-J's way (GLM-4): the loader moves them to the halves one rotary kernel turns.
    interleaved_rotary: bool = False
    # The share of each head the rotary turns where a config does not say (transformers' default
    # for the architecture: GLM-4's half).
    hf_partial_rotary_factor: float = 1.0
    # llama.cpp tensor names this architecture uses for other weights than `GGUF_LAYER_NAMES` says.
    gguf_names: dict[str, str] = field(default_factory=dict)
    # Gemma's: the embeddings multiplied by sqrt(hidden_size); its Hugging Face checkpoints store
    # each RMSNorm scale as (scale - 1), which llama.cpp's converter adds back (Nemotron's its
    # LayerNorms' alike).
    scaled_embedding: bool = False
    hf_norm_offset: float = 0.0
    # A config's rope type "dynamic" with an `alpha` is NTK-aware scaling by a fixed alpha, the base
    # stretched by alpha ** (d / (d - 2)) (Hunyuan's, as transformers reads it); False: refused.
    hf_ntk_alpha: bool = False
    # A GGUF file's `logit_scale` multiplies the logits (Command R's); False: divides them (Granite's).
    gguf_logit_scale_multiplies: bool = False
    # Gemma's published configs say `hidden_act: "gelu"` for the tanh approximation, which
    # transformers computes for them (its legacy reading); True: that name means this plan's GeGLU.
    hf_gelu_means_tanh: bool = False
    # Which layers slide where a config does not list them (`layer_types`): every n-th layer is
    # global, the others local (Gemma 2: 2, Gemma 3: 6); llama.cpp's default for its GGUF files.
    window_pattern: int | None = None
    # llama.cpp's fixed rules for GGUF files, which do not store these: the local layers' rotary
    # base where `rope.freq_base_swa` is absent (None: the global one), and the layer counts of
    # the models whose queries are scaled by (hidden / heads) ** -0.5 instead of head_dim ** -0.5
    # (Gemma's 27B).
    gguf_local_rope_theta: float | None = None
    # The local layers rotate without the global layers' rope scaling, at the global base where
    # nothing sets theirs (OLMo 3's: transformers' default for its configs, llama.cpp's rule for its
    # olmo2 files with a window); False: they share the global layers' rotary.
    local_rope_unscaled: bool = False
    # Where a model slides, its global layers rotate nothing (EXAONE 4's); False: they rotate.
    nope_where_global: bool = False
    # The config key of the MLP's width (Granite 4.0's shared MLP: shared_intermediate_size).
    hf_intermediate_key: str = "intermediate_size"
    # Whether the layers rotate only where the config's `position_embedding_type` is "rope"
    # (Granite 4.0's; transformers' default, None, is no rotary at all); False: they rotate.
    hf_position_embedding_type: bool = False
    # llama.cpp slides the layers of this architecture's files of these layer counts only, whatever
    # a file says (EXAONE 4's 32B); None: wherever a file says.
    gguf_window_layer_counts: tuple[int, ...] | None = None
    gguf_wide_query_scale_layers: tuple[int, ...] = ()
    # The checkpoint names of a routed-experts MLP (the plan's `experts` step); its dense layers,
    # if any, read `matmuls`' gate_up and down.
    experts: ExpertNames | None = None
    # Whether llama.cpp renormalizes the chosen experts' weights for this architecture's GGUF
    # files where they do not say (`expert_weights_norm`): Mixtral's and Qwen3-MoE's do, OLMoE's not.
    gguf_expert_weights_norm: bool = True
    # Whether the chosen experts' weights are renormalized whatever a config.json says (Mixtral's
    # and Granite MoE's: a softmax over the chosen experts' scores); False: as its norm_topk_prob.
    experts_always_renormalized: bool = False
    # gpt-oss's experts' clamped SwiGLU (`ModelConfig.clamped_swiglu`): its (alpha, limit) where a
    # config does not say (transformers' defaults, llama.cpp's fixed values); None: SwiGLU.
    clamped_swiglu: tuple[float, float] | None = None
    # How its router scores the experts (`ModelConfig.expert_scoring`): "softmax" or "sigmoid".
    expert_scoring: str = "softmax"
    # The config key that turns the plan's q/k norm on (GLM-4.5's use_qk_norm, false where
    # absent); None: the plan's q/k norm always runs.
    hf_qk_norm_key: str | None = None
    # Whether the experts' weights are renormalized where a config does not say (transformers'
    # default for the architecture: GLM-4.5's yes).
    hf_norm_topk_prob: bool = False
    # Where DeepSeek's group-limited choice of experts (a config's n_group / topk_group, a GGUF
    # file's expert_group_count / expert_group_used_count) applies: "always" (V3's and GLM's routers
    # in transformers), or the topk_method that asks for it ("group_limited_greedy": V2's, whose
    # "greedy" leaves the groups unused); None: the architecture has none, and groups are refused.
    expert_groups: str | None = None
    # The shared expert's width where a GGUF file does not say: the routed experts' times the
    # shared count (GLM-4.5's, as llama.cpp reads it); False: the dense MLP's (Qwen2-MoE's).
    gguf_shared_width_from_experts: bool = False
    # LFM2's short-convolution layers (`ModelConfig.conv_layers`): their matmul fields' Hugging Face
    # names in place of `matmuls`' (the fused projection `qkv` is in_proj, `o` out_proj), and the
    # name of their convolution's taps (`[hidden, 1, kernel]`; llama.cpp's `[hidden, kernel]`).
    conv_matmuls: dict[str, tuple[str, ...]] = field(default_factory=dict)
    conv_weight: str | None = None
    # llama.cpp's name of the norm after the last layer (LFM2's files: token_embd_norm).
    gguf_final_norm: str = "output_norm"
    # DeepSeek's latent attention (`ModelConfig.latent_attention`): the names of its weights; None:
    # attention over K and V heads.
    latent: LatentNames | None = None
    # A checkpoint's own names for Llama's, by prefix, the first that matches (GPT-2's `h.` for
    # `model.layers.`, `wte.` for `model.embed_tokens.`); a layer's own names are then `matmuls`'
    # and `norms`'. Empty: Llama's names.
    hf_prefixes: tuple[tuple[str, str], ...] = ()
    # Tensors of a checkpoint's layers that are not weights (GPT-2's causal-mask buffers), by the
    # end of their name: left unread.
    hf_ignored: tuple[str, ...] = ()
    # The layer matrices a checkpoint stores `[in, out]` (GPT-2's Conv1D), transposed as read.
    hf_transposed: tuple[str, ...] = ()
    # The config key counting the groups a checkpoint stores its fused q/k/v projection in, each
    # group's q heads then its k and v head (GPT-NeoX's: every head a group, its q, k and v rows
    # together; Falcon's: `fused_qkv_groups`, `with_llama_keys`' reading), reordered as read to all q
    # rows, then k's, then v's; None (or 0 groups): stored in that order already.
    hf_qkv_groups: str | None = None
    # Learned absolute positions (`ModelConfig.position_offset`): the table's row for position p is
    # p + this (OPT's 2); None: none (the layers rotate, or nothing says where a token is).
    learned_positions: int | None = None
    # config.json's own names for the settings `parse_hf_config` reads (GPT-2's n_embd for
    # hidden_size), and the settings' values where a config leaves them out (its class's defaults).
    hf_keys: dict[str, str] = field(default_factory=dict)
    hf_defaults: dict[str, Any] = field(default_factory=dict)
    # LayerNorms without a scale (OLMo's, in its checkpoints and llama.cpp's files alike): a scale of
    # ones where the weights hold none.
    weightless_norms: bool = False
    # Models of this `model_type` whose layers run another row's plan, each as (config key, its
    # value, the GGUF tensor of layer 0 that tells such a file, that row's name): Falcon-40B's
    # parallel block on two LayerNorms. `variant_of`: the row such a variant is of (not a
    # model_type of its own).
    variants: tuple[tuple[str, Any, str, str], ...] = ()
    variant_of: str | None = None
    # ALiBi in place of any position encoding (`ModelConfig.alibi_max_bias`): BLOOM's, MPT's.
    alibi: bool = False
    # A LayerNorm of the embeddings before the first layer (BLOOM's `word_embeddings_layernorm`),
    # read as `model.embed_norm`.
    embedding_norm: bool = False

    @property
    def layer_matmul_groups(self) -> list[tuple[str, ...]]:
        """Every matmul a layer may hold, each as the checkpoint names fused into it: `matmuls`', a
        convolving layer's own (`conv_matmuls`), and latent attention's query projection in its
        rank's place (a config without the rank) and that rank's up-projection."""
        groups = [*self.matmuls.values(), *self.conv_matmuls.values()]
        if self.latent is not None:
            groups += [(self.latent.q, *self.matmuls["qkv"][1:]), (self.latent.q_up,)]
        return groups

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP has a gate (an ungated one's gate/up matmul holds the up projection alone)."""
        return not UNGATED & {step.op for step in self.plan}

    @property
    def layer_norm(self) -> bool:
        """Whether its norms are LayerNorms (the final norm too); False: RMSNorms."""
        return bool({Op.ADD_LAYER_NORM, Op.LAYER_NORM} & {step.op for step in self.plan})

    @property
    def activation(self) -> str:
        """The MLP's activation, as Hugging Face configs name it."""
        ops = {step.op for step in self.plan}
        if {Op.GELU_TANH_AND_MUL, Op.GELU_TANH} & ops:
            return "gelu_pytorch_tanh"
        named = {Op.RELU_SQUARED: "relu2", Op.XIELU: "xielu", Op.RELU: "relu", Op.GELU: "gelu"}
        return next((name for op, name in named.items() if op in ops), "silu")


_POST_NORMS = {"attn_out_norm": "post_attention_layernorm.weight", "mlp_out_norm": "post_feedforward_layernorm.weight"}
_QK_NORM: dict[str, tuple[str, ...]] = {"qk_norm": ("self_attn.q_norm.weight", "self_attn.k_norm.weight")}
_SANDWICH_NORMS = {"input_norm": "input_layernorm.weight", "attn_out_norm": "post_attention_layernorm.weight",
                   "post_norm": "pre_feedforward_layernorm.weight", "mlp_out_norm": "post_feedforward_layernorm.weight"}
_GEMMA2 = Architecture("gemma2", plan=SANDWICH_NORM_LAYER, norms=_SANDWICH_NORMS, gguf_interleaved_qk=False,
                       scaled_embedding=True, hf_norm_offset=1.0, window_pattern=2, gguf_wide_query_scale_layers=(46,),
                       gguf_names={"ffn_norm.weight": "pre_feedforward_layernorm.weight"})

_MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")
_GRANITE_MOE_EXPERTS = ExpertNames(
    "block_sparse_moe.router.layer.weight", "block_sparse_moe.experts.{e}.gate.weight",
    "block_sparse_moe.experts.{e}.up.weight", "block_sparse_moe.experts.{e}.down.weight",
    stacked={"block_sparse_moe.input_linear.weight": ("gate", "up"),
             "block_sparse_moe.output_linear.weight": ("down",)})
_QWEN3_MOE_EXPERTS = ExpertNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                                 "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
_QWEN2_MOE_EXPERTS = dataclasses.replace(
    _QWEN3_MOE_EXPERTS, shared_gate="mlp.shared_expert_gate.weight",
    shared=("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
            "mlp.shared_expert.down_proj.weight"))

# gpt-oss's: its router has a bias, and its experts' weights and biases are stacked as
# `[experts, in, out]`, gate and up interleaved (llama.cpp's converter splits them apart).
_GPT_OSS_EXPERTS = ExpertNames(
    "mlp.router.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight",
    stacked={"mlp.experts.gate_up_proj": ("gate", "up"), "mlp.experts.down_proj": ("down",)},
    stacked_biases={"mlp.experts.gate_up_proj_bias": ("gate", "up"), "mlp.experts.down_proj_bias": ("down",)},
    stacked_transposed=True, stacked_interleaved=True)

# GLM-4.5's: a sigmoid router with a bias for the choice, each expert stored apart, and a shared
# expert (ungated) beside them.
_GLM4_MOE_EXPERTS = dataclasses.replace(
    _QWEN3_MOE_EXPERTS, choice_bias="mlp.gate.e_score_correction_bias",
    shared=("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
            "mlp.shared_experts.down_proj.weight"))

# Apertus's xIELU's numbers, each a scalar, under `model.layers.N.`: alpha_p and alpha_n (before
# their softplus), beta and eps.
XIELU_WEIGHTS = ("mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n", "mlp.act_fn.beta", "mlp.act_fn.eps")
_INPUT_NORM_ONLY = {"input_norm": "input_layernorm.weight"}  # a parallel block's one norm
_COHERE = Architecture("cohere", plan=PARALLEL_LAYER, norms=_INPUT_NORM_ONLY, gguf_interleaved_qk=False,
                       interleaved_rotary=True, gguf_logit_scale_multiplies=True)

# ERNIE 4.5's MoE models: GLM-4.5's names but its choice bias's (a softmax router's).
_ERNIE_MOE_EXPERTS = dataclasses.replace(_GLM4_MOE_EXPERTS, choice_bias="mlp.moe_statics.e_score_correction_bias")

# LFM2 (350M to 2.6B): Qwen3's layer where it attends; most layers instead mix tokens by a short
# depthwise causal convolution gated on both sides (b * x in, c * out), between in_proj and out_proj
_LFM2 = Architecture(
    "lfm2", plan=SHORT_CONV_LAYER, norms={"input_norm": "operator_norm.weight", "post_norm": "ffn_norm.weight"},
    matmuls={**_LLAMA_MATMULS, "o": ("self_attn.out_proj.weight",),
             "gate_up": ("feed_forward.w1.weight", "feed_forward.w3.weight"), "down": ("feed_forward.w2.weight",)},
    conv_matmuls={"qkv": ("conv.in_proj.weight",), "o": ("conv.out_proj.weight",)},
    conv_weight="conv.conv.weight", final_norm="model.embedding_norm", gguf_final_norm="token_embd_norm",
    extra_weights={"qk_norm": ("self_attn.q_layernorm.weight", "self_attn.k_layernorm.weight")},
    gguf_interleaved_qk=False,
    gguf_names={"attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
                "attn_output.weight": "self_attn.out_proj.weight", "attn_q_norm.weight": "self_attn.q_layernorm.weight",
                "attn_k_norm.weight": "self_attn.k_layernorm.weight", "ffn_gate.weight": "feed_forward.w1.weight",
                "ffn_up.weight": "feed_forward.w3.weight", "ffn_down.weight": "feed_forward.w2.weight",
                "shortconv.in_proj.weight": "conv.in_proj.weight", "shortconv.out_proj.weight": "conv.out_proj.weight",
                "shortconv.conv.weight": "conv.conv.weight"})
_LFM2_MOE_EXPERTS = ExpertNames(router="feed_forward.gate.weight", gate="feed_forward.experts.{e}.w1.weight",
                                up="feed_forward.experts.{e}.w3.weight", down="feed_forward.experts.{e}.w2.weight",
                                choice_bias="feed_forward.expert_bias")

# GPT-2 (DistilGPT2, DialoGPT, and models fine-tuned from them): learned absolute positions and no
# rotary, LayerNorms, biases on every matmul, an ungated GELU MLP (the tanh form), q/k/v fused; its
# Conv1D matrices stored [in, out], its names its own (with or without `transformer.`), its config's
# keys GPT-2's
def _gguf_named(names: dict[str, str]) -> dict[str, str]:
    """`gguf_names` of a row whose checkpoints name each layer tensor their own way (`names`: llama.cpp's
    name -> the checkpoint's), weights and biases alike."""
    return {f"{gguf}.{part}": f"{hf}.{part}" for gguf, hf in names.items() for part in ("weight", "bias")}


def _fused_matmuls(names: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The matmuls of a layer whose q/k/v and whose MLP's up projection are each one tensor, under
    the checkpoint's names (`names` as `_gguf_named`'s)."""
    return {field: (f"{names[gguf]}.weight",) for field, gguf in
            (("qkv", "attn_qkv"), ("o", "attn_output"), ("gate_up", "ffn_up"), ("down", "ffn_down"))}


_GPT2_NAMES = {"attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
               "attn_norm": "ln_1", "ffn_norm": "ln_2"}
_GPT2 = Architecture(
    "gpt2", plan=LAYER_NORM_GELU_LAYER,
    matmuls=_fused_matmuls(_GPT2_NAMES),
    norms={"input_norm": "ln_1.weight", "post_norm": "ln_2.weight"},
    hf_prefixes=tuple((top + ours, llama) for top in ("transformer.", "") for ours, llama in (
        ("h.", "model.layers."), ("wte.", "model.embed_tokens."), ("wpe.", "model.embed_positions."),
        ("ln_f.", "model.norm."))),
    hf_ignored=("attn.bias", "attn.masked_bias"),
    hf_transposed=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
    learned_positions=0,
    hf_keys={"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
             "layer_norm_epsilon": "layer_norm_eps", "activation_function": "hidden_act"},
    hf_defaults={"tie_word_embeddings": True, "layer_norm_eps": 1e-5},
    gguf_interleaved_qk=False,
    gguf_names=_gguf_named(_GPT2_NAMES))

# BLOOM (bigscience's 560M to 176B, BLOOMZ): GPT-2's sequential layer on LayerNorms with biases, a
# LayerNorm of the embeddings, ALiBi; q/k/v fused with each head's rows together, as GPT-NeoX's
# (llama.cpp's converter stores them apart); the MLP 4 x hidden_size wide (GPT-2's n_inner rule)
_BLOOM_NAMES = {"attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
                "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
_BLOOM = Architecture(
    "bloom", plan=LAYER_NORM_GELU_LAYER,
    matmuls=_fused_matmuls(_BLOOM_NAMES),
    hf_prefixes=tuple((top + ours, llama) for top in ("transformer.", "") for ours, llama in (
        ("h.", "model.layers."), ("word_embeddings_layernorm.", "model.embed_norm."),
        ("word_embeddings.", "model.embed_tokens."), ("ln_f.", "model.norm."))),
    hf_qkv_groups="num_attention_heads", alibi=True, embedding_norm=True,
    hf_keys={"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_inner": "intermediate_size",
             "layer_norm_epsilon": "layer_norm_eps", "seq_length": "max_position_embeddings"},
    hf_defaults={"tie_word_embeddings": True, "layer_norm_eps": 1e-5, "max_position_embeddings": 2048},
    gguf_interleaved_qk=False,
    gguf_names=_gguf_named(_BLOOM_NAMES))

# MPT (MosaicML's MPT-7B and 30B and their fine-tunes): GPT-2's sequential layer with an exact-GELU MLP,
# LayerNorms without biases (`no_bias`: none anywhere), ALiBi; its attention settings nested in
# `attn_config` (read by `with_llama_keys`), the MLP `expansion_ratio` x d_model wide
_MPT_NAMES = {"attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "ffn_up": "ffn.up_proj",
              "ffn_down": "ffn.down_proj", "attn_norm": "norm_1", "ffn_norm": "norm_2"}
_MPT = Architecture(
    "mpt", plan=with_activation(LAYER_NORM_LAYER, Op.GELU),
    matmuls=_fused_matmuls(_MPT_NAMES),
    norms={"input_norm": "norm_1.weight", "post_norm": "norm_2.weight"},
    hf_prefixes=tuple((top + ours, llama) for top in ("transformer.", "") for ours, llama in (
        ("blocks.", "model.layers."), ("wte.", "model.embed_tokens."), ("norm_f.", "model.norm."))),
    alibi=True,
    hf_keys={"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
             "max_seq_len": "max_position_embeddings", "layer_norm_epsilon": "layer_norm_eps"},
    hf_defaults={"tie_word_embeddings": True, "layer_norm_eps": 1e-5, "alibi": True, "expansion_ratio": 4},
    gguf_interleaved_qk=False,
    gguf_names=_gguf_named(_MPT_NAMES))

# llama.cpp's names of GPT-NeoX's matrices (the row below)
_GPT_NEOX_NAMES = {"attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
                   "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}

# Falcon (7B and its instruct, Falcon2-11B): attention and an ungated exact-GELU MLP side by side on
# one LayerNorm, as Command R's; one K/V head (`multi_query`) or `num_kv_heads` (its newer layers),
# q/k/v fused in groups; no biases (`bias`: read where the checkpoint has them); NeoX's rotary
_FALCON = Architecture(
    "falcon", plan=with_activation(PARALLEL_LAYER, Op.GELU), norms=_INPUT_NORM_ONLY,
    matmuls={"qkv": ("self_attention.query_key_value.weight",), "o": ("self_attention.dense.weight",),
             "gate_up": ("mlp.dense_h_to_4h.weight",), "down": ("mlp.dense_4h_to_h.weight",)},
    hf_prefixes=(("transformer.h.", "model.layers."), ("transformer.ln_f.", "model.norm."),
                 ("transformer.word_embeddings.", "model.embed_tokens.")),
    hf_qkv_groups="fused_qkv_groups", gguf_interleaved_qk=False,
    variants=(("num_ln_in_parallel_attn", 2, "attn_norm_2.weight", "falcon_ln2"),),
    hf_keys={"layer_norm_epsilon": "layer_norm_eps", "ffn_hidden_size": "intermediate_size", "activation": "hidden_act",
             "n_embed": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers"},
    hf_defaults={"tie_word_embeddings": True, "layer_norm_eps": 1e-5, "parallel_attn": True, "alibi": False,
                 "new_decoder_architecture": False, "multi_query": True},
    gguf_names={"attn_qkv.weight": "self_attention.query_key_value.weight",
                "attn_output.weight": "self_attention.dense.weight", "ffn_up.weight": "mlp.dense_h_to_4h.weight",
                "ffn_down.weight": "mlp.dense_4h_to_h.weight"})

# DeepSeek V2 (V2-Lite): latent attention in every layer, its fused projection the query's (or its
# low rank's) beside the compressed KV's; the first layers dense, then routed experts chosen by
# their softmax scores, not renormalized, beside shared experts (ungated, as one MLP).
_DEEPSEEK_V2 = Architecture(
    "deepseek_v2", plan=with_routed_experts(LATENT_LAYER), latent=LatentNames(),
    matmuls={**_LLAMA_MATMULS, "qkv": ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")},
    experts=dataclasses.replace(_GLM4_MOE_EXPERTS, choice_bias=None), expert_groups="group_limited_greedy",
    # llama.cpp's deepseek2 files: q/k rows as the checkpoint has them (the rotary turns interleaved
    # pairs), the experts' weights renormalized where the file says, the shared experts one MLP
    gguf_interleaved_qk=False, gguf_expert_weights_norm=False, gguf_shared_width_from_experts=True,
    gguf_names={"attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
                "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
                "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                "attn_kv_b.weight": "self_attn.kv_b_proj.weight", "attn_k_b.weight": "self_attn.k_b_proj.weight",
                "attn_v_b.weight": "self_attn.v_b_proj.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
                "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"})

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    Architecture("llama"),
    Architecture("mistral"),
    # Ministral (8B-2410): Mistral's layer, global and sliding-window layers as its layer_types say
    Architecture("ministral"),
    Architecture("granite"),  # Llama's layer; its multipliers are the config's scales (ModelConfig)
    Architecture("smollm3", gguf_nope_interval=4),  # Llama's layer; NoPE layers as the config's rope_layers
    Architecture("qwen2", gguf_interleaved_qk=False),
    # Seed-OSS (ByteDance's 36B): Llama's layer, q/k/v biases (and o's where attention_out_bias)
    Architecture("seed_oss", gguf_interleaved_qk=False),
    # Arcee AFM-4.5B: Llama's layer with an ungated MLP, down(relu(up(x)) ** 2)
    Architecture("arcee", plan=RELU_SQUARED_LAYER, matmuls={**_LLAMA_MATMULS, "gate_up": ("mlp.up_proj.weight",)}),
    # Ministral 3 (3B, 8B, 14B; inside Mistral3ForConditionalGeneration): Mistral's layer, YaRN, its
    # queries scaled by position past the original context (`ModelConfig.query_scaling`)
    Architecture("ministral3"),
    # Phi-3: q, k and v, and gate and up, stored fused, in Hugging Face's order (NeoX rotary).
    Architecture("phi3", matmuls={**_LLAMA_MATMULS, "qkv": ("self_attn.qkv_proj.weight",),
                                  "gate_up": ("mlp.gate_up_proj.weight",)},
                 gguf_interleaved_qk=False,
                 gguf_names={"attn_qkv.weight": "self_attn.qkv_proj.weight",
                             "ffn_up.weight": "mlp.gate_up_proj.weight"}),
    Architecture("qwen3", plan=QK_NORM_LAYER, extra_weights=_QK_NORM, gguf_interleaved_qk=False),
    # Qwen2.5-VL's and Qwen3-VL's language models (their vision-language checkpoints serve the text;
    # llama.cpp's qwen2vl and qwen3vl files): Qwen2's and Qwen3's layers. Their rotary in sections
    # for an image's grid (`mrope_section`) is, for text alone, every section at the token's
    # position: the plain rotary.
    Architecture("qwen2_5_vl_text", gguf_interleaved_qk=False),
    Architecture("qwen3_vl_text", plan=QK_NORM_LAYER, extra_weights=_QK_NORM, gguf_interleaved_qk=False),
    # OLMo (1B, 7B, 1.7: its `-hf` checkpoints): Llama's layer on LayerNorms without scale or bias
    # (eps 1e-5, fixed); q/k/v clipped (`clip_qkv`; GGUF `clamp_kqv`) refused
    Architecture("olmo", plan=LAYER_NORM_LAYER, weightless_norms=True, hf_defaults={"layer_norm_eps": 1e-5}),
    # OLMo 3's files say olmo2: its windows, every fourth layer global where a file does not list them
    Architecture("olmo2", plan=POST_NORM_LAYER, norms=_POST_NORMS, extra_weights=_QK_NORM, gguf_interleaved_qk=False,
                 window_pattern=4, local_rope_unscaled=True),
    # EXAONE 4: OLMo 2's layer (q/k normalized per head); where it slides (its 32B: three layers of
    # four), the global layers rotate nothing
    Architecture("exaone4", plan=POST_NORM_LAYER, norms=_POST_NORMS, extra_weights=_QK_NORM, gguf_interleaved_qk=False,
                 window_pattern=4, nope_where_global=True, gguf_window_layer_counts=(64,)),
    # OLMo 3: OLMo 2's layer, three sliding layers to one global, the sliding ones without rope scaling
    Architecture("olmo3", plan=POST_NORM_LAYER, norms=_POST_NORMS, extra_weights=_QK_NORM, gguf_interleaved_qk=False,
                 window_pattern=4, local_rope_unscaled=True),
    # Gemma (1, 1.1, CodeGemma): Llama's layer with a GeGLU, Gemma's embedding scale and norm offset
    Architecture("gemma", plan=GEGLU_LAYER, gguf_interleaved_qk=False, scaled_embedding=True, hf_norm_offset=1.0,
                 hf_gelu_means_tanh=True),
    _GEMMA2,
    dataclasses.replace(_GEMMA2, name="gemma3_text", plan=SANDWICH_QK_NORM_LAYER, extra_weights=_QK_NORM,
                        window_pattern=6, gguf_local_rope_theta=10000.0, gguf_wide_query_scale_layers=(62,)),
    # GLM-4 (GLM-4-9B/32B-0414, GLM-Z1): sandwich norms around a SwiGLU MLP (gate and up stored fused),
    # q/k/v biases, half of each head rotated as interleaved pairs
    Architecture("glm4", plan=SANDWICH_SWIGLU_LAYER,
                 norms={"input_norm": "input_layernorm.weight", "attn_out_norm": "post_self_attn_layernorm.weight",
                        "post_norm": "post_attention_layernorm.weight", "mlp_out_norm": "post_mlp_layernorm.weight"},
                 matmuls={**_LLAMA_MATMULS, "gate_up": ("mlp.gate_up_proj.weight",)},
                 gguf_interleaved_qk=False, interleaved_rotary=True, hf_partial_rotary_factor=0.5,
                 gguf_names={"ffn_up.weight": "mlp.gate_up_proj.weight",
                             "post_attention_norm.weight": "post_self_attn_layernorm.weight",
                             "post_ffw_norm.weight": "post_mlp_layernorm.weight"}),
    # ERNIE 4.5 (its dense models): Llama's layer, each head rotated as interleaved pairs
    Architecture("ernie4_5", gguf_interleaved_qk=False, interleaved_rotary=True),
    # GLM-4-9B in transformers' port (`glm`: glm-4-9b-chat-hf, GLM-Edge): Llama's layer, gate and up stored
    # fused, q/k/v biases, half of each head rotated as interleaved pairs (GLM-4's rotary, not its sandwich
    # norms); llama.cpp's `chatglm` files (of it, of GLM-4-9B's and ChatGLM3's own checkpoints: q/k/v fused)
    Architecture("glm", matmuls={**_LLAMA_MATMULS, "gate_up": ("mlp.gate_up_proj.weight",)},
                 gguf_interleaved_qk=False, interleaved_rotary=True, hf_partial_rotary_factor=0.5,
                 gguf_names={"ffn_up.weight": "mlp.gate_up_proj.weight"}),
    # Helium (Kyutai's Helium-1): Llama's layer, each head rotated as interleaved pairs
    Architecture("helium", gguf_interleaved_qk=False, interleaved_rotary=True),
    Architecture("mixtral", plan=with_routed_experts(LLAMA_LAYER), experts=_MIXTRAL_EXPERTS,
                 experts_always_renormalized=True),
    # Phi-3.5-MoE: Mixtral's experts on LayerNorms with biases, q/k/v/o biases and the LM head's; its
    # router's sparse mixer (`expert_scoring` "sparsemixer", its `router_jitter_noise` the eps); longrope.
    # llama.cpp computes a softmax over the two chosen in the mixer's stead: inflight reads its files
    # as the model computes (transformers)
    Architecture("phimoe", plan=with_routed_experts(LAYER_NORM_LAYER), experts=_MIXTRAL_EXPERTS,
                 expert_scoring="sparsemixer", gguf_interleaved_qk=False,
                 hf_defaults={"router_jitter_noise": 0.01}),
    # Granite 4.0's attention-only models (granite-4.0-micro; the hybrid ones' Mamba layers are
    # refused): Granite's multipliers and layer, the MLP its shared one (gate and up stored fused),
    # rotary only where position_embedding_type says rope. llama.cpp's converter writes these as granite.
    Architecture("granitemoehybrid", matmuls={**_LLAMA_MATMULS, "gate_up": ("shared_mlp.input_linear.weight",),
                                              "down": ("shared_mlp.output_linear.weight",)},
                 hf_intermediate_key="shared_intermediate_size", hf_position_embedding_type=True),
    # Granite MoE: Granite's multipliers, every MLP routed, its experts stacked in the checkpoint
    Architecture("granitemoe", plan=with_routed_experts(LLAMA_LAYER), experts=_GRANITE_MOE_EXPERTS,
                 experts_always_renormalized=True),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's layer, routed experts beside a shared
    # one; llama.cpp does not renormalize the chosen experts' weights for its files (nor does the
    # config's default)
    Architecture("qwen2_moe", plan=with_routed_experts(LLAMA_LAYER), gguf_interleaved_qk=False,
                 experts=_QWEN2_MOE_EXPERTS, gguf_expert_weights_norm=False,
                 gguf_names={"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                             "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                             "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                             "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}),
    Architecture("qwen3_moe", plan=with_routed_experts(QK_NORM_LAYER), extra_weights=_QK_NORM,
                 gguf_interleaved_qk=False, experts=_QWEN3_MOE_EXPERTS),
    # OLMoE: Llama's layer with q and k normalized over the whole projection (the scales' length
    # says which), every MLP routed, the chosen experts' weights not renormalized.
    Architecture("olmoe", plan=with_routed_experts(QK_NORM_LAYER), extra_weights=_QK_NORM,
                 gguf_interleaved_qk=False, experts=_QWEN3_MOE_EXPERTS, gguf_expert_weights_norm=False),
    # GLM-4.5, GLM-4.5-Air, GLM-4.6 (and their MTP layers left unread): q/k/v biases, q/k norm where
    # use_qk_norm, half of each head rotated (NeoX's halves); the first layers dense, then routed
    # experts chosen by sigmoid scores plus a bias, their weights scaled, beside a shared expert
    Architecture("glm4_moe", plan=with_routed_experts(QK_NORM_LAYER), extra_weights=_QK_NORM, gguf_interleaved_qk=False,
                 hf_partial_rotary_factor=0.5, experts=_GLM4_MOE_EXPERTS, expert_scoring="sigmoid",
                 hf_qk_norm_key="use_qk_norm", hf_norm_topk_prob=True, gguf_shared_width_from_experts=True,
                 expert_groups="always",
                 gguf_names={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
                             "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                             "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                             "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}),
    _DEEPSEEK_V2,
    # DeepSeek V3 (and R1, Moonlight, Kimi K2's shape) and GLM-4.7-Flash: V2's layer, the experts
    # chosen by sigmoid scores plus a bias, renormalized and scaled, as GLM-4.5's (their MTP layers
    # left unread)
    dataclasses.replace(_DEEPSEEK_V2, name="deepseek_v3", experts=_GLM4_MOE_EXPERTS, expert_scoring="sigmoid",
                        hf_norm_topk_prob=True, expert_groups="always"),
    dataclasses.replace(_DEEPSEEK_V2, name="glm4_moe_lite", experts=_GLM4_MOE_EXPERTS, expert_scoring="sigmoid",
                        hf_norm_topk_prob=True, expert_groups="always"),
    # Phi-2 (and Phi-1, Phi-1.5): attention and an ungated GELU MLP side by side on one LayerNorm,
    # biases on every matmul and on the LM head, part of each head rotated (NeoX's halves)
    Architecture("phi", plan=PARALLEL_GELU_LAYER, norms=_INPUT_NORM_ONLY, final_norm="model.final_layernorm",
                 matmuls={**_LLAMA_MATMULS, "o": ("self_attn.dense.weight",), "gate_up": ("mlp.fc1.weight",),
                          "down": ("mlp.fc2.weight",)},
                 gguf_interleaved_qk=False, hf_partial_rotary_factor=0.5,
                 gguf_names={"attn_output.weight": "self_attn.dense.weight", "attn_output.bias": "self_attn.dense.bias",
                             "ffn_up.weight": "mlp.fc1.weight", "ffn_up.bias": "mlp.fc1.bias",
                             "ffn_down.weight": "mlp.fc2.weight", "ffn_down.bias": "mlp.fc2.bias"}),
    # StableLM (2 1.6B, 3B): Llama's layer with LayerNorms, q/k/v biases where use_qkv_bias, a quarter
    # of each head rotated
    Architecture("stablelm", plan=LAYER_NORM_LAYER, gguf_interleaved_qk=False, hf_partial_rotary_factor=0.25),
    # StarCoder2: LayerNorms, biases on every matmul, an ungated GELU MLP
    Architecture("starcoder2", plan=LAYER_NORM_GELU_LAYER,
                 matmuls={**_LLAMA_MATMULS, "gate_up": ("mlp.c_fc.weight",), "down": ("mlp.c_proj.weight",)},
                 gguf_interleaved_qk=False,
                 gguf_names={"ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
                             "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias"}),
    # Nemotron (Nemotron-4 Minitron, Mistral-NeMo-Minitron's base): LayerNorms whose scales are stored
    # as (scale - 1), an ungated MLP of relu squared, half of each head rotated
    Architecture("nemotron", plan=LAYER_NORM_RELU_SQUARED_LAYER,
                 matmuls={**_LLAMA_MATMULS, "gate_up": ("mlp.up_proj.weight",)}, gguf_interleaved_qk=False,
                 hf_norm_offset=1.0, hf_partial_rotary_factor=0.5),
    # Apertus (8B, 70B): Qwen3's q/k norm, an ungated MLP of xIELU with each layer's own four numbers
    # (in a GGUF file: llama.cpp's `xielu.*` arrays), llama3 rope scaling
    Architecture("apertus", plan=XIELU_LAYER,
                 norms={"input_norm": "attention_layernorm.weight", "post_norm": "feedforward_layernorm.weight"},
                 matmuls={**_LLAMA_MATMULS, "gate_up": ("mlp.up_proj.weight",)},
                 extra_weights={**_QK_NORM, "xielu": XIELU_WEIGHTS}, gguf_interleaved_qk=False,
                 gguf_names={"attn_norm.weight": "attention_layernorm.weight",
                             "ffn_norm.weight": "feedforward_layernorm.weight"}),
    # Hunyuan's dense models (Hunyuan-0.5B to 7B): Llama's layer with q and k normalized per head after
    # the rotary, its "dynamic" rope a fixed NTK alpha
    Architecture("hunyuan_v1_dense", plan=QK_NORM_AFTER_ROTARY_LAYER, gguf_interleaved_qk=False, hf_ntk_alpha=True,
                 extra_weights={"qk_norm": ("self_attn.query_layernorm.weight", "self_attn.key_layernorm.weight")},
                 gguf_names={"attn_q_norm.weight": "self_attn.query_layernorm.weight",
                             "attn_k_norm.weight": "self_attn.key_layernorm.weight"}),
    # Command R (Cohere): attention and a SwiGLU MLP side by side on one LayerNorm without bias, each
    # head rotated as interleaved pairs, the logits scaled
    _COHERE,
    # Command R7B, Command A (Cohere2): Command R's layer, three sliding layers to one global, and
    # the global ones rotate nothing
    dataclasses.replace(_COHERE, name="cohere2", window_pattern=4, nope_where_global=True),
    # ERNIE 4.5's MoE models (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's layer; the first layers dense,
    # then routed experts chosen by their softmax scores plus a bias, the chosen renormalized, beside
    # a shared expert (its MTP layers left unread)
    Architecture("ernie4_5_moe", plan=with_routed_experts(LLAMA_LAYER), gguf_interleaved_qk=False,
                 interleaved_rotary=True, experts=_ERNIE_MOE_EXPERTS, experts_always_renormalized=True,
                 gguf_shared_width_from_experts=True,
                 gguf_names={"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias",
                             "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                             "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                             "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}),
    _LFM2,
    # LFM2's MoE (LFM2-8B-A1B): LFM2's layers, the first dense, then routed experts chosen by their
    # sigmoid scores plus a per-expert bias, weighted by those sigmoids renormalized (`use_expert_bias`
    # false refused)
    dataclasses.replace(_LFM2, name="lfm2_moe", plan=with_routed_experts(SHORT_CONV_LAYER), experts=_LFM2_MOE_EXPERTS,
                        expert_scoring="sigmoid", hf_norm_topk_prob=True,
                        gguf_names={**_LFM2.gguf_names, "exp_probs_b.bias": "feed_forward.expert_bias"}),
    # gpt-oss: Llama's layer with biases on every attention matmul and learned attention sinks (a
    # score per head that joins each softmax's sum), sliding and global layers alternating, YaRN;
    # every MLP routed, the softmax over the chosen experts' scores, their clamped SwiGLU with biases
    Architecture("gpt_oss", plan=with_routed_experts(LLAMA_LAYER), extra_weights={"sinks": ("self_attn.sinks",)},
                 gguf_interleaved_qk=False, window_pattern=2, experts=_GPT_OSS_EXPERTS,
                 experts_always_renormalized=True, clamped_swiglu=(1.702, 7.0),
                 gguf_names={"attn_sinks.weight": "self_attn.sinks"}),
    _GPT2,
    # StarCoder (1), SantaCoder's successors, WizardCoder (GPTBigCode): GPT-2's layer with one K and
    # V head (`multi_query`), its matrices stored as other models' are
    dataclasses.replace(_GPT2, name="gpt_bigcode", hf_transposed=(),
                        hf_defaults={**_GPT2.hf_defaults, "multi_query": True}),
    # OPT (125M to 66B, but 350M's projected embeddings and norms after each block): learned
    # positions from row 2, LayerNorms, biases on every matmul, an ungated ReLU MLP
    Architecture("opt", plan=LAYER_NORM_RELU_LAYER,
                 matmuls={**_LLAMA_MATMULS, "o": ("self_attn.out_proj.weight",), "gate_up": ("fc1.weight",),
                          "down": ("fc2.weight",)},
                 norms={"input_norm": "self_attn_layer_norm.weight", "post_norm": "final_layer_norm.weight"},
                 hf_prefixes=tuple((top + "decoder." + ours, llama) for top in ("model.", "") for ours, llama in (
                     ("layers.", "model.layers."), ("embed_tokens.", "model.embed_tokens."),
                     ("embed_positions.", "model.embed_positions."), ("final_layer_norm.", "model.norm."))),
                 learned_positions=2, hf_keys={"ffn_dim": "intermediate_size", "activation_function": "hidden_act"},
                 hf_defaults={"tie_word_embeddings": True, "layer_norm_eps": 1e-5}),
    # GPT-J (GPT-J-6B and its fine-tunes): attention and an ungated GELU MLP (tanh) side by side on one
    # LayerNorm, as Phi-2's; q, k and v apart without biases, the MLP's and the LM head's with them;
    # the first `rotary_dim` dims of each head rotated as interleaved pairs; GPT-2's names and keys
    Architecture("gptj", plan=PARALLEL_GELU_LAYER, norms={"input_norm": "ln_1.weight"},
                 matmuls={"qkv": ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"),
                          "o": ("attn.out_proj.weight",), "gate_up": ("mlp.fc_in.weight",),
                          "down": ("mlp.fc_out.weight",)},
                 hf_prefixes=_GPT2.hf_prefixes, hf_ignored=_GPT2.hf_ignored, interleaved_rotary=True,
                 hf_keys=_GPT2.hf_keys, hf_defaults={"tie_word_embeddings": False, "layer_norm_eps": 1e-5}),
    _FALCON,
    _BLOOM,
    _MPT,
    # Falcon-40B and 180B: Falcon's layer, the parallel block on two LayerNorms (`ln_attn`, `ln_mlp`;
    # llama.cpp's `attn_norm_2` and `attn_norm`, in that order), as GPT-NeoX's
    dataclasses.replace(_FALCON, name="falcon_ln2", plan=PARALLEL_TWO_NORM_GELU_LAYER, variants=(),
                        variant_of="falcon", norms={"input_norm": "ln_attn.weight", "post_norm": "ln_mlp.weight"},
                        gguf_names={**_FALCON.gguf_names, "attn_norm_2.weight": "ln_attn.weight",
                                    "attn_norm_2.bias": "ln_attn.bias", "attn_norm.weight": "ln_mlp.weight",
                                    "attn_norm.bias": "ln_mlp.bias"}),
    # GPT-NeoX (Pythia, GPT-NeoX-20B, Dolly v2, RedPajama-INCITE): attention and an ungated exact-GELU
    # MLP side by side, each on its own LayerNorm; biases on every matmul; a quarter of each head
    # rotated (NeoX's halves); q/k/v fused head by head
    Architecture("gpt_neox", plan=PARALLEL_TWO_NORM_GELU_LAYER, matmuls=_fused_matmuls(_GPT_NEOX_NAMES),
                 hf_prefixes=(("gpt_neox.layers.", "model.layers."), ("gpt_neox.embed_in.", "model.embed_tokens."),
                              ("gpt_neox.final_layer_norm.", "model.norm."), ("embed_out.", "lm_head.")),
                 hf_ignored=("attention.bias", "attention.masked_bias"),
                 hf_qkv_groups="num_attention_heads",
                 hf_partial_rotary_factor=0.25, gguf_interleaved_qk=False,
                 hf_keys={"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"},
                 hf_defaults={"layer_norm_eps": 1e-5, "use_parallel_residual": True},
                 gguf_names=_gguf_named(_GPT_NEOX_NAMES)),
]}

# llama.cpp's architecture names that differ from Hugging Face's model_type; and those it gives
# to files with routed experts (`expert_count`), which Hugging Face names apart.
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                      "mistral3": "ministral3", "qwen2vl": "qwen2_5_vl_text", "qwen3vl": "qwen3_vl_text",
                      "gpt-oss": "gpt_oss", "glm4moe": "glm4_moe", "phi2": "phi", "command-r": "cohere",
                      "ernie4_5-moe": "ernie4_5_moe", "hunyuan-dense": "hunyuan_v1_dense",
                      "lfm2moe": "lfm2_moe", "deepseek2": "deepseek_v2", "starcoder": "gpt_bigcode",
                      "gptneox": "gpt_neox", "chatglm": "glm"}
GGUF_EXPERT_ARCHITECTURES = {"llama": "mixtral", "mistral": "mixtral"}
# llama.cpp's architectures whose files hold models of two rows, told apart by the router's
# scoring: DeepSeek V2's softmax, V3's (and GLM-4.7-Flash's) sigmoids plus a bias.
GGUF_SIGMOID_ARCHITECTURES = {"deepseek_v2": "deepseek_v3"}

# llama.cpp's stacked expert tensors (`blk.N.` + these, [experts, rows, cols]) -> which of an
# `ExpertNames`' weights each expert's slice holds, in row order (the router: one weight).
GGUF_EXPERT_NAMES: dict[str, tuple[str, ...]] = {
    "ffn_gate_inp.weight": ("router",), "ffn_gate_exps.weight": ("gate",), "ffn_up_exps.weight": ("up",),
    "ffn_down_exps.weight": ("down",),
    # gate and up in one tensor: what llama.cpp's converter writes with --fuse-gate-up-exps (and
    # for Granite's sliding-window MoE models)
    "ffn_gate_up_exps.weight": ("gate", "up"),
    # their biases, `[experts, rows]` (gpt-oss's)
    "ffn_gate_inp.bias": ("router",), "ffn_gate_exps.bias": ("gate",), "ffn_up_exps.bias": ("up",),
    "ffn_down_exps.bias": ("down",)}

# llama.cpp's tensor names (`blk.N.` + these) -> Hugging Face's (`model.layers.N.` + these).
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_norm.bias": "input_layernorm.bias",  # a LayerNorm's (StableLM's, StarCoder2's, Phi-2's)
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # of attention's output (OLMo 2)
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}") from None
