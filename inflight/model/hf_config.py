"""The one reader of a Hugging Face `config.json`: the decoder's shapes and rotary settings as a
`ModelConfig`, for the loader (which then checks that it can run the architecture) and for the
simulator (which needs only the shapes of any Llama-like decoder)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from inflight.config import LatentAttention, ModelConfig
from inflight.errors import ModelLoadError
from inflight.model.architectures import ARCHITECTURES, Architecture

# Architectures whose attention always has q, k and v biases, whatever the config says.
_QKV_BIAS_ARCHITECTURES = ("qwen2", "qwen2_5_vl_text")  # and Qwen2-MoE where its qkv_bias says (its default)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON file's object; ModelLoadError naming the file where it is not one."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not {what}")
    return raw


def read_hf_config(path: Path, architectures: Sequence[str] | None = None,
                   overrides: dict[str, Any] | None = None) -> ModelConfig:
    """`path` is a config.json; raises ModelLoadError if it cannot be read, lacks a field, or
    (given `architectures`) names another `model_type`. `overrides` replace the decoder's keys
    (`--hf-overrides`) before anything is read."""
    raw = read_json_object(path, "a model config")
    if overrides:
        if isinstance(raw.get("text_config"), dict):
            raw["text_config"] = {**raw["text_config"], **overrides}
        else:
            raw.update(overrides)
    if is_multimodal(raw):
        raw = {**raw, "text_config": _complete_text_config(raw)}
    else:
        raw = with_llama_keys(raw)
    arch = (raw.get("text_config") or raw).get("model_type", "llama")
    if architectures is not None and arch not in architectures:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {', '.join(architectures)}")
    if architectures is not None:
        refuse_unsupported(raw.get("text_config") or raw, path)
    try:
        return parse_hf_config(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"incomplete or invalid {path}: {type(exc).__name__}: {exc}") from None


def with_llama_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A config whose architecture names its settings its own way (GPT-2's n_embd, OPT's ffn_dim)
    under the names `parse_hf_config` reads, its class's defaults where it leaves a setting out;
    GPT-2's MLP 4 x hidden_size wide where n_inner is null, GPTBigCode's `multi_query` as one
    K/V head, GPT-J's `rotary_dim` as a share of each head, Falcon's K/V heads and the groups its
    fused q/k/v projection is stored in (`fused_qkv_groups`), MPT's `attn_config` flattened and its
    MLP `expansion_ratio` x d_model wide. Any other config as it is."""
    row = ARCHITECTURES.get(str(raw.get("model_type")))
    if row is None or not (row.hf_keys or row.hf_defaults):
        return raw
    out = dict(row.hf_defaults)
    out.update((row.hf_keys.get(key, key), value) for key, value in raw.items())
    if row.hf_keys.get("n_inner") == "intermediate_size" and out.get("intermediate_size") is None and isinstance(
            out.get("hidden_size"), int):  # (a config without it is refused by parse_hf_config)
        out["intermediate_size"] = 4 * out["hidden_size"]
    if out.get("rotary_dim") is not None and isinstance(out.get("hidden_size"), int) and isinstance(
            out.get("num_attention_heads"), int):  # GPT-J's rotated dims, as a share of each head
        out["partial_rotary_factor"] = out["rotary_dim"] / (out["hidden_size"] // out["num_attention_heads"])
    if "new_decoder_architecture" in out:  # Falcon's K/V heads, and the groups its fused q/k/v is stored in
        heads, newer = out.get("num_attention_heads"), out["new_decoder_architecture"]
        kv = out.get("num_kv_heads") or heads
        out["num_key_value_heads"] = kv if newer or not out.get("multi_query") else 1
        out["fused_qkv_groups"] = kv if newer else 0 if out.get("multi_query") else heads
        if newer and out.get("num_ln_in_parallel_attn") is None:  # (transformers' reading: two LayerNorms)
            out["num_ln_in_parallel_attn"] = 2
    elif "multi_query" in out:
        out["num_key_value_heads"] = 1 if out.pop("multi_query") else out.get("num_attention_heads")
    if isinstance(out.get("attn_config"), dict):  # MPT's attention settings, over the defaults
        out.update((key, value) for key, value in out.pop("attn_config").items() if key not in raw)
    if out.get("intermediate_size") is None and "expansion_ratio" in out and isinstance(out.get("hidden_size"), int):
        out["intermediate_size"] = int(out["expansion_ratio"] * out["hidden_size"])  # (MPT's)
    return out


def is_multimodal(raw: dict[str, Any]) -> bool:
    """Whether a config.json describes a vision-language model, whose decoder inflight serves."""
    return isinstance(raw.get("text_config"), dict) or isinstance(raw.get("vision_config"), dict)


def _complete_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's decoder settings as transformers reads them: its config class built
    from config.json, and the decoder's settings taken from it: the keys `text_config` gives over
    the text config class's defaults (Gemma 3's 4B and larger give five), or the decoder's keys
    beside `vision_config` (Qwen2.5-VL's first configs), rotary settings normalized as the class
    normalizes them. A `model_type` transformers does not know: `text_config` as given, else
    config.json's own keys."""
    from transformers import AutoConfig

    try:
        built = AutoConfig.for_model(raw.get("model_type"), **{k: v for k, v in raw.items() if k != "model_type"})
        text = built.get_text_config()
    except Exception:  # transformers raises many kinds (an unknown type, a field its validation refuses)
        return raw.get("text_config") or raw
    return {**text.to_dict(), "model_type": text.model_type}


# generation_config.json's sampling settings and SamplingParams' names for them (vLLM's set:
# `--generation-config auto` applies these and nothing else of the file).
GENERATION_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(directory: Path) -> tuple[tuple[int, ...], dict[str, float]]:
    """A checkpoint's generation_config.json (none: nothing): the tokens that end a generation
    (`eos_token_id`, one or a list: Llama 3's instruct models end a turn with <|eot_id|>, which
    their config.json does not name) and its sampling settings under SamplingParams' names.
    ModelLoadError, naming the file, where it cannot be read or a value is not a number."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return (), {}
    raw = read_json_object(path, "a generation config")
    eos = raw.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
        raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of them, got {raw['eos_token_id']!r}")
    sampling = {}
    for key, name in GENERATION_SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ModelLoadError(f"{path}: {key} must be a number, got {value!r}")
        sampling[name] = value
    return tuple(eos), sampling


# Config keys that change the arithmetic, and the values under which it is what inflight computes.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_softcapping": (None,),
    "use_bidirectional_attention": (None, False),
    "quantization_config": (None,),
    "clip_qkv": (None,),
    # LFM2's convolutions' and projections' biases (none in its published models); LFM2-MoE's experts
    # chosen without their bias (its published model has one)
    "conv_bias": (None, False),
    "use_expert_bias": (None, True),
    # Phi-2's and StableLM 2 12B's q/k LayerNorms (a scale per head), and StableLM 2 12B's parallel block
    "qk_layernorm": (None, False),
    "use_parallel_residual": (None, False),  # (GPT-NeoX's plan: true, its default)
    # GPT-2's (and GPTBigCode's): queries scaled by head_dim ** -0.5 and by nothing else; no cross-attention
    "scale_attn_weights": (None, True),
    "scale_attn_by_inverse_layer_idx": (None, False),
    "add_cross_attention": (None, False),
    # Falcon's: rotary (not ALiBi), a parallel block (not a sequential one), on one LayerNorm or (its
    # 40B's and 180B's) two
    "alibi": (None, False),
    # MPT's attention (`attn_config`, flattened by `with_llama_keys`): no q/k LayerNorms, no clipping
    # (above), causal over the whole sequence; its LayerNorms plain ones (the low-precision kind is
    # a training one); BLOOM's residual from before each LayerNorm
    "qk_ln": (None, False),
    "prefix_lm": (None, False),
    "attn_type": (None, "multihead_attention"),
    "norm_type": (None, "low_precision_layernorm", "layernorm"),
    "apply_residual_connection_post_layernorm": (None, False),
    "parallel_attn": (None, True),
    "num_ln_in_parallel_attn": (None, 1, 2),
    # OPT's: a LayerNorm before each block (350M's after), with scales, and after the last layer
    "do_layer_norm_before": (None, True),
    "layer_norm_elementwise_affine": (None, True),
    "_remove_final_layer_norm": (None, False),
}
# The config keys `parse_hf_config` reads: each one's effect on the arithmetic is computed.
READ_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "rope_local_base_freq", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "bos_token_id",
    "eos_token_id", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "sliding_window_pattern", "_sliding_window_pattern", "attention_multiplier", "query_pre_attn_scalar",
    "embedding_multiplier", "residual_multiplier", "logits_scaling", "no_rope_layers", "no_rope_layer_interval",
    "attn_logit_softcapping", "final_logit_softcapping", "hidden_act", "hidden_activation", "num_local_experts",
    "partial_rotary_factor", "original_max_position_embeddings",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
    "decoder_sparse_step", "shared_expert_intermediate_size", "qkv_bias", "use_bias",
    "shared_intermediate_size", "position_embedding_type", "swiglu_alpha", "swiglu_limit",
    # GLM-4.5's routed experts and layers
    "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
    "use_qk_norm", "num_nextn_predict_layers",
    # ERNIE 4.5's routed experts and layers
    "moe_num_experts", "moe_k", "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
    "moe_layer_interval",
    # the LayerNorm models' epsilon (Phi-2's, StableLM's, Command R's; StarCoder2's; Nemotron's), Command R's
    # logits' factor, StableLM's q/k/v biases
    "layer_norm_eps", "norm_epsilon", "norm_eps", "logit_scale", "use_qkv_bias",
    # LFM2's layers (`layer_types`, or the attending ones by index), its convolutions' taps and its MLP's width
    "full_attn_idxs", "conv_L_cache", "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier", "block_multiple_of",
    # LFM2-MoE's dense first layers
    "num_dense_layers",
    # DeepSeek's latent attention (`LatentAttention`), and its experts' settings that original configs
    # carry (refused where they change the arithmetic); GLM-4.7-Flash's dense and routed layers
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "rope_interleave", "topk_method", "scoring_func", "moe_layer_freq", "mlp_layer_types",
    # GPT-2's, GPTBigCode's, OPT's and GPT-NeoX's names for the settings above (`Architecture.hf_keys`),
    # GPTBigCode's one K/V head, and OPT's embedding width (refused where not hidden_size)
    "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "layer_norm_epsilon", "activation_function",
    "ffn_dim", "rotary_pct", "rotary_emb_base", "multi_query", "word_embed_proj_dim", "rotary_dim",
    # Falcon's names (and its K/V heads' and fused q/k/v's reading, above)
    "ffn_hidden_size", "activation", "num_kv_heads", "new_decoder_architecture", "n_embed",
    # MPT's names, its nested attention settings (`with_llama_keys`), its MLP's width as a factor, ALiBi's
    # largest slope's exponent and its softmax scale; BLOOM's context
    "d_model", "n_heads", "n_layers", "max_seq_len", "attn_config", "expansion_ratio", "alibi_bias_max",
    "softmax_scale", "seq_length",
    # Phi-3.5-MoE's sparse mixer's eps (`ModelConfig.sparsemixer_eps`; Mixtral's, Qwen's: training's noise)
    "router_jitter_noise",
})
# Config keys without effect on a forward pass in inference: training settings, bookkeeping,
# generation defaults; and `mlp_bias`, whose biases are read from the checkpoint where they are.
NO_EFFECT_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id",
    "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder",
    "problem_type", "initializer_range", "use_cache", "pad_token_id", "attention_dropout", "resid_pdrop",
    "embd_pdrop", "mlp_bias", "output_router_logits", "router_aux_loss_coef",
    # Seed-OSS's: o's bias read from the checkpoint where it is (as mlp_bias'), its dropout
    "attention_out_bias", "residual_dropout",
    # Phi-3.5-MoE's: noise on training's inputs; the LM head's bias, read where the checkpoint has it
    "input_jitter_noise", "lm_head_bias",
    # ERNIE 4.5's floor under the sum its chosen experts' weights are renormalized by (1e-12: never reached by a
    # softmax's top k)
    "moe_norm_min",
    # StableLM's and StarCoder2's dropouts
    "hidden_dropout", "embedding_dropout",
    # Hunyuan's end-of-document token, a pretraining marker (its turns end at eos_token_id and the
    # generation config's)
    "eod_token_id",
    # gpt-oss's published configs: the experts per token again (transformers reads
    # num_experts_per_tok) and the original context again (YaRN's, in rope_scaling)
    "experts_per_token", "initial_context_length",
    # Granite 4.0's Mamba layers' settings: a config with such a layer is refused by its layer_types
    "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_head", "mamba_d_conv", "mamba_expand",
    "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit",
    # DeepSeek's original configs: training's load balancing and expert parallelism
    "aux_loss_alpha", "seq_aux", "ep_size",
    # GPT-2's: its double-heads model's summary head, attention's dropout, and its attention upcast to
    # fp32 in training (inflight's is fp32 already); GPTBigCode's softmax in fp32 alike
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "attn_pdrop", "reorder_and_upcast_attn", "attention_softmax_in_fp32", "scale_attention_softmax_in_fp32",
    # OPT's: training's dropouts and initialization, and its biases, read from the checkpoint where they are
    "dropout", "layerdrop", "init_std", "enable_bias",
    # GPT-NeoX's: a classification head's dropout, and whether its attention is causal (always, here)
    "classifier_dropout", "is_decoder",
    # Falcon's biases, read from the checkpoint where they are
    "bias",
    # a matmul cut into that many slices whose products are summed (BLOOM's `slow_but_exact`,
    # Llama 2's in transformers 4): the same sums
    "pretraining_tp", "slow_but_exact",
    # MPT's: biases read where the checkpoint has them (`no_bias`: none), dropouts, training's
    # attention implementation and packed-sequence masking, where its weights are made; a learned
    # position table, which transformers' MPT never reads (a checkpoint holding one, `wpe`, is
    # refused by its unread weight)
    "no_bias", "emb_pdrop", "attn_impl", "attn_uses_sequence_id", "embedding_fraction",
    "init_device", "learned_pos_emb",
})
# Keys of `rope_scaling` / `rope_parameters`, and the rope types `rope_inv_freq` computes.
ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings", "partial_rotary_factor", "short_factor", "long_factor",
                       "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
                       # Ministral 3's: its queries' scaling past the original context (`query_scaling`),
                       # and the positions it serves, which the config's own key says too
                       "llama_4_scaling_beta", "max_position_embeddings",
                       # a VL model's rotary in sections for an image's grid: for text, the plain one
                       "mrope_section", "mrope_interleaved",
                       # Hunyuan's NTK alpha (`Architecture.hf_ntk_alpha`)
                       "alpha"})
ROPE_TYPES = (None, "default", "linear", "llama3", "longrope", "su", "yarn")
# Each activation of a plan's MLP under the names configs give it.
_ACTIVATION_NAMES = {"silu": (None, "silu", "swish"), "relu": (None, "relu"), "gelu": (None, "gelu"),
                     # (gelu_new: Phi's name for the same tanh form)
                     "gelu_pytorch_tanh": (None, "gelu_pytorch_tanh", "gelu_tanh", "gelu_new"),
                     "relu2": (None, "relu2"), "xielu": (None, "xielu")}


def refuse_unsupported(raw: dict[str, Any], path: Path) -> None:
    """Raises ModelLoadError naming the first config key whose value changes the arithmetic in a
    way inflight does not compute: silence would serve a different model."""
    arch = ARCHITECTURES[raw.get("model_type", "llama")]
    names = _ACTIVATION_NAMES[arch.activation] + (("gelu",) if arch.hf_gelu_means_tanh else ())
    neutral = {**_NEUTRAL, "hidden_act": names, "hidden_activation": _ACTIVATION_NAMES[arch.activation],
               # where the architecture's plan computes another value of such a key, that one (GPT-NeoX's block)
               **{key: (None, value) for key, value in arch.hf_defaults.items() if key in _NEUTRAL}}
    quantization = raw.get("quantization_config")
    if (isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"
            and arch.experts is not None and arch.experts.stacked):  # gpt-oss's published form: its
        del neutral["quantization_config"]  # stacks' `_blocks` and `_scales` are read as MXFP4 (loader)
    for key, values in neutral.items():
        if key in raw and raw[key] not in values:
            raise ModelLoadError(f"{path}: {key} = {raw[key]!r} changes the model's arithmetic in a way "
                                 "inflight does not compute yet")
    layer_types = set(raw.get("layer_types") or ())
    known = {"full_attention", "sliding_attention", "attention"} | ({"conv"} if arch.conv_matmuls else set())
    if layer_types - known:  # ("attention": Granite 4.0's name for full)
        raise ModelLoadError(f"{path}: layer_types {sorted(layer_types)}: inflight computes "
                             f"{', '.join(sorted(known))} layers only for {arch.name}")
    if raw.get("use_qk_norm") and arch.hf_qk_norm_key != "use_qk_norm":  # Command R+'s per-head LayerNorms
        raise ModelLoadError(f"{path}: use_qk_norm = true changes the model's arithmetic in a way inflight does not "
                             f"compute yet for {arch.name}")
    width = raw.get("word_embed_proj_dim")  # OPT-350M's embeddings, projected in and out of the layers
    if width is not None and width != raw.get("hidden_size"):
        raise ModelLoadError(f"{path}: word_embed_proj_dim = {width} projects the embeddings in and out of the "
                             f"{raw.get('hidden_size')}-wide layers, which inflight does not compute")
    if arch.expert_groups is None and (groups := _expert_groups(raw, arch)) != (1, 1):  # DeepSeek's choice
        raise ModelLoadError(f"{path}: n_group = {groups[0]}, topk_group = {groups[1]}: inflight chooses "
                             f"{arch.name}'s experts from all of them, not within groups")
    for key in ("n_shared_experts", "moe_num_shared_experts"):
        if (raw.get(key) or 0) > 0 and (arch.experts is None or not arch.experts.shared):
            raise ModelLoadError(f"{path}: {key} = {raw[key]}: inflight runs no shared experts for {arch.name}")
    if arch.latent is not None:
        _refuse_latent(raw, arch, path)
    if arch.expert_scoring == "sparsemixer" and raw.get("num_experts_per_tok", 2) != 2:  # (as transformers' always)
        raise ModelLoadError(f"{path}: num_experts_per_tok = {raw['num_experts_per_tok']}: Phi-3.5-MoE's sparse "
                             "mixer chooses 2 experts")
    experts = _num_experts(raw)
    if experts and arch.experts is None:
        key = next(k for k in _EXPERT_COUNT_KEYS if raw.get(k))
        raise ModelLoadError(f"{path}: {key} = {experts}: inflight runs no routed experts for {arch.name}")
    _refuse_rope(raw, path)


def _expert_groups(raw: dict[str, Any], arch: Architecture) -> tuple[int, int]:
    """`ModelConfig.expert_groups` from n_group and topk_group, where the architecture's router
    uses them (V2's only under topk_method "group_limited_greedy", as its code and transformers');
    `refuse_unsupported` refuses them where it has none."""
    groups, kept = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if kept >= groups or arch.expert_groups not in (None, "always", raw.get("topk_method")):
        return 1, 1  # every group kept, or the groups unused
    return groups, kept


def _refuse_latent(raw: dict[str, Any], arch: Architecture, path: Path) -> None:
    """DeepSeek's settings as its original configs give them: the choice of experts by the
    architecture's own scores (V2's softmax, V3's sigmoids plus a bias), in every layer past the
    dense ones, V2's weights not renormalized (transformers never renormalizes them); and no
    scaling of the queries by position (Mistral Large 3's, which the latent step does not compute)."""
    method = raw.get("topk_method")
    if method not in (None, "greedy", "noaux_tc", "group_limited_greedy"):
        raise ModelLoadError(f"{path}: topk_method = {method!r}: inflight chooses experts by their top scores only")
    scoring = raw.get("scoring_func")
    if scoring is not None and scoring != arch.expert_scoring:
        raise ModelLoadError(f"{path}: scoring_func = {scoring!r}: inflight scores {arch.name}'s experts by "
                             f"{arch.expert_scoring} only")
    if (raw.get("moe_layer_freq") or 1) != 1:
        raise ModelLoadError(f"{path}: moe_layer_freq = {raw['moe_layer_freq']}: inflight routes every layer past "
                             "the dense ones")
    if _rope_parameters(raw)[0].get("llama_4_scaling_beta"):  # (Mistral Large 3's, on DeepSeek V3's layers)
        raise ModelLoadError(f"{path}: llama_4_scaling_beta: inflight does not scale {arch.name}'s latent queries by "
                             "position")
    if not arch.hf_norm_topk_prob and raw.get("norm_topk_prob"):
        raise ModelLoadError(f"{path}: norm_topk_prob = true: transformers never renormalizes {arch.name}'s "
                             "experts' weights, DeepSeek's code does; inflight refuses the ambiguity")


def _latent_attention(raw: dict[str, Any]) -> LatentAttention:
    """DeepSeek's latent attention's shapes (V2's rotary always interleaved pairs)."""
    q_rank = raw.get("q_lora_rank")
    return LatentAttention(
        kv_lora_rank=int(raw["kv_lora_rank"]), qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]), v_head_dim=int(raw["v_head_dim"]),
        q_lora_rank=int(q_rank) if q_rank else None, rope_interleaved=bool(raw.get("rope_interleave", True)))


def latent_softmax_scale(latent: LatentAttention, rope_scaling: dict[str, Any] | None) -> float:
    """Latent attention's softmax scale: 1 / sqrt of a head's query width, times YaRN's
    0.1 ln(factor) mscale_all_dim + 1 squared where the rotary is YaRN's with `mscale_all_dim`
    (DeepSeek's reference scales every dim's scores so, not the rotated ones alone), as
    transformers' `yarn_apply_mscale`."""
    scale = latent.qk_head_dim ** -0.5
    scaling = rope_scaling or {}
    factor, all_dim = float(scaling.get("factor") or 1.0), float(scaling.get("mscale_all_dim") or 0.0)
    if scaling.get("rope_type") == "yarn" and all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _refuse_rope(raw: dict[str, Any], path: Path) -> None:
    rope, local = _rope_parameters(raw)
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{path}: rope_type {kind!r}: inflight computes the rotary embedding of rope types "
                             f"{', '.join(str(t) for t in ROPE_TYPES[1:])} only")
    if local is not None and local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{path}: the sliding layers' rope_type {local['rope_type']!r}: inflight scales the "
                             "rotary embedding of full-attention layers only")


# What `--hf-overrides` may set for a GGUF file, whose other settings come from its metadata.
GGUF_OVERRIDABLE = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")


def override_rotary(config: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """A GGUF model's config with its rotary settings replaced by config.json keys (`--hf-overrides`,
    as llama.cpp's --rope-scaling and --yarn-orig-ctx): only `GGUF_OVERRIDABLE`, each refused or
    computed as from a config.json."""
    other = sorted(set(overrides) - set(GGUF_OVERRIDABLE))
    if other:
        raise ModelLoadError(f"hf_overrides: {', '.join(other)}: a GGUF file's settings come from its metadata; "
                             f"inflight overrides its rotary ones only ({', '.join(GGUF_OVERRIDABLE)})")
    raw = {"model_type": config.architecture, "rope_theta": config.rope_theta,
           "max_position_embeddings": config.max_position_embeddings, **overrides}
    _refuse_rope(raw, Path("hf_overrides"))
    try:
        rotary = rotary_settings(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"hf_overrides: {type(exc).__name__}: {exc}") from None
    if rotary.local is not None or (rotary.scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("hf_overrides: a GGUF file's local rotary or partial rotary comes from its metadata")
    scaling = rotary.scaling if {"rope_scaling", "rope_parameters"} & set(overrides) else config.rope_scaling
    return dataclasses.replace(config, rope_theta=rotary.theta, max_position_embeddings=rotary.max_positions,
                               rope_scaling=scaling)


def _rope_parameters(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The rotary settings of the full-attention layers and, where they differ, of the
    sliding-window ones: from `rope_scaling` or `rope_parameters` (newer configs, which also
    carry `rope_theta`, and for Gemma 3 one entry per layer type) and `rope_local_base_freq`."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention")
        params = dict(params.get("full_attention") or {})
    if raw.get("rope_local_base_freq") is not None:
        local = {"rope_type": "default", "rope_theta": raw["rope_local_base_freq"]}
    row = ARCHITECTURES.get(str(raw.get("model_type")))
    kind = params.get("rope_type", params.get("type"))
    if row is not None and row.hf_ntk_alpha and kind == "dynamic" and params.get("alpha"):
        # Hunyuan's "dynamic" with a fixed alpha: NTK-aware scaling that only stretches the base, by
        # alpha ** (d / (d - 2)) for heads of d, as transformers computes it for Hunyuan (and llama.cpp's
        # converter writes the stretched base)
        dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
        theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
        params = {"rope_type": "default", "rope_theta": theta * float(params["alpha"]) ** (dim / (dim - 2))}
    return params, local


class RotarySettings(NamedTuple):
    theta: float
    scaling: dict[str, Any] | None  # None: no scaling
    local: dict[str, Any] | None  # the sliding layers' own, where they differ
    max_positions: int


def rotary_settings(raw: dict[str, Any]) -> RotarySettings:
    """A decoder config's rotary base and scaling (normalized: rope_type set, longrope's and
    YaRN's original context and factor found as transformers finds them) and the positions it
    serves. Raises KeyError, TypeError or ValueError on a bad field."""
    rope_scaling: dict[str, Any] | None
    rope_scaling, local_rope = _rope_parameters(raw)
    rope_theta = rope_scaling.get("rope_theta") or raw.get("rope_theta") or 10000.0
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    max_positions = int(raw.get("max_position_embeddings", 4096))
    if kind in (None, "default"):
        rope_scaling = None
    elif kind in ("su", "longrope"):  # Phi-3's: the original context may sit beside the factors
        rope_scaling = {"original_max_position_embeddings": raw.get("original_max_position_embeddings"),
                        **rope_scaling, "rope_type": "longrope"}
        if rope_scaling["original_max_position_embeddings"] is None:
            raise ValueError("longrope needs original_max_position_embeddings")
    elif kind == "yarn":  # the original context as transformers finds it: beside the rope settings first
        original = int(raw.get("original_max_position_embeddings")
                       or rope_scaling.get("original_max_position_embeddings") or max_positions)
        factor = float(rope_scaling.get("factor") or max_positions / original)
        rope_scaling = {**rope_scaling, "rope_type": "yarn", "original_max_position_embeddings": original,
                        "factor": factor}
    return RotarySettings(float(rope_theta), rope_scaling, local_rope, served_positions(max_positions, rope_scaling))


def served_positions(max_positions: int, rope_scaling: dict[str, Any] | None) -> int:
    """The positions a model serves: its `max_positions`, or what YaRN stretches its original
    context to where that is more, as vLLM derives it (Qwen3's config keeps 40960 beside a factor
    of 4 over 32768 when its card's YaRN settings are added)."""
    if rope_scaling is None or rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return max_positions
    return max(max_positions, int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"]))


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    """A config.json's contents as a `ModelConfig`. Multimodal configs nest the decoder's under
    `text_config`; rotary settings sit in `rope_scaling` or, in newer configs, `rope_parameters`
    (which also carries `rope_theta`). Raises KeyError, TypeError or ValueError on a bad field."""
    raw = raw.get("text_config") or raw
    arch = str(raw.get("model_type", "llama"))
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    row = ARCHITECTURES.get(arch)
    for key, value, _, name in row.variants if row is not None else ():  # (Falcon-40B's two LayerNorms)
        if raw.get(key) == value:
            arch, row = name, ARCHITECTURES[name]
            break
    rotary = rotary_settings(raw)
    rope_scaling, local_rope = rotary.scaling, rotary.local
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    rope_given = _rope_parameters(raw)[0]  # as config.json gives them (a default type's too)
    partial = (raw.get("partial_rotary_factor") or rope_given.get("partial_rotary_factor")
               or (row.hf_partial_rotary_factor if row is not None else 1.0))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    sliding = _window_layers(raw, row) if window is not None else None
    attention_scale = raw.get("attention_multiplier") or raw.get("softmax_scale")  # (Granite's; MPT's)
    if raw.get("query_pre_attn_scalar") is not None:
        attention_scale = float(raw["query_pre_attn_scalar"]) ** -0.5
    num_experts = _num_experts(raw)
    query = query_scaling((rope_scaling or {}).get("original_max_position_embeddings"),
                          rope_given.get("llama_4_scaling_beta"))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    conv = _conv_layers(raw) if row is not None and row.conv_matmuls else None
    latent = _latent_attention(raw) if row is not None and row.latent is not None else None
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    rotary_dim = int(head_dim * float(partial)) if float(partial) != 1 else None
    if latent is not None:  # the pool's row (the latent and the rotated key) is attention's one key head
        head_dim, num_kv_heads = latent.kv_lora_rank + latent.qk_rope_head_dim, 1
        rotary_dim, attention_scale = latent.qk_rope_head_dim, latent_softmax_scale(latent, rope_scaling)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=_mlp_width(raw, row),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rms_norm_eps=_norm_eps(raw, row),
        rope_theta=rotary.theta,
        max_position_embeddings=rotary.max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch in _QKV_BIAS_ARCHITECTURES or bool(raw.get("attention_bias", False))
        or bool(raw.get("qkv_bias", False)) or bool(raw.get("use_bias", False))
        or bool(raw.get("use_qkv_bias", False)),
        rope_scaling=rope_scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=int(window) if window is not None else None,
        sliding_window_layers=sliding,
        attention_scale=float(attention_scale) if attention_scale is not None else None,
        embedding_scale=hidden ** 0.5 if row is not None and row.scaled_embedding else float(
            raw.get("embedding_multiplier") or 1.0),
        residual_scale=float(raw.get("residual_multiplier") or 1.0),
        # Granite's logits_scaling divides the logits, Command R's logit_scale multiplies them
        logit_scale=float(raw.get("logits_scaling") or 1.0) / float(raw.get("logit_scale") or 1.0),
        rope_layers=_rope_layers(raw, row, sliding, window is not None),
        position_offset=row.learned_positions if row is not None else None,
        alibi_max_bias=float(raw.get("alibi_bias_max") or 8.0) if row is not None and row.alibi else None,
        local_rope_theta=_local_rope_theta(local_rope, rotary.theta, row) if window is not None else None,
        query_scaling=query,
        attn_logit_softcap=_positive(raw.get("attn_logit_softcapping")),
        final_logit_softcap=_positive(raw.get("final_logit_softcapping")),
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or raw.get("moe_k") or 0) if num_experts else 0,
        moe_intermediate_size=int(raw["moe_intermediate_size"]) if raw.get("moe_intermediate_size") else None,
        # as the architecture always does, else as the config says or its class's default (no);
        # without experts the field's default
        norm_topk_prob=(not num_experts or (row is not None and row.experts_always_renormalized)
                        or bool(raw.get("norm_topk_prob", row is not None and row.hf_norm_topk_prob))),
        moe_layers=_moe_layers(raw) if num_experts else None,
        shared_expert_intermediate_size=_shared_width(raw) if num_experts else None,
        expert_scoring=row.expert_scoring if row is not None else "softmax",
        sparsemixer_eps=float(raw["router_jitter_noise"])
        if row is not None and row.expert_scoring == "sparsemixer" else 0.0,
        routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
        expert_groups=_expert_groups(raw, row) if num_experts and row is not None else (1, 1),
        qk_norm=bool(raw.get(row.hf_qk_norm_key, False)) if row is not None and row.hf_qk_norm_key else True,
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        gated_mlp=row.gated_mlp if row is not None else True,
        clamped_swiglu=(float(raw.get("swiglu_alpha") or row.clamped_swiglu[0]),
                        float(raw.get("swiglu_limit") or row.clamped_swiglu[1]))
        if row is not None and row.clamped_swiglu is not None else None,
        conv_layers=conv,
        conv_kernel=int(raw.get("conv_L_cache") or 3) if conv is not None else 0,
        latent_attention=latent,
    )


def _mlp_width(raw: dict[str, Any], row: Architecture | None) -> int:
    """The MLP's width: the config's (Granite 4.0's shared MLP's under its own key), or LFM2's
    where `block_auto_adjust_ff_dim` derives it as transformers does: two thirds, times the
    multiplier, rounded up to a multiple of `block_multiple_of`."""
    width = int(raw[row.hf_intermediate_key if row is not None else "intermediate_size"])
    if not raw.get("block_auto_adjust_ff_dim"):
        return width
    width = int(2 * width / 3)
    if raw.get("block_ffn_dim_multiplier") is not None:
        multiple = int(raw.get("block_multiple_of") or 256)
        width = int(float(raw["block_ffn_dim_multiplier"]) * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _conv_layers(raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """LFM2's short-convolution layers, from `layer_types` ("conv"), else every layer not in
    `full_attn_idxs`; None where every layer attends."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is not None:
        conv = tuple(t == "conv" for t in types[:layers])
    else:
        attending = set(raw.get("full_attn_idxs") or range(layers))
        conv = tuple(i not in attending for i in range(layers))
    return conv if any(conv) else None


def _norm_eps(raw: dict[str, Any], row: Architecture | None) -> float:
    """The norms' epsilon: an RMSNorm's `rms_norm_eps`, a LayerNorm's `layer_norm_eps` (StarCoder2's
    `norm_epsilon`, Nemotron's `norm_eps`), the architecture's own kind first; else transformers'
    Llama default."""
    rms, layer = ("rms_norm_eps",), ("layer_norm_eps", "norm_epsilon", "norm_eps")
    for key in layer + rms if row is not None and row.layer_norm else rms + layer:
        if raw.get(key) is not None:
            return float(raw[key])
    return 1e-6


def query_scaling(original: int | None, beta: float | None) -> tuple[float, int] | None:
    """A model's queries' scaling by position (Llama 4's and Ministral 3's: times
    1 + beta * ln(1 + floor(position / original))) as `ModelConfig.query_scaling`; None: none."""
    if not beta:
        return None
    if not original:
        raise ValueError("a query scaling by position (llama_4_scaling_beta) needs original_max_position_embeddings")
    return float(beta), int(original)


def _local_rope_theta(local: dict[str, Any] | None, theta: float, row: Architecture | None) -> float | None:
    """The sliding layers' own rotary base (they rotate unscaled at it), from their entry of the
    rotary settings, else the global base where the architecture's local layers rotate unscaled
    (OLMo 3); None: they share the global layers' rotary."""
    if local is not None:
        return float(local.get("rope_theta") or theta)
    return theta if row is not None and row.local_rope_unscaled else None


# The keys under which configs give the routed experts of each MoE layer (Mixtral's, Qwen's, GLM's, ERNIE's).
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _num_experts(raw: dict[str, Any]) -> int:
    """The routed experts a config gives each MoE layer (0: none)."""
    return int(next((raw[k] for k in _EXPERT_COUNT_KEYS if raw.get(k)), 0))


def _moe_layers(raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """Which layers route to experts: every `decoder_sparse_step`-th one (ERNIE 4.5's
    `moe_layer_interval`) not in `mlp_only_layers` (Qwen3-MoE) from the `first_k_dense_replace`-th
    on (GLM-4.5; ERNIE 4.5's `moe_layer_start_index`, up to its `moe_layer_end_index`; LFM2-MoE's
    `num_dense_layers`); None: every layer."""
    if raw.get("mlp_layer_types") is not None:  # GLM-4.7-Flash's: "dense" or "sparse" per layer
        routed = tuple(t == "sparse" for t in raw["mlp_layer_types"][:int(raw["num_hidden_layers"])])
        return None if all(routed) else routed
    step = int(raw.get("decoder_sparse_step") or raw.get("moe_layer_interval") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    layers = int(raw["num_hidden_layers"])
    first = int(next((raw[k] for k in ("first_k_dense_replace", "moe_layer_start_index", "num_dense_layers")
                      if raw.get(k)), 0))
    last = layers - 1 if raw.get("moe_layer_end_index") is None else int(raw["moe_layer_end_index"])
    routed = tuple(i not in dense and (i + 1) % step == 0 and first <= i <= last for i in range(layers))
    return None if all(routed) else routed


def _shared_width(raw: dict[str, Any]) -> int | None:
    """A shared expert's width: Qwen2-MoE's `shared_expert_intermediate_size`, or GLM-4.5's
    `n_shared_experts` experts' (moe_intermediate_size each) as one; None: no shared expert."""
    if raw.get("shared_expert_intermediate_size"):
        return int(raw["shared_expert_intermediate_size"])
    shared = raw.get("n_shared_experts") or raw.get("moe_num_shared_experts")  # GLM-4.5's, ERNIE 4.5's
    if shared:
        return int(shared) * int(raw["moe_intermediate_size"])
    return None


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _window_layers(raw: dict[str, Any], row: Architecture | None) -> tuple[bool, ...] | None:
    """Which layers slide, from `layer_types` (Qwen2's from its `max_window_layers`; Gemma's
    from its `sliding_window_pattern`, every n-th layer global); None: every layer does
    (Mistral)."""
    types = raw.get("layer_types")
    layers = int(raw["num_hidden_layers"])
    if types is None and raw.get("max_window_layers") is not None:
        types = ["sliding_attention" if i >= int(raw["max_window_layers"]) else "full_attention"
                 for i in range(layers)]
    pattern = raw.get("sliding_window_pattern") or (row.window_pattern if row is not None else None)
    if types is None and pattern:
        types = ["sliding_attention" if local else "full_attention" for local in window_pattern(int(pattern), layers)]
    if types is None or all(t == "sliding_attention" for t in types):
        return None
    return tuple(t == "sliding_attention" for t in types)


def _rope_layers(raw: dict[str, Any], row: Architecture | None = None, sliding: tuple[bool, ...] | None = None,
                 slides: bool = False) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers` (1: the layer uses rotary, 0: it does not), or its default of a
    NoPE layer every `no_rope_layer_interval` layers; where an architecture's global layers rotate
    nothing once it slides (`slides`; `sliding`: which layers do, None: all), the sliding ones;
    None for a model whose layers all rotate."""
    layers = int(raw["num_hidden_layers"])
    if row is not None and (row.learned_positions is not None or row.alibi):  # positions elsewhere, not rotated
        return (False,) * layers
    if row is not None and row.nope_where_global and slides:
        return sliding
    if row is not None and row.hf_position_embedding_type and raw.get("position_embedding_type") != "rope":
        return (False,) * layers
    if raw.get("no_rope_layers") is not None:
        return tuple(bool(x) for x in raw["no_rope_layers"][:layers])
    if raw.get("model_type") == "smollm3":
        return nope_every(int(raw.get("no_rope_layer_interval", 4)), layers)
    return None


def window_pattern(pattern: int, num_layers: int) -> tuple[bool, ...]:
    """Every `pattern`-th layer global, the others sliding (llama.cpp's `set_swa_pattern`)."""
    return tuple(i % pattern < pattern - 1 for i in range(num_layers))


def nope_every(interval: int, num_layers: int) -> tuple[bool, ...]:
    """Every `interval`-th layer without rotary, the others with it."""
    return tuple((i + 1) % interval != 0 for i in range(num_layers))
