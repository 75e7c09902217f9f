"""Loading: GGUF (every supported tensor type) and safetensors checkpoints against transformers,
the tokenizer and incremental detokenizer, and clear errors for bad models."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import VOCABS

from inflight import ModelLoadError
from inflight.engine.block_manager import BlockManager
from inflight.engine.runner import ModelRunner
from inflight.engine.sampler import Sampler
from inflight.engine.scheduler import ScheduledRequest
from inflight.model.architectures import ARCHITECTURES, GGUF_LAYER_NAMES
from inflight.model.grid_quants import GRID_TYPES
from inflight.model.llama import LlamaModel
from inflight.model.loader import load_checkpoint, resolve_model
from inflight.model.tokenizer import IncrementalDetokenizer
from inflight.request import Request, SamplingParams

TINY = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=320)


def inflight_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, through the paged runner (one prefill step)."""
    runner = ModelRunner(model, 64, 16, Sampler(torch.device("cpu")))
    bm = BlockManager(64, 16)
    req = Request("t", ids, SamplingParams())
    bm.allocate_slots(req, len(ids))
    inputs = runner.prepare([ScheduledRequest(req, 0, len(ids), bm.block_table("t"))])
    return model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_meta,
                         torch.arange(len(ids)))


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


# --- safetensors directories ---------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_safetensors_model_matches_transformers(tmp_path, loaded, arch):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
                  num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"],
                  num_key_value_heads=TINY["kv_heads"], max_position_embeddings=256, rms_norm_eps=1e-5)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    with torch.no_grad():  # random biases, so that a dropped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.eval().save_pretrained(tmp_path, safe_serialization=True)
    loaded.tokenizer.hf.save_pretrained(tmp_path)

    source = resolve_model(str(tmp_path))
    assert source.kind == "hf"
    config, weights = load_checkpoint(source, torch.float32)
    assert config.attention_bias == (arch == "qwen2")
    ours = LlamaModel(config, weights, torch.device("cpu"))
    ids = list(range(5, 5 + 120))  # beyond the llama3 scaling's original length of 64
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [256, 7])
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_a_sliding_window_is_computed_across_chunks_and_cached_prefixes(tmp_path, loaded, arch, chunk):
    """A window of 24 positions over prompts of 40-70 tokens, in every layer (Mistral) or from
    the second layer on (Qwen2's max_window_layers): each query of a sliding layer attends to
    the last 24 positions only, whether its prompt is prefilled whole or in chunks of 7, reads a
    cached prefix, or decodes past the window; the greedy tokens are transformers'. Where every
    layer slides, a request holds only the blocks its window covers."""
    import transformers

    from inflight import LLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
        num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"],
        max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=24)
    if arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **common, use_sliding_window=True, max_window_layers=1))
    model.eval().generation_config.eos_token_id = None
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded.tokenizer.hf.save_pretrained(tmp_path)
    shared = list(range(5, 5 + 32))  # two full blocks, cached after the first request
    prompts = [shared + list(range(100, 100 + n)) for n in (8, 38)] + [list(range(50, 50 + 45))]
    llm = LLM(model=str(tmp_path), num_kv_blocks=64, max_num_tokens=chunk, enable_chunked_prefill=True)
    assert llm.engine.model_config.sliding_window_layers == (None if arch == "mistral" else (False, True))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = []
    for prompt in prompts:
        bm = llm.engine.block_manager
        bm.reset_peak()
        outs.append(llm.generate([prompt], params)[0])
        if arch == "mistral" and chunk == 7:  # blocks behind the window went back to the pool as it moved
            assert bm.peak_used_blocks <= -(-(24 + 7) // 16) + 1 < -(-(len(prompt) + 40) // 16)
        assert bm.num_used_blocks == 0
    assert outs[1].num_cached_tokens == 32
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):]
        assert out.token_ids == expected.tolist()


def test_every_bias_the_checkpoint_has_is_applied_and_no_weight_is_left_out(tmp_path):
    """Llama with attention_bias (q, k, v and o) and mlp_bias: each bias read, as transformers
    applies it; a weight no step of the plan reads (here a q_norm on a Llama) is refused by name."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
        num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"],
        max_position_embeddings=256, rms_norm_eps=1e-5, attention_bias=True, mlp_bias=True)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config_, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    ours = LlamaModel(config_, weights, torch.device("cpu"))
    ids = list(range(5, 5 + 40))
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)

    [file] = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.1.self_attn.q_norm.weight"] = torch.ones(TINY["hidden"] // TINY["heads"])
    save_file(tensors, str(file), metadata={"format": "pt"})
    config_, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    with pytest.raises(ModelLoadError, match="does not use: model.layers.1.self_attn.q_norm.weight"):
        LlamaModel(config_, weights, torch.device("cpu"))


@pytest.mark.parametrize(("key", "value"), [
    ("hidden_act", "gelu_pytorch_tanh"), ("use_bidirectional_attention", True),
    ("layer_types", ["full_attention", "chunked_attention"]), ("rope_scaling", {"rope_type": "dynamic", "factor": 4.0}),
    ("quantization_config", {"quant_method": "gptq", "bits": 4}), ("quantization_config", {"quant_method": "mxfp4"}),
    ("clip_qkv", 8.0), ("n_group", 8), ("qk_layernorm", True), ("use_parallel_residual", True), ("use_qk_norm", True)])
def test_a_config_key_that_changes_the_arithmetic_is_refused_by_name(tmp_path, key, value):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
        num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"],
        max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    load_checkpoint(resolve_model(str(tmp_path)), torch.float32)  # as saved: loads
    raw = json.loads((tmp_path / "config.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic'" if key == "rope_scaling" else key):
        load_checkpoint(resolve_model(str(tmp_path)), torch.float32)


@pytest.mark.parametrize("arch", sorted(name for name, row in ARCHITECTURES.items() if row.variant_of is None))
def test_every_config_key_of_each_architecture_is_read_or_known_to_change_nothing(arch):
    """transformers' config class of each architecture, field by field: inflight reads the field,
    knows it has no effect on a forward pass, or refuses values other than the neutral ones. A
    field a new transformers adds fails here until it is decided, instead of being ignored."""
    from transformers import AutoConfig

    from inflight.model import hf_config

    config = AutoConfig.for_model(arch).to_dict()
    known = hf_config.READ_KEYS | hf_config.NO_EFFECT_KEYS | set(hf_config._NEUTRAL)
    assert set(config) - known == set()
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key) or {}
        for entry in params.values() if {"full_attention", "sliding_attention"} & set(params) else [params]:
            assert set(entry) <= hf_config.ROPE_KEYS


def write_gguf_from_hf(path: Path, arch: str, model, fused_qkv: bool = False, matrices: str = "F32") -> None:
    """`model`'s config and fp32 weights as llama.cpp's converter writes them, under its tensor
    names: q and k rows in Hugging Face's order for NeoX-rotary architectures (Qwen2, Qwen3,
    OLMo 2), each head's rotary halves interleaved for the Llama-style ones (Granite, SmolLM3);
    `fused_qkv`: q, k and v in one `attn_qkv` tensor (older conversions of Phi-2); `matrices`: the
    layers' matrices in that GGUF type;
    Granite's multipliers as its scales."""
    import gguf

    from inflight.model.architectures import GGUF_LAYER_NAMES, architecture

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    one_plus_norms = arch.startswith("gemma") or arch == "nemotron"  # (1 + w) norm scales
    sandwich = arch in ("gemma2", "gemma3_text")  # Gemma 1's post_attention_layernorm comes before its MLP
    gguf_arch = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
                 "olmo3": "olmo2", "ministral3": "mistral3", "granitemoehybrid": "granite",
                 "gpt_oss": "gpt-oss", "glm4_moe": "glm4moe", "phi": "phi2", "cohere": "command-r",
                 "ernie4_5_moe": "ernie4_5-moe", "hunyuan_v1_dense": "hunyuan-dense",
                 "lfm2_moe": "lfm2moe"}.get(arch, arch)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    conv_layers = [t == "conv" for t in cfg.layer_types] if arch in ("lfm2", "lfm2_moe") else []
    if getattr(cfg, "num_experts_per_tok", None) and (getattr(cfg, "num_local_experts", None)
                                                      or getattr(cfg, "num_experts", None)):
        w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        if arch == "ernie4_5_moe":  # as llama.cpp's converter writes ERNIE 4.5's
            w.add_expert_shared_count(cfg.moe_num_shared_experts)
        if arch == "glm4_moe":  # as llama.cpp's converter writes GLM-4.5's
            w.add_expert_shared_count(cfg.n_shared_experts)
            w.add_leading_dense_block_count(cfg.first_k_dense_replace)
            w.add_expert_weights_scale(cfg.routed_scaling_factor)
            w.add_expert_weights_norm(cfg.norm_topk_prob)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if arch == "lfm2_moe":  # as llama.cpp's converter writes LFM2-MoE's (and its routed scaling)
            w.add_leading_dense_block_count(cfg.num_dense_layers)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            w.add_expert_weights_scale(cfg.routed_scaling_factor)
    # GLM-4.5's multi-token-prediction layers: counted as blocks, written after the others
    mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    w.add_block_count(cfg.num_hidden_layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(mtp)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if arch == "lfm2":  # the width its config derives (block_auto_adjust_ff_dim), as llama.cpp's converter writes it
        w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.weight.shape[0])
    else:
        w.add_feed_forward_length(getattr(cfg, "shared_intermediate_size", None) or cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if conv_layers:  # LFM2's: a count per layer, 0 where it convolves (as llama.cpp's converter writes it)
        w.add_head_count_kv([0 if conv else cfg.num_key_value_heads for conv in conv_layers])
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if rope.get("alpha"):  # Hunyuan's NTK alpha: the stretched base, as llama.cpp's converter writes it
        w.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2)))
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes YaRN
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if arch == "ministral3":  # as llama.cpp's converter writes Ministral 3's
            w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
            w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
        for key, add in [("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)]:
            if rope.get(key) is not None:
                add(rope[key])
    # (OLMo 3's files of older converters lack it: the local layers take the global base unscaled)
    if (local := cfg.rope_parameters.get("sliding_attention")) is not None and arch != "olmo3":
        w.add_rope_freq_base_swa(local["rope_theta"])
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    for key, add in [("attn_logit_softcapping", w.add_attn_logit_softcapping),
                     ("final_logit_softcapping", w.add_final_logit_softcapping)]:
        if getattr(cfg, key, None):
            add(getattr(cfg, key))
    if architecture(arch).layer_norm:  # a LayerNorm's epsilon, under its own key
        w.add_layer_norm_eps(next(getattr(cfg, key) for key in ("layer_norm_eps", "norm_epsilon", "norm_eps")
                                  if getattr(cfg, key, None) is not None))
    else:
        w.add_layer_norm_rms_eps(getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps)
    if getattr(cfg, "logit_scale", None) is not None:  # Command R's factor of the logits
        w.add_logit_scale(cfg.logit_scale)
    if arch == "apertus":  # its xIELU numbers as llama.cpp's converter writes them: an array each, a number a layer
        for part, add in (("alpha_p", w.add_xielu_alpha_p), ("alpha_n", w.add_xielu_alpha_n),
                          ("beta", w.add_xielu_beta), ("eps", w.add_xielu_eps)):
            add([float(getattr(layer.mlp.act_fn, part)) for layer in model.model.layers])
    w.add_vocab_size(cfg.vocab_size)
    w.add_pad_token_id(0)  # inside the tiny vocabulary (transformers' Phi-3 default is not)
    for key, scale in [("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                       ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)]:
        if getattr(cfg, key, None) is not None:
            scale(getattr(cfg, key))

    def interleaved(rows: torch.Tensor, heads: int) -> torch.Tensor:  # llama.cpp's LlamaModel.permute
        return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    to_gguf = {hf: g for g, hf in GGUF_LAYER_NAMES.items()}
    to_gguf.update({hf: g for g, hf in architecture(arch).gguf_names.items()})
    # Hugging Face's post_attention_layernorm is llama.cpp's ffn_norm where it comes before the
    # MLP (Qwen) and its post_attention_norm where it normalizes attention's output (OLMo 2).
    # (gpt-oss's and Seed-OSS's: before the MLP, under llama.cpp's name for a post-attention norm)
    post_norms = arch in ("olmo2", "olmo3", "exaone4", "gpt_oss", "seed_oss") or sandwich
    to_gguf["post_attention_layernorm.weight"] = "post_attention_norm.weight" if post_norms else "ffn_norm.weight"
    final, gguf_final = architecture(arch).final_norm, architecture(arch).gguf_final_norm
    top = {"model.embed_tokens.weight": "token_embd.weight", f"{final}.weight": f"{gguf_final}.weight",
           f"{final}.bias": f"{gguf_final}.bias", "lm_head.weight": "output.weight", "lm_head.bias": "output.bias"}
    state = dict(model.state_dict())
    written: dict[str, np.ndarray] = {}  # the layers' tensors and the top ones, as llama.cpp names them
    last = f"model.layers.{cfg.num_hidden_layers - 1}."
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + mtp):  # an MTP block: the last layer's and its own
        state.update({f"model.layers.{i}.{n.removeprefix(last)}": t for n, t in model.state_dict().items()
                      if n.startswith(last)})
        for own, shape in (("eh_proj.weight", (cfg.hidden_size, 2 * cfg.hidden_size)),
                           ("enorm.weight", (cfg.hidden_size,)), ("hnorm.weight", (cfg.hidden_size,))):
            w.add_tensor(f"blk.{i}.nextn.{own}", torch.randn(shape).numpy())
    for name, tensor in state.items():
        if one_plus_norms and name.endswith("norm.weight"):  # as llama.cpp's Gemma and Nemotron converters store them
            tensor = tensor + 1
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        moe = {"granitemoe": "block_sparse_moe.", "lfm2_moe": "feed_forward."}.get(arch, "mlp.")
        if arch == "gpt_oss" and ".mlp." in name:  # [experts, in, out] stacks, gate and up interleaved: split
            prefix = name.split("mlp.")[0].replace("model.layers.", "blk.")
            kind = name.split("mlp.")[1]
            if kind.startswith("router."):
                w.add_tensor(prefix + "ffn_gate_inp." + kind.removeprefix("router."), tensor.detach().float().numpy())
                continue
            is_bias = kind.endswith("_bias")
            t = tensor.detach().float() if is_bias else tensor.detach().float().transpose(1, 2)
            parts = {"gate": t[:, ::2], "up": t[:, 1::2]} if "gate_up" in kind else {"down": t}
            for part, value in parts.items():
                w.add_tensor(f"{prefix}ffn_{part}_exps.{'bias' if is_bias else 'weight'}", value.contiguous().numpy())
            continue
        if name.endswith(moe + "experts.gate_up_proj"):  # [experts, 2 * width, hidden]: stacked as llama.cpp's
            prefix = name.removesuffix(moe + "experts.gate_up_proj").replace("model.layers.", "blk.")
            if arch == "granitemoe":  # gate and up in one tensor, as llama.cpp's --fuse-gate-up-exps writes
                w.add_tensor(prefix + "ffn_gate_up_exps.weight", tensor.detach().float().numpy())
                continue
            gate, up = tensor.chunk(2, dim=1)
            w.add_tensor(prefix + "ffn_gate_exps.weight", gate.contiguous().float().numpy())
            w.add_tensor(prefix + "ffn_up_exps.weight", up.contiguous().float().numpy())
            continue
        if name.endswith((moe + "experts.down_proj", "mlp.gate.weight", "block_sparse_moe.router.weight",
                          "feed_forward.gate.weight")):
            prefix = name.replace("model.layers.", "blk.").rsplit(moe, 1)[0]  # stacked experts, the router
            kind = "ffn_down_exps.weight" if name.endswith("down_proj") else "ffn_gate_inp.weight"
            w.add_tensor(prefix + kind, tensor.detach().float().numpy())
            continue
        if name.endswith("shared_mlp.input_linear.weight"):  # Granite 4.0's gate and up, split as llama.cpp's
            prefix = name.removesuffix("shared_mlp.input_linear.weight").replace("model.layers.", "blk.")
            gate, up = tensor.chunk(2, dim=0)
            w.add_tensor(prefix + "ffn_gate.weight", gate.contiguous().float().numpy())
            w.add_tensor(prefix + "ffn_up.weight", up.contiguous().float().numpy())
            continue
        if name.endswith("shared_mlp.output_linear.weight"):
            w.add_tensor(name.replace("model.layers.", "blk.").replace("shared_mlp.output_linear", "ffn_down"),
                         tensor.detach().float().numpy())
            continue
        if ".mlp.act_fn." in name:  # Apertus's xIELU numbers: metadata arrays, one number a layer (below)
            continue
        if name.endswith("feed_forward.expert_bias"):  # LFM2-MoE's choice bias
            w.add_tensor(name.replace("model.layers.", "blk.").replace("feed_forward.expert_bias", "exp_probs_b.bias"),
                         tensor.detach().float().numpy())
            continue
        if name.endswith("mlp.gate.moe_statics.e_score_correction_bias"):  # ERNIE 4.5's [1, experts], a vector
            prefix = name.removesuffix("mlp.gate.moe_statics.e_score_correction_bias").replace("model.layers.", "blk.")
            w.add_tensor(prefix + "exp_probs_b.bias", tensor.detach().float().reshape(-1).numpy())
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):  # [1, hidden], which llama.cpp declares a vector
            tensor = tensor.reshape(-1)
        if name.endswith("conv.conv.weight"):  # LFM2's taps [hidden, 1, kernel], squeezed as llama.cpp's converter does
            tensor = tensor.squeeze(1)
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{to_gguf[rest]}"
        else:
            gguf_name = top[name]
        llama_style = arch in ("granite", "granitemoe", "granitemoehybrid", "smollm3", "mixtral", "ministral3", "arcee")
        if llama_style and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = interleaved(tensor, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        written[gguf_name] = tensor.detach().float().numpy()
    for i in range(cfg.num_hidden_layers if fused_qkv else 0):
        for suffix in ("weight", "bias"):
            if f"blk.{i}.attn_q.{suffix}" in written:
                written[f"blk.{i}.attn_qkv.{suffix}"] = np.concatenate(
                    [written.pop(f"blk.{i}.attn_{part}.{suffix}") for part in "qkv"])
    for gguf_name, array in written.items():
        if matrices != "F32" and array.ndim == 2 and gguf_name.startswith("blk.") and "shortconv.conv" not in gguf_name:
            kind = gguf.GGMLQuantizationType[matrices]
            w.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _layer_norm_eps(settings: dict[str, Any], key: str = "layer_norm_eps") -> dict[str, Any]:
    """A LayerNorm model's config settings: the norms' epsilon under its own key."""
    return {**{k: v for k, v in settings.items() if k != "rms_norm_eps"}, key: settings["rms_norm_eps"]}


def assert_setting_refused(path: Path, arch: str, key: str, value: Any, match: str) -> None:
    """`tiny_hf_model(arch)` saved at `path` loads; with `key` set to `value` in its config.json,
    loading it is refused with a message matching `match`."""
    tiny_hf_model(arch).save_pretrained(path, safe_serialization=True)
    load_checkpoint(resolve_model(str(path)), torch.float32)  # as saved: loads
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ModelLoadError, match=match):
        load_checkpoint(resolve_model(str(path)), torch.float32)


def tiny_hf_model(arch: str, vocab: int = TINY["vocab"], **fields: Any) -> Any:
    """A small transformers model of `arch` with seeded random weights, its norm scales and
    biases moved away from 1 and 0 so that a dropped one shows; `fields` go to its config."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=TINY["intermediate"],
                  num_hidden_layers=TINY["layers"], num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, **fields)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=128))
    elif arch == "olmo2":
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common))
    elif arch == "smollm3":  # 4 layers: the fourth is NoPE, as llama.cpp fixes it for this architecture
        model = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**{**common, "num_hidden_layers": 4},
                                                                           pad_token_id=0))
    elif arch == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, sliding_window=None, pad_token_id=0))
    elif arch == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **common, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.0,
            logits_scaling=8.0))
    elif arch == "gemma":  # a GeGLU in Llama's layer, head_dim past hidden / heads
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=96, attn_implementation="eager"))
    elif arch == "ministral3":  # YaRN past 64 positions (DeepSeek's mscales), queries scaled by position past 64
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7, "llama_4_scaling_beta": 0.1}
        model = transformers.Ministral3ForCausalLM(transformers.Ministral3Config(**common, head_dim=64, pad_token_id=0,
                                                                                 rope_parameters=rope))
    elif arch == "granitemoehybrid":  # Granite 4.0 micro: attention layers alone, its shared MLP, rotary
        model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
            **common, layer_types=["attention"] * common["num_hidden_layers"], num_local_experts=0,
            shared_intermediate_size=160, position_embedding_type="rope", embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=8.0))
    elif arch == "exaone4":  # OLMo 2's layer, q/k normalized per head; no window, as the 1.2B
        model = transformers.Exaone4ForCausalLM(transformers.Exaone4Config(
            **common, sliding_window=None, layer_types=["full_attention"] * common["num_hidden_layers"]))
    elif arch == "olmo3":  # three sliding layers to one global; YaRN past 64 positions on the global ones only
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **{**common, "num_hidden_layers": 4}, sliding_window=24,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    elif arch == "glm4":  # sandwich norms, q/k/v biases, half of each head rotated as interleaved pairs
        model = transformers.Glm4ForCausalLM(transformers.Glm4Config(**common, head_dim=64, pad_token_id=0,
                                                                     partial_rotary_factor=0.25))
    elif arch == "ernie4_5":  # Llama's layer rotating interleaved pairs; every matmul with a bias
        model = transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(**common, head_dim=64, use_bias=True))
    elif arch == "gemma2":  # local and global layers alternating, the window shorter than the prompts
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True}, head_dim=64, query_pre_attn_scalar=64, sliding_window=24,
            attn_logit_softcapping=0.5, final_logit_softcapping=3.0, attn_implementation="eager"))
    elif arch == "gemma3_text":  # five local layers to one global, each kind with its own rotary
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True, "num_hidden_layers": 6}, head_dim=64, query_pre_attn_scalar=64,
            sliding_window=24, rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            attn_implementation="eager"))
    elif arch == "mixtral":  # 4 experts, 2 per token
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None))
    elif arch == "phimoe":  # 4 experts, 2 a token by the sparse mixer, on LayerNorms; biases on attention, the head
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
            router_jitter_noise=0.05))
    elif arch == "qwen3_moe":  # 6 experts, 3 per token; the second layer dense
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=96, norm_topk_prob=True,
            mlp_only_layers=[1]))
    elif arch == "granitemoe":  # Granite's multipliers, 4 experts, 2 per token
        model = transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.125, logits_scaling=8.0))
    elif arch == "qwen2_moe":  # q/k/v biases, 6 experts, 3 per token, beside a shared one; the second layer dense
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=96,
            shared_expert_intermediate_size=160, mlp_only_layers=[1]))
    elif arch == "olmoe":  # 6 experts, 3 per token, their weights not renormalized
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False))
    elif arch == "seed_oss":  # q/k/v biases, and o's
        model = transformers.SeedOssForCausalLM(transformers.SeedOssConfig(
            **common, head_dim=64, attention_bias=True, attention_out_bias=True))
    elif arch == "glm4_moe":  # GLM-4.5: a dense first layer, then 6 experts (3 a token) chosen by sigmoid scores
        # plus a bias, scaled by 2.5, beside a shared one; q/k/v biases and norms, a quarter of each head rotated
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**{
            **common, "num_hidden_layers": 3, "head_dim": 64, "n_routed_experts": 6, "num_experts_per_tok": 3,
            "moe_intermediate_size": 96, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5, "use_qk_norm": True, "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            **fields}))
        with torch.no_grad():  # a bias for the choice that changes it (the sigmoids differ by about 0.05)
            for layer in model.model.layers[1:]:
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape) * 0.05)
    elif arch == "arcee":  # an ungated MLP: down(relu(up(x)) ** 2)
        model = transformers.ArceeForCausalLM(transformers.ArceeConfig(**common))
    elif arch == "gpt_oss":  # sliding and global layers in turn, sinks, YaRN past 64 positions; 4 experts, 2 per
        # token, their SwiGLU clamped where these small weights reach (gpt-oss's limit, 7, is past them)
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{
            **common, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 64,
            "sliding_window": 24, "swiglu_limit": 0.3, "rope_parameters": rope, "attn_implementation": "eager",
            **fields}))
    elif arch == "phi":  # Phi-2's parallel block on one LayerNorm, an ungated GELU, biases everywhere (the LM head's
        # too), 0.4 of each head rotated (32 of its 80 dims, as Phi-2's)
        # (its heads all keep their own K and V, its MLP 4 times the width: what llama.cpp's converter writes)
        model = transformers.PhiForCausalLM(transformers.PhiConfig(**_layer_norm_eps({
            **common, "hidden_size": 160, "num_key_value_heads": 2, "intermediate_size": 640}),
                                                                   rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}))
    elif arch == "stablelm":  # Llama's layer with LayerNorms, q/k/v biases, a quarter of each head rotated
        model = transformers.StableLmForCausalLM(transformers.StableLmConfig(**_layer_norm_eps(common),
                                                                             use_qkv_bias=True))
    elif arch == "starcoder2":  # LayerNorms, biases everywhere, an ungated GELU, a window shorter than the prompts
        model = transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
            **_layer_norm_eps(common, "norm_epsilon"), sliding_window=24))
    elif arch == "ernie4_5_moe":  # interleaved rotary pairs; a dense first layer, then 6 experts (3 a token) chosen
        # by softmax scores plus a bias (moved off 0 below, far enough to change the choice), beside a shared one
        model = transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=64, moe_num_experts=6, moe_k=3, moe_intermediate_size=96,
            moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2))
    elif arch == "apertus":  # q/k norm, an ungated xIELU MLP (its numbers moved off their start below); its llama3
        # rope scaling is the converter fixture's (llama.cpp writes it as rope_freqs, which this file writer does not)
        model = transformers.ApertusForCausalLM(transformers.ApertusConfig(
            **common, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 12_000_000.0}))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.act_fn.alpha_p.add_(torch.randn(1) * 0.3)
                layer.mlp.act_fn.alpha_n.add_(torch.randn(1) * 0.3)
    elif arch == "hunyuan_v1_dense":  # q and k normalized per head after the rotary; its rope a fixed NTK alpha
        model = transformers.HunYuanDenseV1ForCausalLM(transformers.HunYuanDenseV1Config(
            **common, head_dim=64, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                    "rope_theta": 10000.0}))
    elif arch == "nemotron":  # LayerNorms of (1 + w), an ungated MLP of relu squared, half of each head rotated
        model = transformers.NemotronForCausalLM(transformers.NemotronConfig(**_layer_norm_eps(common, "norm_eps"),
                                                                             head_dim=64))
    elif arch == "cohere":  # a parallel block on one LayerNorm without bias, interleaved rotary pairs, logits scaled
        model = transformers.CohereForCausalLM(transformers.CohereConfig(
            **_layer_norm_eps({**common, "tie_word_embeddings": True}), logit_scale=0.3, pad_token_id=0))
    elif arch == "cohere2":  # Command R's layer, three sliding layers to one global, which rotates nothing
        model = transformers.Cohere2ForCausalLM(transformers.Cohere2Config(
            **_layer_norm_eps({**common, "tie_word_embeddings": True, "num_hidden_layers": 4}), head_dim=64,
            sliding_window=24, logit_scale=0.3, pad_token_id=0))
    elif arch == "lfm2_moe":  # LFM2's layers; a dense first layer, then 6 experts (3 a token) chosen by sigmoid
        # scores plus a bias (moved off 0 below), renormalized, scaled by 1.5
        model = transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(**_layer_norm_eps({
            **common, "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"]}, "norm_eps"),
            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=96, num_dense_layers=1,
            routed_scaling_factor=1.5))
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "conv"):
                    layer.conv.in_proj.weight.mul_(6)
                if hasattr(layer.feed_forward, "expert_bias"):
                    layer.feed_forward.expert_bias.copy_(torch.randn(6) * 0.05)
    elif arch in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):  # latent attention (V2: the query projected
        # directly, YaRN past 64 positions with V2-Lite's mscales; V3 and GLM-4.7-Flash: the query through a rank);
        # a dense first layer, then 6 experts (3 a token) beside a shared one: V2's by softmax, not renormalized, the
        # others' by sigmoids plus a bias (moved off 0 below), renormalized and scaled
        latent = {"kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 48,
                  "n_routed_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 96,
                  "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 3}
        if arch == "deepseek_v2":
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
            model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{
                **common, **latent, "q_lora_rank": None, "rope_parameters": rope, **fields}))
        else:
            kind = {"deepseek_v3": "DeepseekV3", "glm4_moe_lite": "Glm4MoeLite"}[arch]
            model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**{
                **common, **latent, "q_lora_rank": 64, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
                **fields}))
            with torch.no_grad():
                for layer in model.model.layers[1:]:
                    bias = layer.mlp.gate.e_score_correction_bias
                    bias.copy_(torch.randn(bias.shape) * 0.05)
    elif arch == "lfm2":  # short convolutions around attending layers (q/k norm); its MLP's width derived
        model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**_layer_norm_eps({
            **common, "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"]}, "norm_eps"),
            block_auto_adjust_ff_dim=True, block_multiple_of=32, block_ffn_dim_multiplier=1.0))
        with torch.no_grad():  # convolutions that weigh in the output (at their init they barely move a greedy token)
            for layer in model.model.layers:
                if hasattr(layer, "conv"):
                    layer.conv.in_proj.weight.mul_(6)
    elif arch in ("gpt2", "gpt_bigcode"):  # learned positions, Conv1D matrices (GPT-2's) or one K/V head (BigCode's)
        kind = {"gpt2": "GPT2", "gpt_bigcode": "GPTBigCode"}[arch]
        model = getattr(transformers, f"{kind}LMHeadModel" if arch == "gpt2" else f"{kind}ForCausalLM")(
            getattr(transformers, f"{kind}Config")(**{
                "vocab_size": vocab, "n_embd": 128, "n_layer": TINY["layers"], "n_head": 2, "n_positions": 256,
                "n_inner": TINY["intermediate"], "bos_token_id": 1, "eos_token_id": 2, **fields}))
    elif arch == "gptj":  # a parallel block on one LayerNorm, the first 32 dims of each 64-wide head rotated in pairs
        model = transformers.GPTJForCausalLM(transformers.GPTJConfig(**{
            "vocab_size": vocab, "n_embd": 128, "n_layer": TINY["layers"], "n_head": 2, "n_positions": 256,
            "n_inner": TINY["intermediate"], "rotary_dim": 32, "bos_token_id": 1, "eos_token_id": 2, **fields}))
    elif arch == "olmo":  # OLMo 1: Llama's layer on LayerNorms without scale or bias
        model = transformers.OlmoForCausalLM(transformers.OlmoConfig(**{**common, **fields}))
    elif arch == "falcon":  # a parallel block on one LayerNorm, q/k/v fused (in K/V groups: new_decoder_architecture)
        model = transformers.FalconForCausalLM(transformers.FalconConfig(**{
            "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": TINY["layers"], "num_attention_heads": 4,
            "ffn_hidden_size": TINY["intermediate"], "max_position_embeddings": 256, "bias": True,
            "bos_token_id": 1, "eos_token_id": 2, **fields}))
    elif arch == "opt":  # learned positions from row 2, a ReLU MLP
        model = transformers.OPTForCausalLM(transformers.OPTConfig(**{
            "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": TINY["layers"], "num_attention_heads": 2,
            "ffn_dim": TINY["intermediate"], "max_position_embeddings": 256, "word_embed_proj_dim": 128,
            "pad_token_id": 0, **fields}))
    elif arch == "glm":  # gate and up fused, q/k/v biases, half of each head rotated as interleaved pairs
        model = transformers.GlmForCausalLM(transformers.GlmConfig(**common, attention_bias=True, head_dim=64,
                                                                   pad_token_id=0))
    elif arch == "helium":  # each head rotated as interleaved pairs
        model = transformers.HeliumForCausalLM(transformers.HeliumConfig(**common, head_dim=64))
    elif arch == "bloom":  # ALiBi, a LayerNorm of the embeddings, q/k/v fused head by head, biases everywhere
        model = transformers.BloomForCausalLM(transformers.BloomConfig(**{
            "vocab_size": vocab, "hidden_size": 128, "n_layer": TINY["layers"], "n_head": 4, "bos_token_id": 1,
            "eos_token_id": 2, **fields}))
    elif arch == "mpt":  # ALiBi, LayerNorms without biases and no bias anywhere, an exact-GELU MLP
        model = transformers.MptForCausalLM(transformers.MptConfig(**{
            "vocab_size": vocab, "d_model": 128, "n_layers": TINY["layers"], "n_heads": 4, "max_seq_len": 256,
            "expansion_ratio": 4, **fields}))
    elif arch == "gpt_neox":  # a parallel block on two LayerNorms, q/k/v fused head by head, a quarter rotated
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**{
            "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": TINY["layers"], "num_attention_heads": 2,
            "intermediate_size": TINY["intermediate"], "max_position_embeddings": 256, **fields}))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # norm scales, biases and sinks away from their initial 1 and 0, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "olmo2", "olmo3", "exaone4", "granite", "granitemoehybrid",
                                  "smollm3", "phi3",
                                  "ministral3", "gemma", "gemma2", "gemma3_text", "glm4", "ernie4_5", "mixtral",
                                  "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "gpt_oss", "seed_oss", "arcee",
                                  "glm4_moe", "phi", "stablelm", "starcoder2", "cohere", "cohere2", "nemotron",
                                  "ernie4_5_moe", "apertus", "hunyuan_v1_dense", "lfm2", "lfm2_moe"])
def test_architectures_from_hf_and_gguf_match_transformers(tmp_path, loaded, arch):
    """Qwen3 (q and k RMS-normalized per head before rotary, head_dim beyond hidden / heads), Qwen2 (q/k/v
    biases), OLMo 2 (attention's and the MLP's outputs normalized instead of their inputs, q and k
    over the whole projection), Granite (embedding, residual and attention multipliers, logits
    scaling), SmolLM3 (every fourth layer without rotary), Phi-3 (q, k, v and gate, up stored
    fused), Gemma (a GeGLU, scaled embeddings, (1 + w) norms; its config's legacy `hidden_act:
    "gelu"` meaning the tanh approximation, as transformers reads it), Gemma 2 (sandwich norms,
    GeGLU, soft-capping, local and global layers), Gemma 3 (q/k norm, the local layers' own rotary
    base), GLM-4 (sandwich norms around a SwiGLU, part of each head rotated as interleaved pairs:
    half where a config does not say, as transformers defaults it), ERNIE 4.5 (every head rotated as
    interleaved pairs, a bias on every matmul), OLMo 3 (three sliding layers to one global, YaRN on
    the global ones only, from AllenAI's one-rope config and a file without the local base), EXAONE
    4 (OLMo 2's layer, q/k normalized per head), Ministral 3 (YaRN with DeepSeek's mscales, queries
    scaled by position past the original context, and compiled within it as the same logits bit for
    bit), Mixtral, Qwen3-MoE, OLMoE and Granite MoE (routed experts; a dense layer among them;
    OLMoE's weights not renormalized; Granite MoE's stacked in the checkpoint, here gate and up in
    one GGUF tensor), Seed-OSS (q/k/v and o biases), Arcee (an ungated MLP of relu squared),
    gpt-oss (attention sinks, biases on attention and on its experts stacked `[experts, in, out]`
    with gate and up interleaved, a clamped SwiGLU, the softmax over the chosen experts, sliding
    layers in turn, YaRN untruncated), Phi-2 (attention and an ungated GELU MLP side by side on one
    LayerNorm, biases on every matmul and the LM head, 0.4 of each head rotated), StableLM
    (LayerNorms, q/k/v biases, a quarter of each head rotated), StarCoder2 (LayerNorms, biases, an
    ungated GELU, a window), Command R (a parallel block on a LayerNorm without bias, interleaved
    rotary pairs, the logits scaled), Command R7B (Cohere2: three sliding layers to one global
    that rotates nothing), Nemotron (LayerNorms of (1 + w), relu squared, half of each head
    rotated), ERNIE 4.5's MoE (experts chosen by softmax scores plus a bias, beside a shared one) and
    Apertus (an ungated MLP of xIELU, each layer's numbers its own) and Hunyuan (q/k norm after the
    rotary, a fixed NTK alpha), each from a Hugging Face directory
    (fp32, and bf16 or fp16) and from a GGUF file in llama.cpp's layout, against transformers:
    reading the same GGUF where it can (Qwen, Phi-3), else the model the file was written from
    (for gpt-oss with YaRN's ramp truncated and the SwiGLU clamped at 7, as llama.cpp computes
    every file)."""
    from transformers import AutoModelForCausalLM

    model = tiny_hf_model(arch)
    model.eval().save_pretrained(tmp_path / "hf", safe_serialization=True)
    if arch == "gemma":  # as Google's configs say it (transformers saves the name it reads it as)
        config_json = tmp_path / "hf" / "config.json"
        config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "hidden_act": "gelu"}))
    if arch == "olmo3":  # as AllenAI's configs say it: one rope_scaling and rope_theta, the local layers' left implied
        config_json = tmp_path / "hf" / "config.json"
        raw = json.loads(config_json.read_text())
        rope = raw.pop("rope_parameters")
        config_json.write_text(json.dumps({**raw, "rope_theta": rope["full_attention"]["rope_theta"], "rope_scaling": {
            k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}}))
    if arch == "glm4_moe":  # GLM-4.5's checkpoints hold an MTP layer after the others, which is not run
        from safetensors.torch import load_file, save_file

        [file] = (tmp_path / "hf").glob("*.safetensors")
        tensors = load_file(file)
        last = f"model.layers.{model.config.num_hidden_layers - 1}."
        extra = f"model.layers.{model.config.num_hidden_layers}."
        tensors.update({extra + n.removeprefix(last): t.clone() for n, t in tensors.items() if n.startswith(last)})
        tensors[extra + "eh_proj.weight"] = torch.randn(128, 256)
        save_file(tensors, str(file), metadata={"format": "pt"})
        assert model.config.num_nextn_predict_layers == 1
    if arch == "ernie4_5_moe":  # ERNIE 4.5's checkpoints hold an MTP block of their own names, which is not run
        from safetensors.torch import load_file, save_file

        [file] = (tmp_path / "hf").glob("*.safetensors")
        tensors = load_file(file)
        tensors.update({"model.mtp_block.0.input_layernorm.weight": torch.randn(128),
                        "model.mtp_emb_norm.0.weight": torch.randn(128),
                        "model.mtp_linear_proj.0.weight": torch.randn(128, 256)})
        save_file(tensors, str(file), metadata={"format": "pt"})
        config_json = tmp_path / "hf" / "config.json"
        config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "num_nextn_predict_layers": 1}))
    if arch == "glm4":  # a quarter of each head rotated (transformers keeps it in rope_parameters), else half
        raw = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert raw["rope_parameters"]["partial_rotary_factor"] == 0.25
        from inflight.model.hf_config import parse_hf_config

        assert parse_hf_config({**raw, "rope_parameters": {"rope_theta": 10_000.0}}).rotary_dim == 32
    write_gguf_from_hf(tmp_path / "tiny.gguf", arch, model)
    ids = list(range(5, 5 + 90))
    transformers_reads_gguf = arch in ("qwen2", "qwen3", "phi3")
    from_gguf = model if not transformers_reads_gguf else AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    if arch == "gpt_oss":  # the same weights as llama.cpp computes every file: YaRN's ramp truncated, limit 7
        from_gguf = tiny_hf_model(arch, rope_parameters={**model.config.rope_parameters, "truncate": True},
                                  swiglu_limit=7.0)
    # As checkpoints are published: 16-bit, widened to fp32 at load (transformers' reading alike).
    half = torch.float16 if arch in ("qwen3", "olmo2", "phi3", "gemma2", "mixtral") else torch.bfloat16
    copy.deepcopy(model).to(half).save_pretrained(tmp_path / "half", safe_serialization=True)
    rounded = AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32).eval()
    for source, reference in [(tmp_path / "hf", model), (tmp_path / "tiny.gguf", from_gguf),
                              (tmp_path / "half", rounded)]:
        config, weights = load_checkpoint(resolve_model(str(source)), torch.float32)
        # llama.cpp's names for OLMo 3 and Granite 4.0's attention-only models
        named = {"olmo3": "olmo2", "granitemoehybrid": "granite"}.get(arch, arch) if source.suffix == ".gguf" else arch
        assert (config.architecture, config.head_dim) == (named, {"qwen3": 128, "gemma": 96, "phi": 80}.get(arch, 64))
        assert config.rotary_dim == {"glm4": 16, "glm4_moe": 16, "phi": 32, "stablelm": 16, "nemotron": 32}.get(arch)
        if arch == "ministral3":  # YaRN stretches 64 positions to 256; the queries' scaling starts at 64
            assert (config.max_position_embeddings, config.query_scaling) == (256, (pytest.approx(0.1), 64))
        if arch in ("gemma2", "gemma3_text", "olmo3"):  # the windows and rotary bases as transformers has them
            assert config.sliding_window_layers == tuple(t == "sliding_attention" for t in model.config.layer_types)
            local = None if arch == "gemma2" else model.config.rope_parameters["sliding_attention"]["rope_theta"]
            assert config.local_rope_theta == local
        ours = LlamaModel(config, weights, torch.device("cpu"))
        torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)
        if arch == "ministral3":  # served within its original context: compiled, the scaling left out (it is 1)
            within = inflight_logits(ours, ids[:64])
            ours.use_context(64)
            assert torch.equal(inflight_logits(ours, ids[:64]), within)


@pytest.mark.parametrize("matrices", ["F32", "Q8_0"])
def test_a_gguf_file_with_q_k_and_v_in_one_tensor_loads_as_the_file_with_them_apart(tmp_path, matrices):
    """Older conversions of Phi-2 hold q, k and v (weights and biases) in one `attn_qkv` tensor,
    which llama.cpp reads for every architecture: such a file gives the logits of the same model's
    file with them apart, bit for bit, its matrices widened to fp32 or Q8_0 blocks packed as they
    lie (the fused rows split into the three matmuls the model fuses again)."""
    import gguf

    from inflight.model.linear import blocks_usable
    from inflight.model.loader import load_blocks, load_embedding

    if matrices != "F32" and not blocks_usable():
        pytest.skip("these kernels read no stored blocks (built without AVX2)")
    model = tiny_hf_model("phi")
    logits = {}
    for fused in (False, True):
        path = tmp_path / f"{fused}.gguf"
        write_gguf_from_hf(path, "phi", model, fused_qkv=fused, matrices=matrices)
        names = {t.name for t in gguf.GGUFReader(path).tensors}
        assert ("blk.0.attn_qkv.weight" in names, "blk.0.attn_q.bias" in names) == (fused, not fused)
        source = resolve_model(str(path))
        config, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
        ours = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=load_blocks(source, config),
                          embedding=load_embedding(source, config))
        assert (ours.layers[0].qkv.blocks is not None) == (matrices == "Q8_0")  # packed from the file's blocks
        logits[fused] = inflight_logits(ours, list(range(5, 45)))
    assert torch.equal(logits[True], logits[False])
    if matrices == "F32":
        torch.testing.assert_close(logits[True], hf_logits(model, list(range(5, 45))), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_a_multimodal_checkpoint_serves_its_text_model_as_transformers_computes(tmp_path, layout):
    """Gemma 3's 4B and larger are published as vision-language checkpoints: the decoder's tensors
    under `language_model.model.` (or `model.language_model.`, as newer transformers save them)
    beside a vision tower and a projector, and a config.json whose `text_config` gives a few keys
    over its class's defaults (Google's name five). The text model's logits are transformers' on
    the same directory (the rotary bases and norm eps the class defaults to among them); the
    vision weights are not read."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    sparse = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32,
              "vocab_size": 300, "sliding_window": 16, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**sparse), vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
                                       eoi_token_index=298)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norm scales away from their initial 0 (Gemma's 1 + w), so a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "text_config": sparse}))
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in tensors)
    if layout == "model.language_model.":
        tensors = {name.replace("language_model.model.", layout): t for name, t in tensors.items()}
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reference.config.text_config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    config, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    assert (config.architecture, config.rope_theta, config.local_rope_theta) == ("gemma3_text", 1e6, 10_000.0)
    assert not any("vision" in name or "projector" in name for name in weights)
    ours = LlamaModel(config, weights, torch.device("cpu"))
    ids = list(range(5, 5 + 60))
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)


def test_ministral_alternates_global_and_sliding_layers_as_transformers_computes(tmp_path):
    """Ministral 8B's layers: one global to three sliding-window ones, as its `layer_types` say
    (its config class has no default pattern): the logits are transformers' over a prompt past the
    window, from the checkpoint and a 16-bit copy."""
    import transformers

    torch.manual_seed(0)
    types = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    model = transformers.MinistralForCausalLM(transformers.MinistralConfig(
        vocab_size=TINY["vocab"], hidden_size=128, intermediate_size=TINY["intermediate"], num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256, sliding_window=24,
        layer_types=types, pad_token_id=0)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "half", safe_serialization=True)
    rounded = transformers.MinistralForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32).eval()
    ids = list(range(5, 5 + 90))
    for source, reference in [(tmp_path / "hf", model), (tmp_path / "half", rounded)]:
        config, weights = load_checkpoint(resolve_model(str(source)), torch.float32)
        assert (config.architecture, config.sliding_window) == ("ministral", 24)
        assert config.sliding_window_layers == (False, True, True, True)
        ours = LlamaModel(config, weights, torch.device("cpu"))
        torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)


def test_granite_4_without_rope_rotates_nothing_and_its_mamba_layers_or_experts_are_refused(tmp_path):
    """Granite 4.0's attention-only models rotate only where `position_embedding_type` says "rope"
    (transformers' default is none): without it every layer is NoPE, and the logits are still
    transformers'. Its hybrid models' Mamba layers, and routed experts beside the shared MLP, are
    refused by name."""
    import transformers

    torch.manual_seed(0)
    settings = dict(vocab_size=TINY["vocab"], hidden_size=128, intermediate_size=TINY["intermediate"],
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                    shared_intermediate_size=160, num_local_experts=0, layer_types=["attention"] * 2,
                    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125,
                    logits_scaling=8.0)
    model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**settings)).eval()
    model.save_pretrained(tmp_path / "nope", safe_serialization=True)
    config, weights = load_checkpoint(resolve_model(str(tmp_path / "nope")), torch.float32)
    assert config.rope_layers == (False, False) and config.intermediate_size == 160
    ours = LlamaModel(config, weights, torch.device("cpu"))
    ids = list(range(5, 5 + 60))
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    raw = json.loads((tmp_path / "nope" / "config.json").read_text())
    for key, value, refused in [("layer_types", ["mamba", "attention"], "layer_types \\['attention', 'mamba'\\]"),
                                ("num_local_experts", 4, "num_local_experts = 4: inflight runs no routed experts")]:
        (tmp_path / "nope" / "config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ModelLoadError, match=refused):
            load_checkpoint(resolve_model(str(tmp_path / "nope")), torch.float32)


def test_exaone4_slides_three_layers_of_four_and_its_global_ones_rotate_nothing(tmp_path):
    """EXAONE 4's 32B shape: three sliding-window layers to one global, the global ones without
    rotary (transformers rotates a layer only where the model has no window or the layer slides):
    the logits are transformers' over a prompt past the window. llama.cpp slides only such files
    of 64 layers, whatever a file says: a 4-layer file with a window is read without one."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Exaone4ForCausalLM(transformers.Exaone4Config(
        vocab_size=TINY["vocab"], hidden_size=128, intermediate_size=TINY["intermediate"], num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, sliding_window=24)).eval()
    assert model.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config, weights = load_checkpoint(resolve_model(str(tmp_path / "hf")), torch.float32)
    assert config.rope_layers == (True, True, True, False) and config.sliding_window == 24
    ours = LlamaModel(config, weights, torch.device("cpu"))
    ids = list(range(5, 5 + 90))
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    write_gguf_from_hf(tmp_path / "tiny.gguf", "exaone4", model)
    config, _ = load_checkpoint(resolve_model(str(tmp_path / "tiny.gguf")), torch.float32)
    assert (config.sliding_window, config.rope_layers) == (None, None)


@pytest.mark.parametrize("kind", ["smolvlm", "ministral3"])
def test_other_vision_language_checkpoints_serve_their_language_model(tmp_path, kind):
    """SmolVLM's checkpoints (Idefics3: a Llama under `model.text_model.`, a vision model and a
    connector beside it) and Ministral 3's (Mistral3ForConditionalGeneration: its decoder under
    `language_model.model.`, a Pixtral vision tower and a projector beside it) serve text: the
    logits are transformers' for text ids (Ministral 3's past its original 64 positions too)."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if kind == "smolvlm":
        model = transformers.Idefics3ForConditionalGeneration(transformers.Idefics3Config(
            text_config={**text, "model_type": "llama", "rope_theta": 1e5, "pad_token_id": 0}, vision_config=vision,
            image_token_id=299, scale_factor=1))
    else:
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
        model = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
            text_config={**text, "model_type": "ministral3", "head_dim": 32, "rope_parameters": rope},
            vision_config={**vision, "head_dim": 16}, image_token_index=299, spatial_merge_size=1))
    model.eval()
    with torch.no_grad():  # norm scales away from their initial 1, so a dropped one shows
        for name, p in model.named_parameters():
            if ("text_model" in name or "language_model" in name) and "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    assert config.architecture == {"smolvlm": "llama"}.get(kind, kind)
    assert config.rope_theta == (1e5 if kind == "smolvlm" else 1e6)
    ours = LlamaModel(config, weights, torch.device("cpu"))
    ids = list(range(5, 5 + 90))
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen2_5_vl", "qwen2_5_vl flat"])
def test_a_vl_models_language_model_serves_text_as_transformers_computes(tmp_path, kind):
    """Qwen3-VL's and Qwen2.5-VL's checkpoints (the language model under `model.language_model.`,
    or Qwen2.5-VL's own `model.` beside `visual.`, a vision tower beside it) serve text: Qwen3's
    and Qwen2's layers whose rotary in sections for an image's grid (`mrope_section`, interleaved
    in Qwen3-VL) is, with every section at the token's position, the plain rotary; the logits are
    transformers' for text ids, also from Qwen2.5-VL's first config.json (the decoder's keys beside
    `vision_config`, its rope type "mrope"). And llama.cpp's qwen3vl and qwen2vl files of the same
    language model (the sections in their metadata) give the same logits as the checkpoint."""
    import gguf
    import transformers

    torch.manual_seed(0)
    kind, _, flat = kind.partition(" ")
    qwen3 = kind == "qwen3_vl"
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5],
                                 **({"mrope_interleaved": True} if qwen3 else {})})
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    ids = {"image_token_id": 299, "video_token_id": 298, "vision_start_token_id": 297}
    if qwen3:
        config = transformers.Qwen3VLConfig(text_config={**text, "head_dim": 32}, vision_config={
            **vision, "deepstack_visual_indexes": [0], "num_position_embeddings": 16}, **ids)
        model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    else:
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "fullatt_block_indexes": [0]},
                                               **ids)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # norm scales and biases away from their initial 1 and 0, so a dropped one shows
        for name, p in model.named_parameters():
            if "language_model" in name and (name.endswith("bias") or "norm" in name):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    if flat:  # as Qwen2.5-VL's were published
        raw = json.loads((tmp_path / "hf" / "config.json").read_text())
        decoder = raw.pop("text_config")
        rope = decoder.pop("rope_parameters")
        decoder.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": "mrope", **rope})
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, **decoder, "model_type": "qwen2_5_vl"}))
        assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").text_config.rms_norm_eps == 1e-5
    config_ours, weights = load_checkpoint(resolve_model(str(tmp_path / "hf")), torch.float32)
    assert config_ours.architecture == f"{kind}_text" and config_ours.attention_bias == (not qwen3)
    ours = LlamaModel(config_ours, weights, torch.device("cpu"))
    prompt = list(range(5, 5 + 60))
    expected = hf_logits(model, prompt)
    torch.testing.assert_close(inflight_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)

    # llama.cpp's file of the language model: Qwen's tensor names under qwen3vl / qwen2vl
    path = tmp_path / "text.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3vl" if qwen3 else "qwen2vl")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_rope_freq_base(5e6)
    w.add_rope_dimension_sections([6, 5, 5, 0])
    w.add_layer_norm_rms_eps(config_ours.rms_norm_eps)
    w.add_vocab_size(300)
    names = {hf: g for g, hf in GGUF_LAYER_NAMES.items()} | {"post_attention_layernorm.weight": "ffn_norm.weight"}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            name = f"blk.{index}.{names[rest]}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        w.add_tensor(name, tensor.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config_gguf, weights_gguf = load_checkpoint(resolve_model(str(path)), torch.float32)
    assert config_gguf.architecture == f"{kind}_text"
    from_file = LlamaModel(config_gguf, weights_gguf, torch.device("cpu"))
    torch.testing.assert_close(inflight_logits(from_file, prompt), expected, atol=1e-4, rtol=1e-4)


def test_phi_longrope_and_partial_rotary_match_transformers(tmp_path, loaded):
    """Phi-4-mini's shape of Phi-3: a rotary over the first 3/4 of each head only, and longrope
    (short factors within the original 32 positions, long ones past it, cos and sin scaled). An
    engine serving up to the original context rotates with the short factors, as transformers
    does for sequences within it; one serving longer contexts with the long ones, as
    transformers does for a sequence past it (llama.cpp picks them by its context size too)."""
    import transformers

    from inflight import LLM

    torch.manual_seed(0)
    rot = 48
    factors = {"short_factor": [1.0 + 0.1 * i for i in range(rot // 2)],
               "long_factor": [2.0 + 0.5 * i for i in range(rot // 2)]}
    config = transformers.Phi3Config(
        vocab_size=TINY["vocab"], hidden_size=128, intermediate_size=TINY["intermediate"], num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        original_max_position_embeddings=32, sliding_window=None, pad_token_id=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, **factors})
    model = transformers.Phi3ForCausalLM(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded.tokenizer.hf.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    cfg, weights = load_checkpoint(source, torch.float32)
    assert cfg.rotary_dim == rot and cfg.rope_scaling["rope_type"] == "longrope"
    ours = LlamaModel(cfg, weights, torch.device("cpu"))
    for served, ids in [(32, list(range(5, 5 + 30))), (256, list(range(5, 5 + 90)))]:
        ours.use_context(served)
        torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    llm = LLM(model=str(tmp_path), num_kv_blocks=32, max_model_len=256)  # the engine sets the factors
    prompt = list(range(5, 5 + 60))
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    assert out.token_ids == expected.tolist()


@pytest.mark.parametrize(("arch", "yarn"), [
    ("qwen3", {"factor": 4.0}),  # Qwen3's own setting for 128k contexts, shrunk
    ("smollm3", {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2}),
    ("qwen2", {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False})])
def test_yarn_matches_transformers(tmp_path, loaded, arch, yarn):
    """YaRN (Qwen2.5 and Qwen3 past 32k, SmolLM3 past 64k): frequencies interpolated by the
    factor where their wavelengths are long against the original context of 32 positions, kept
    where short, blended between, and cos and sin scaled; over 90 positions, from a Hugging Face
    directory and from the GGUF file llama.cpp's converter would write (which cannot say
    `truncate` or DeepSeek's `mscale`s, so those settings are checked from the directory only)."""
    rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "original_max_position_embeddings": 32, **yarn}
    model = tiny_hf_model(arch, rope_parameters=rope)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    sources = [tmp_path / "hf"]
    if not {"truncate", "mscale"} & set(yarn):
        write_gguf_from_hf(tmp_path / "tiny.gguf", arch, model)
        sources.append(tmp_path / "tiny.gguf")
    ids = list(range(5, 5 + 90))
    expected = hf_logits(model, ids)
    for source in sources:
        config, weights = load_checkpoint(resolve_model(str(source)), torch.float32)
        assert config.rope_scaling["rope_type"] == "yarn"
        ours = LlamaModel(config, weights, torch.device("cpu"))
        torch.testing.assert_close(inflight_logits(ours, ids), expected, atol=1e-4, rtol=1e-4)
    # the settings matter: the same weights without YaRN compute other logits
    plain = dataclasses.replace(config, rope_scaling=None)
    assert not torch.allclose(inflight_logits(LlamaModel(plain, weights, torch.device("cpu")), ids), expected,
                              atol=1e-2)


def test_yarn_stretches_the_context_a_model_serves():
    """Qwen3's config.json keeps max_position_embeddings 40960 when its card's YaRN settings are
    added (a factor of 4 over 32768): the model serves 131072 positions, as vLLM derives."""
    from inflight.model.hf_config import parse_hf_config

    raw = json.loads(json.dumps(tiny_hf_model("qwen3").config.to_dict()))
    raw["max_position_embeddings"] = 40960
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    raw.pop("rope_parameters")
    config = parse_hf_config(raw)
    assert config.max_position_embeddings == 131072 and config.rope_scaling["factor"] == 4.0
    raw["rope_scaling"] = {"type": "yarn", "factor": 2.0}  # the older key; the original context from the config
    config = parse_hf_config(raw)
    assert config.max_position_embeddings == 81920
    assert config.rope_scaling == {"rope_type": "yarn", "type": "yarn", "factor": 2.0,
                                   "original_max_position_embeddings": 40960}


def test_hf_overrides_switch_yarn_on_as_a_config_json_edit_would(tmp_path, loaded):
    """vLLM's --hf-overrides, as Qwen3's card asks for contexts past 32k: the same YaRN from a
    checkpoint whose config.json lacks it and from a GGUF file whose metadata lacks it (its
    rotary settings are all a GGUF file's that can be overridden), computed as transformers
    computes the model whose config has it; an engine reloads for other overrides."""
    from inflight import LLM
    from inflight.engine.engine import LLMEngine

    rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    model = tiny_hf_model("qwen3", rope_parameters=rope)
    plain = tiny_hf_model("qwen3")  # the same weights (the rotary has none), no YaRN
    plain.save_pretrained(tmp_path / "hf", safe_serialization=True)
    loaded.tokenizer.hf.save_pretrained(tmp_path / "hf")
    write_gguf_from_hf(tmp_path / "tiny.gguf", "qwen3", plain)
    overrides = json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32}})
    ids = list(range(5, 5 + 90))
    expected = hf_logits(model, ids)
    for path in (tmp_path / "hf", tmp_path / "tiny.gguf"):
        config, weights = load_checkpoint(resolve_model(str(path)), torch.float32)
        assert config.rope_scaling is None
        config, weights = load_checkpoint(resolve_model(str(path), overrides), torch.float32)
        assert config.rope_scaling["rope_type"] == "yarn"
        torch.testing.assert_close(inflight_logits(LlamaModel(config, weights, torch.device("cpu")), ids), expected,
                                   atol=1e-4, rtol=1e-4)
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic'"):
        load_checkpoint(resolve_model(str(tmp_path / "tiny.gguf"), '{"rope_scaling": {"rope_type": "dynamic"}}'),
                        torch.float32)
    with pytest.raises(ModelLoadError, match="hf_overrides: num_hidden_layers: a GGUF file's settings"):
        load_checkpoint(resolve_model(str(tmp_path / "tiny.gguf"), '{"num_hidden_layers": 1}'), torch.float32)

    llm = LLM(model=str(tmp_path / "hf"), hf_overrides=json.loads(overrides), num_kv_blocks=16,
              max_model_len=128)
    out = llm.generate([ids[:60]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids[:60]]), max_new_tokens=8, do_sample=False)[0, 60:]
    assert out.token_ids == greedy.tolist()
    config = dataclasses.replace(llm.engine.config, hf_overrides=None)
    assert not llm.engine.parts.loaded.serves(config)
    assert LLMEngine(config, llm.engine.parts.loaded).model_config.rope_scaling is None


@pytest.mark.parametrize(("key", "value"), [("yarn_ext_factor", 0.5), ("attn_factor", 2.5)])
def test_yarn_settings_llama_cpp_writes_in_other_conventions_are_refused_by_name(tmp_path, key, value):
    import gguf

    def yarn(w: Any, extra: bool = True) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(128)
        if extra:
            w.add_float32(f"llama.rope.scaling.{key}", value)

    write_tiny_gguf(tmp_path / "plain.gguf", {}, metadata=lambda w: yarn(w, extra=False))
    config, _ = load_checkpoint(resolve_model(str(tmp_path / "plain.gguf")), torch.float32)
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    assert config.max_position_embeddings == 512  # what YaRN stretches 128 to, past the file's 256
    write_tiny_gguf(tmp_path / "other.gguf", {}, metadata=yarn)
    with pytest.raises(ModelLoadError, match=f"llama.rope.scaling.{key} = {value} beside YaRN"):
        load_checkpoint(resolve_model(str(tmp_path / "other.gguf")), torch.float32)


@pytest.mark.parametrize("normalize", [True, False])
def test_routed_experts_run_each_chosen_expert_once_over_its_tokens(normalize):
    """The step's tokens grouped by expert: each expert that any token chose runs one matmul
    over all of its tokens (never one per token), and the result is the per-token definition:
    the softmax over the router's scores, the top k kept (renormalized or not), each chosen
    expert's SwiGLU MLP weighted by its score."""
    from inflight.model.experts import RoutedExperts
    from inflight.model.linear import Linear

    torch.manual_seed(0)
    hidden, width, num_experts, top_k, tokens = 32, 48, 6, 2, 40
    calls: list[int] = []

    class Counted(Linear):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return super().__call__(x)

    router = torch.randn(num_experts, hidden)
    gate_up = [torch.randn(2 * width, hidden) * 0.2 for _ in range(num_experts)]
    down = [torch.randn(hidden, width) * 0.2 for _ in range(num_experts)]
    experts = RoutedExperts(Linear(router, None, "torch"), [Counted(w, None, "torch") for w in gate_up],
                            [Linear(w, None, "torch") for w in down], top_k, normalize)
    x = torch.randn(tokens, hidden)

    def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    got = experts(x, silu_and_mul)
    probs = torch.softmax(x @ router.T, dim=-1)
    expected = torch.zeros_like(x)
    for t in range(tokens):
        weights, chosen = probs[t].topk(top_k)
        if normalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights.tolist(), chosen.tolist(), strict=True):
            expected[t] += weight * (silu_and_mul(x[t] @ gate_up[e].T) @ down[e].T)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    chosen_experts = probs.topk(top_k, dim=-1).indices.unique()
    assert len(calls) == len(chosen_experts) and sum(calls) == tokens * top_k


def test_phimoes_sparse_mixer_chooses_and_weighs_as_transformers(tmp_path):
    """Phi-3.5-MoE's router: inflight's `sparsemixer` gives transformers' experts and weights
    exactly, on logits of every sign and spread (narrow: several experts within the eps of the
    best, their softmax shared; wide: the best alone, weight 1), for the eps of the published
    model and a wider one; a config asking for other than 2 experts a token is refused."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as reference

    from inflight.model.experts import sparsemixer

    generator = torch.Generator().manual_seed(0)
    for spread in (0.01, 0.3, 3.0):
        logits = torch.randn(64, 16, generator=generator) * spread + torch.randn(64, 1, generator=generator)
        for eps in (0.01, 0.2):
            weights, chosen = sparsemixer(logits, 2, eps)
            expected_weights, expected_chosen = reference(logits, jitter_eps=eps, training=False)
            assert torch.equal(chosen, expected_chosen) and torch.equal(weights, expected_weights)
            assert (weights < 1).any() and (chosen[:, 0] != chosen[:, 1]).all()
    assert_setting_refused(tmp_path, "phimoe", "num_experts_per_tok", 3, "num_experts_per_tok")


def test_a_token_alone_through_routed_experts_is_its_row_of_a_batch():
    """One token takes a path of its own (its experts in id order, no grouping) in both
    interpreters; its output is bit for bit its row of a batch through the grouped path, a shared
    expert beside the routed ones included: a request's tokens do not depend on who shares its
    step."""
    from inflight.model.experts import RoutedExperts
    from inflight.model.kernels import cpu_kernels
    from inflight.model.linear import Linear
    from inflight.model.token_ops import CpuKernelTokenOps

    if cpu_kernels() is None:
        pytest.skip("no compiled CPU kernels here")
    torch.manual_seed(0)
    hidden, width, num_experts, top_k = 64, 48, 6, 3
    ops = CpuKernelTokenOps(2, 1, 32, 1e-6, cpu_kernels())

    def linear(rows: int, cols: int) -> Linear:
        return Linear(torch.randn(rows, cols) * 0.2, None, "inflight")

    for shared in (None, (linear(2 * width, hidden), linear(hidden, width), linear(1, hidden))):
        experts = RoutedExperts(linear(num_experts, hidden), [linear(2 * width, hidden) for _ in range(num_experts)],
                                [linear(hidden, width) for _ in range(num_experts)], top_k, False, shared)
        x = torch.randn(24, hidden)
        batch = experts(x, ops.silu_and_mul)
        for t in range(len(x)):
            assert torch.equal(experts(x[t:t + 1], ops.silu_and_mul), batch[t:t + 1]), t


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "smollm3", "phi3",
                                  "phi3_longrope", "qwen3_yarn", "gemma", "gemma2", "gemma3_text", "glm4",
                                  "ernie4_5", "olmo3", "exaone4", "ministral3", "mixtral", "qwen3_moe", "qwen2_moe",
                                  "olmoe", "granitemoe", "gpt_oss", "seed_oss", "arcee", "glm4_moe", "phi", "stablelm",
                                  "starcoder2", "cohere", "cohere2", "nemotron", "ernie4_5_moe", "apertus",
                                  "hunyuan_v1_dense", "lfm2", "lfm2_moe", "deepseek_v2", "deepseek_v3",
                                  "deepseek_v3_grouped", "glm4_moe_lite", "gpt2", "gpt_bigcode", "gpt_neox",
                                  "falcon", "falcon_ln2", "olmo", "bloom", "mpt", "glm", "phimoe"])
def test_files_of_llama_cpps_own_converter_load_as_transformers_computes(tmp_path, monkeypatch, arch):
    """The GGUF file llama.cpp's `convert_hf_to_gguf.py` made of a tiny checkpoint of each
    architecture (tests/converter_fixtures.py; its names, row orders, norm offsets, stacked
    experts, longrope factor tensors, YaRN settings and metadata, not the suite's imitation of
    them) gives transformers' logits on that checkpoint, over a prompt past the Gemma models'
    8-token windows and longrope's and YaRN's 16 original positions, and its config again when read from
    the saved index; its SentencePiece vocabulary makes a tokenizer that gives text back as it was."""
    from converter_fixtures import FIXTURES, tiny_model

    from inflight.model.loader import ModelSource
    from inflight.model.tokenizer import Tokenizer

    monkeypatch.setattr("inflight.model.tokenizer.tokenizer_cache_dir", lambda: tmp_path)  # not the user's cache
    tokenizer = Tokenizer.load(ModelSource(FIXTURES / f"{arch}.gguf", "gguf"))
    text = "It is a truth universally acknowledged, that a single man"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text

    from inflight.model import loader

    model = tiny_model(arch)
    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path / "cache"))
    loader._read_gguf.cache_clear()
    config, weights = load_checkpoint(resolve_model(str(FIXTURES / f"{arch}.gguf")), torch.float32)
    loader._read_gguf.cache_clear()  # a second load reads the config from the saved index: the same
    assert load_checkpoint(resolve_model(str(FIXTURES / f"{arch}.gguf")), torch.float32)[0] == config
    # llama.cpp's converter calls Mistral llama
    # (and reads GLM-4.7-Flash's files as DeepSeek V3's)
    assert config.architecture == {"mistral": "llama", "phi3_longrope": "phi3", "qwen3_yarn": "qwen3",
                                   "olmo3": "olmo2", "glm4_moe_lite": "deepseek_v3",
                                   "deepseek_v3_grouped": "deepseek_v3"}.get(arch, arch)
    # The fixture holds this very checkpoint (else it was made from another initialization).
    assert torch.equal(weights["model.embed_tokens.weight"], model.get_input_embeddings().weight.detach())
    ids = list(range(3, 3 + 40))
    ours = LlamaModel(config, weights, torch.device("cpu"))
    if arch == "phi3_longrope":  # short factors serving the original 16 positions, long ones past them
        assert config.rope_scaling["rope_type"] == "longrope" and config.rotary_dim == 8
        ours.use_context(16)
        torch.testing.assert_close(inflight_logits(ours, ids[:14]), hf_logits(model, ids[:14]), atol=1e-4, rtol=1e-4)
        ours.use_context(config.max_position_embeddings)
    if arch == "qwen3_yarn":
        assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    if arch == "ministral3":  # queries scaled by position past the original 16
        assert config.query_scaling == (pytest.approx(0.1), 16)
    if arch == "deepseek_v3_grouped":
        assert config.expert_groups == (4, 2)
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` ids (words w0, w1, ..., the chat roles and ChatML's
    markers) with a ChatML chat template, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|im_start|>", "<|im_end|>"]
    words = ["system", "user", "assistant", *special]
    vocab = {f"w{i}": i for i in range(vocab_size - len(words))}
    vocab.update({w: vocab_size - len(words) + i for i, w in enumerate(words)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", unk_token="w0",
                                 additional_special_tokens=special[:1])
    hf.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    hf.save_pretrained(path)


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "olmo3", "smollm3", "gemma", "gemma2", "gemma3_text", "glm4",
                                  "ernie4_5", "ministral3", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe",
                                  "gpt_oss", "seed_oss", "arcee", "glm4_moe", "phi", "stablelm", "cohere2",
                                  "ernie4_5_moe", "apertus", "hunyuan_v1_dense", "lfm2", "lfm2_moe", "deepseek_v2",
                                  "deepseek_v3", "glm4_moe_lite", "gpt2", "gpt_bigcode", "opt", "gpt_neox", "gptj",
                                  "falcon", "olmo", "bloom", "mpt", "glm", "helium", "phimoe"])
def test_a_new_architecture_serves_chats_as_transformers_generates(tmp_path, arch):
    """Through the engine as a user runs it: the directory's own tokenizer and chat template, a
    batch of chats (longer than Gemma's 24-token window) in small prefill chunks, the prefix cache
    shared by their system prompt, then decodes; and again in a pool too small for all three, so
    that requests are preempted and recomputed, with prompt logprobs: each greedy output is
    transformers' `generate` on the same ids, each prompt logprob its log_softmax within 1e-4."""
    from inflight import LLM

    model = tiny_hf_model(arch)
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path, TINY["vocab"])
    system = {"role": "system", "content": " ".join(f"w{i}" for i in range(40, 72))}
    chats = [[system, {"role": "user", "content": f"w{3 * i + 5} w{i + 100} w{7 * i + 11}"}] for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(model=str(tmp_path), num_kv_blocks=64, block_size=16, max_num_tokens=24, enable_prefix_caching=True)
    outs = llm.generate(chats, params)
    assert max(r.num_prefill_tokens for r in llm.engine.step_records) <= 24  # chunked
    assert sum(o.num_cached_tokens for o in outs) > 0  # the system prompt's full blocks reused
    small = LLM(model=str(tmp_path), num_kv_blocks=9, block_size=16, enable_prefix_caching=False)
    preempted = small.generate(chats, dataclasses.replace(params, prompt_logprobs=0))  # lm-eval's loglikelihood
    assert small.engine.scheduler.num_preemptions > 0
    model.generation_config.eos_token_id = None
    for chat, out, again in zip(chats, outs, preempted, strict=True):
        ids = llm.engine.tokenize(messages=chat)
        assert ids[:2] == [TINY["vocab"] - 2, TINY["vocab"] - 5]  # <|im_start|> system: the template's
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
            reference = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
        assert out.token_ids == again.token_ids == expected.tolist()
        assert [lp.token_id for lp in again.prompt_logprobs] == ids[1:]
        got = torch.tensor([lp.logprob for lp in again.prompt_logprobs])
        torch.testing.assert_close(got, reference[torch.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0)


def test_lfm2_keeps_each_convolutions_input_in_the_pool_and_copies_it_on_write(tmp_path):
    """LFM2's short convolutions keep, in the blocks of the paged pool, one `hidden_size` row a token
    per convolving layer beside the attending layers' K and V (which only those layers have), and
    the engine sizes the pool by both. Parallel samples fork a prompt whose last block is partly
    filled: its copy on write copies the convolutions' rows too, so n greedy samples are each the
    single greedy output (a copy without them reads zeros at the prompt's last positions)."""
    from inflight import LLM
    from inflight.engine.runner import ModelRunner

    model = tiny_hf_model("lfm2")
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path, TINY["vocab"])
    llm = LLM(model=str(tmp_path), num_kv_blocks=32, block_size=16)
    runner, cfg = llm.engine.runner, llm.engine.model.config
    assert cfg.conv_layers == (True, False, True, True) and cfg.conv_kernel == 3
    assert runner.kv_cache.shape == (1, 2, 32 * 16, cfg.num_kv_heads, cfg.head_dim)
    assert runner.conv_cache is not None and runner.conv_cache.shape == (3, 32 * 16, cfg.hidden_size)
    per_block = (runner.kv_cache.numel() + runner.conv_cache.numel()) * 4 // 32
    assert ModelRunner.kv_bytes_per_block(llm.engine.model, 16) == per_block
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: the third block holds 8
    # (the samples first, on a pool that never held these tokens: a block reused from an earlier
    # run of the same prompt would hold the right rows without a copy)
    many = llm.generate([prompt], SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))
    one = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert [sample.token_ids for sample in many] == [one.token_ids] * 3
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["lfm2", "lfm2_moe"])
def test_lfm2s_convolving_layers_read_their_matmuls_as_stored(tmp_path, arch):
    """A Q8_0 file's and a bf16 checkpoint's in_proj and out_proj are read as stored, as the
    attending layers' matmuls are (widened to fp32, a single stream's in_proj read 4 bytes a weight
    where Q8_0 holds 1.06), with the logits of the same weights widened."""
    from inflight.model.linear import blocks_usable
    from inflight.model.loader import load_blocks, load_embedding

    if not blocks_usable():
        pytest.skip("these kernels read no stored blocks (built without AVX2)")
    model = tiny_hf_model(arch)
    write_gguf_from_hf(tmp_path / "q8.gguf", arch, model, matrices="Q8_0")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    ids = list(range(5, 45))
    for path in (tmp_path / "q8.gguf", tmp_path / "bf16"):
        source = resolve_model(str(path))
        config, weights = load_checkpoint(source, torch.float32)
        _, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
        kept = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=load_blocks(source, config),
                          embedding=load_embedding(source, config))
        assert all(getattr(layer, f).blocks is not None for layer in kept.layers for f in ("qkv", "o")), path.name
        assert [layer.mixer for layer in kept.layers] == ["conv", "attention", "conv", "conv"]
        dense = LlamaModel(config, weights, torch.device("cpu"))
        torch.testing.assert_close(inflight_logits(kept, ids), inflight_logits(dense, ids), atol=1e-4, rtol=1e-4)


# --- GGUF files of every supported tensor type ------------------------------------------------

def _k_quant_bytes(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """Random K-quant (and IQ4) blocks with sane fp16 scales (gguf can dequantize but not quantize these)."""
    nblocks = cols // 256
    if kind == "Q4_K":  # d, dmin (f16), 12 bytes of 6-bit scales, 128 bytes of nibbles
        blocks = rng.integers(0, 256, size=(rows, nblocks, 144), dtype=np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(0.005).tobytes(), np.uint8)
    elif kind == "Q6_K":  # 128 low nibbles, 64 high bits, 16 int8 scales, d (f16)
        blocks = rng.integers(0, 256, size=(rows, nblocks, 210), dtype=np.uint8)
        blocks[..., 192:208] = rng.integers(0, 8, size=16, dtype=np.uint8)
        blocks[..., 208:210] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    elif kind == "IQ4_XS":  # d (f16), 2 bytes of high scale bits, 4 of low ones, 128 bytes of 4-bit indices
        blocks = rng.integers(0, 256, size=(rows, nblocks, 136), dtype=np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.0004).tobytes(), np.uint8)
    elif kind == "IQ4_NL":  # blocks of 32: d (f16), 16 bytes of 4-bit indices
        blocks = rng.integers(0, 256, size=(rows, cols // 32, 18), dtype=np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    else:  # the grid and ternary types (IQ1-IQ3, TQ): random indices, signs and scales, d of 1e-4 to 3e-4
        from tests.test_linear import random_blocks

        return random_blocks(kind, rows, cols, seed=int(rng.integers(1 << 31)), d_range=(1e-4, 3e-4))[0].numpy()
    return blocks.reshape(rows, -1)


# The grid types side by side and beside other types, as llama.cpp's IQ2 and IQ3 mixes put them (its
# IQ3_M: IQ3_S beside Q4_K), a fused q/k/v of three grid types; and the ternary ones.
MIX_GRID = {"embd": "IQ4_XS", "q": "IQ2_XXS", "k": "IQ3_XXS", "v": "IQ3_S", "o": "IQ2_XS", "gate": "IQ1_S",
            "up": "IQ1_M", "down": "IQ2_S"}
MIX_TERNARY = {"embd": "TQ2_0", "q": "TQ1_0", "k": "TQ2_0", "v": "TQ2_0", "o": "TQ1_0", "gate": "TQ2_0", "up": "TQ1_0",
               "down": "IQ4_XS"}
# MXFP4 (as llama.cpp's MXFP4_MOE files hold their experts, and gpt-oss's), a fused q/k/v of it beside Q8_0.
MIX_MXFP4 = {"embd": "MXFP4", "q": "MXFP4", "k": "Q8_0", "v": "MXFP4", "o": "MXFP4", "gate": "MXFP4", "up": "Q4_0",
             "down": "MXFP4"}


def write_tiny_gguf(path: Path, types: dict[str, str], seed: int = 0, extra: tuple[str, ...] = (),
                    rope_dims: int | None = None, metadata: Callable[[Any], None] | None = None) -> None:
    """`metadata`: called with the GGUFWriter to add keys of the caller's own."""
    import gguf

    rng = np.random.default_rng(seed)
    h, f, n_layers = TINY["hidden"], TINY["intermediate"], TINY["layers"]
    head_dim = h // TINY["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(TINY["vocab"])
    w.add_rope_dimension_count(rope_dims or head_dim)
    if metadata is not None:
        metadata(w)

    def add(name: str, shape: tuple[int, ...], kind: str = "F32", scale: float = 0.05) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("Q4_K", "Q6_K", "IQ4_XS", "IQ4_NL", *GRID_TYPES):
            w.add_tensor(name, _k_quant_bytes(rng, shape[0], shape[1], kind), raw_dtype=qtype)
            return
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, data)
        elif kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (TINY["vocab"], h), types.get("embd", "F32"), 1.0)
    add("output_norm.weight", (h,), scale=0.1)
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (h,), scale=0.1)
        add(f"blk.{i}.ffn_norm.weight", (h,), scale=0.1)
        add(f"blk.{i}.attn_q.weight", (h, h), types.get("q", "F32"))
        add(f"blk.{i}.attn_k.weight", (TINY["kv_heads"] * head_dim, h), types.get("k", "F32"))
        add(f"blk.{i}.attn_v.weight", (TINY["kv_heads"] * head_dim, h), types.get("v", "F32"))
        add(f"blk.{i}.attn_output.weight", (h, h), types.get("o", "F32"))
        add(f"blk.{i}.ffn_gate.weight", (f, h), types.get("gate", "F32"))
        add(f"blk.{i}.ffn_up.weight", (f, h), types.get("up", "F32"))
        add(f"blk.{i}.ffn_down.weight", (h, f), types.get("down", "F32"))
    for name in extra:
        add(name, (h,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("types", [
    {"embd": "F16", "q": "BF16", "k": "Q8_0", "v": "Q4_0", "o": "Q4_1", "gate": "Q4_K", "up": "Q6_K", "down": "F16"},
    {"embd": "Q8_0", "q": "Q4_K", "k": "Q6_K", "v": "Q8_0", "o": "F32", "gate": "Q4_0", "up": "Q4_1", "down": "Q8_0"},
    {"embd": "Q6_K", "q": "IQ4_XS", "k": "IQ4_XS", "v": "IQ4_NL", "o": "IQ4_NL", "gate": "IQ4_XS", "up": "IQ4_XS",
     "down": "IQ4_NL"},
    MIX_GRID,
    MIX_TERNARY,
    MIX_MXFP4,
], ids=["mix-a", "mix-b", "mix-iq4", "mix-grid", "mix-ternary", "mix-mxfp4"])
def test_gguf_tensor_types_match_transformers(tmp_path, types):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, types)
    config, weights = load_checkpoint(resolve_model(str(path)), torch.float32)
    assert config.tie_word_embeddings  # no output.weight in the file
    ours = LlamaModel(config, weights, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = list(range(3, 60))
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)


# llama.cpp's own quantizer's files (tests/fixtures/quantized)
QUANTIZED_FIXTURES = ["llama256-Q4_K_M", "llama256-Q5_K_M", "llama256-Q6_K", "llama256-Q3_K_M", "llama256-Q2_K",
                      "llama256-IQ4_XS", "llama256-IQ4_NL", "llama256-IQ3_M", "llama256-TQ1_0", "llama256-TQ2_0"]
# ... and of MoE fixtures: transformers 5's GGUF reader mistakes the shape of a stack of MXFP4 experts, so
# these are held to the dequantized model only (as `requantized`'s MoE files; MXFP4 itself against
# transformers: the mix-mxfp4 model)
QUANTIZED_MOE_FIXTURES = ["qwen3_moe-MXFP4_MOE", "gpt_oss-MXFP4_MOE"]


@pytest.mark.parametrize("name", QUANTIZED_FIXTURES)
def test_llama_cpp_k_quant_files_match_transformers(name):
    """llama.cpp's own quantizer's files (K-quant mixes, IQ4_XS, IQ4_NL, IQ3_M, TQ1_0, TQ2_0), loaded as the engine
    loads them, their matrices kept in their blocks (IQ3_M's IQ3_S and the TQ types decoded into int8 ones): the
    logits transformers computes from the same file."""
    from converter_fixtures import QUANTIZED
    from transformers import AutoModelForCausalLM

    from inflight.model.loaded import LoadedModel

    path = QUANTIZED / f"{name}.gguf"
    ours = LoadedModel.load(str(path), torch.float32, torch.device("cpu")).model
    ours.use_context(ours.config.max_position_embeddings)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = list(range(3, 60))
    # logits of up to 14 (std 3.4) from 256-wide rows: fp32 summation order reaches 1e-4
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(reference, ids), atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,dtype", [("llama256", torch.bfloat16), ("llama256", torch.float16),
                                        ("gemma2", torch.bfloat16), ("glm4", torch.bfloat16),
                                        ("qwen3_moe", torch.bfloat16), ("qwen2_moe", torch.bfloat16),
                                        ("granitemoe", torch.float16), ("gpt_oss", torch.bfloat16)])
def test_a_16_bit_checkpoint_stays_16_bit_and_computes_its_fp32_logits_bit_for_bit(tmp_path, arch, dtype):
    """A checkpoint stored in bf16 or fp16 (as models are published), loaded as the engine loads it
    on CPU in fp32: its matmuls' weights stay in 16 bits (2 bytes a weight, no fp32 form; a tied
    head reads the embedding's; each routed expert's too, Granite MoE's as views of its stacked
    experts, gpt-oss's as copies of its stacks' transposed, interleaved parts), widened in
    registers, and the embedding stays as stored, its rows widened as read. Widening is exact,
    so the logits equal bit for bit those of the same values held in fp32, and transformers' on
    that checkpoint within fp32 summation noise."""
    from converter_fixtures import tiny_model
    from transformers import AutoModelForCausalLM

    from inflight.model.linear import blocks_usable
    from inflight.model.loader import WidenedRows, load_blocks, load_embedding

    if not blocks_usable():
        pytest.skip("these kernels read no stored blocks (built without AVX2)")
    tiny_model(arch).to(dtype).save_pretrained(tmp_path, safe_serialization=True)
    source = resolve_model(str(tmp_path))
    config, weights = load_checkpoint(source, torch.float32)
    _, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
    blocks = load_blocks(source, config)
    embedding = load_embedding(source, config)
    kind = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    assert {k for k, _ in blocks.values()} == {kind} and isinstance(embedding, WidenedRows)
    assert all(shapes[name].is_meta for name in blocks) and shapes["model.embed_tokens.weight"].is_meta
    dense = LlamaModel(config, weights, torch.device("cpu"))
    kept = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=blocks, embedding=embedding)
    linears = [m for layer in kept.layers for f in ("qkv", "o", "gate_up", "down") if (m := getattr(layer, f))]
    linears.append(kept.lm_head)
    experts = [m for layer in kept.layers if layer.experts is not None and layer.experts.router is not None
               for m in (*layer.experts.gate_up, *layer.experts.down, *(layer.experts.shared or ())[:2])]
    assert all(m.blocks is not None and m.weight.numel() == 0 for m in experts)
    linears += experts
    assert all(linear.blocks is not None and linear.weight.numel() == 0 for linear in linears)
    assert_kept_computes_as_dense(kept, dense)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = list(range(3, 60))
    torch.testing.assert_close(inflight_logits(kept, ids), hf_logits(reference, ids), atol=3e-4, rtol=1e-4)


def assert_kept_computes_as_dense(kept: LlamaModel, dense: LlamaModel) -> None:
    """A model whose matrices stay as stored gives the logits of the same values held in fp32,
    bit for bit, at a step of a few rows (in registers) and of many (a panel at a time)."""
    for model in (dense, kept):
        model.use_context(model.config.max_position_embeddings)
    for ids in (list(range(3, 6)), list(range(3, 43))):
        assert torch.equal(inflight_logits(kept, ids), inflight_logits(dense, ids))


def hf_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[..., rows, K]` as transformers' MXFP4 stores it (gpt-oss's checkpoints): blocks
    `[..., rows, K / 32, 16]` of two FP4 e2m1 codes a byte, the low nibble first, and E8M0 scales
    `[..., rows, K / 32]`, each group's the power of two that brings its largest value within 6,
    the values rounded to the nearest of FP4's."""
    fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - fp4).abs().argmin(-1) + 8 * (scaled < 0)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_checkpoint_keeps_its_experts_in_mxfp4_as_transformers_computes(tmp_path):
    """gpt-oss as OpenAI publishes it: the experts' stacks in MXFP4 (`X_blocks`, `X_scales`,
    `quantization_config` mxfp4), the rest 16-bit. Loaded as the engine loads it on CPU, each
    expert's gate, up and down stay MXFP4 (llama.cpp's blocks, made from the file one expert's
    part at a time as the model packs it), and the logits equal bit for bit those of the
    checkpoint dequantized, which are transformers' on the same directory (it dequantizes MXFP4
    on a CPU); elsewhere (no kernels, another dtype) the stacks are dequantized."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from inflight.model.linear import blocks_usable
    from inflight.model.loader import load_blocks, load_embedding, weight_footprint

    if not blocks_usable():
        pytest.skip("these kernels read no stored blocks (built without AVX2)")
    tiny_hf_model("gpt_oss").to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    [file] = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # stored [experts, in, out]; quantized along `in`, rows of `out` (gate and up interleaved)
        blocks, scales = hf_mxfp4(tensors.pop(name).float().transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(file), metadata={"format": "pt"})
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))

    source = resolve_model(str(tmp_path))
    config, weights = load_checkpoint(source, torch.float32)
    _, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
    blocks = load_blocks(source, config)
    experts = {name for name, (kind, _) in blocks.items() if kind == "MXFP4"}
    assert len(experts) == config.num_layers * config.num_experts * 3  # gate, up and down of each
    assert all(shapes[name].is_meta for name in experts)
    dense = LlamaModel(config, weights, torch.device("cpu"))
    kept = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=blocks,
                      embedding=load_embedding(source, config))
    assert all(m.blocks is not None and m.weight.numel() == 0
               for layer in kept.layers for m in (*layer.experts.gate_up, *layer.experts.down))
    assert_kept_computes_as_dense(kept, dense)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = list(range(5, 95))
    torch.testing.assert_close(inflight_logits(kept, ids), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)
    # counted at the packed size, not widened
    footprint = dict(weight_footprint(source, torch.float32, packed=True, blocks=True).parts)
    expert_weights = config.num_layers * config.num_experts * 3 * config.hidden_size * config.intermediate_size
    assert footprint["matrices as stored, repacked for the matmuls"] >= 0.5625 * expert_weights


def test_16_bit_rows_that_are_not_whole_blocks_are_widened(tmp_path):
    """The packing holds 16-bit rows in blocks of 32 weights: a matrix whose rows are not (a down
    projection 48 wide), from a checkpoint or a GGUF file, is widened to fp32 at load, the others
    stay 16-bit, and the logits are those of the same values in fp32."""
    import gguf
    import transformers

    from inflight.model.linear import blocks_usable
    from inflight.model.loader import load_blocks, load_embedding

    if not blocks_usable():
        pytest.skip("these kernels read no stored blocks (built without AVX2)")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=TINY["vocab"], hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False)).eval()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_gguf_from_hf(tmp_path / "f32.gguf", "llama", model.float())
    reader = gguf.GGUFReader(tmp_path / "f32.gguf")  # the same file with every matrix in F16
    writer = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        writer.add_tensor(t.name, data.astype(np.float16) if data.ndim == 2 else data)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    ids = list(range(3, 43))
    for path in (tmp_path / "hf", tmp_path / "f16.gguf"):
        source = resolve_model(str(path))
        config, weights = load_checkpoint(source, torch.float32)
        _, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
        blocks = load_blocks(source, config)
        assert "model.layers.0.mlp.gate_proj.weight" in blocks and "model.layers.0.mlp.down_proj.weight" not in blocks
        kept = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=blocks,
                          embedding=load_embedding(source, config))
        assert kept.layers[0].down.blocks is None and kept.layers[0].gate_up.blocks is not None
        dense = LlamaModel(config, weights, torch.device("cpu"))
        assert torch.equal(inflight_logits(kept, ids), inflight_logits(dense, ids))


def requantized(source: Path, path: Path, kind: str) -> Path:
    """`source` (a GGUF file of f32 tensors) written again with every matrix (and stack of
    experts' matrices) whose rows divide into 32-weight blocks quantized by gguf-py to `kind`."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    qtype = gguf.GGMLQuantizationType[kind]
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if data.ndim in (2, 3) and data.shape[-1] % 32 == 0 and not t.name.startswith("rope_"):
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", ["mix-a", "mix-b", "mix-c", "mix-iq4", "mix-grid", "mix-ternary", "mix-mxfp4",
                                  "phi3_longrope-Q8_0", "qwen3-Q4_1", "gemma2-Q8_0", "mixtral-Q4_1", "qwen3_moe-Q8_0",
                                  "qwen3_moe-MXFP4",
                                  "qwen2_moe-Q4_1", "granitemoe-Q4_0", "olmo2-Q4_0", "qwen2-Q5_1", "glm4-Q8_0",
                                  *QUANTIZED_FIXTURES, *QUANTIZED_MOE_FIXTURES])
def test_matrices_kept_in_gguf_blocks_compute_the_fp32_logits_bit_for_bit(tmp_path, name):
    """Loaded as the engine loads it on CPU, a GGUF file's matrices of `loader.BLOCK_TYPES` stay in
    their blocks (no fp32 form made or kept: the loader gives only their shapes), fused q/k/v or
    gate/up where their parts' types meet at whole panels (llama.cpp's Q4_K_M puts a Q6_K v beside
    Q4_K q and k), and the token embedding is read by row from the file; the logits of a step of a
    few rows and of many are exactly those of the fully dequantized model. Phi-3's partial rotary
    reorders the blocks' rows as it does the weights'. Routed experts stay in their blocks too,
    each expert's rows a view of the stack's (a MoE model's widened experts would outweigh
    the rest). The llama256 files are llama.cpp's own quantizer's K-quant, IQ and TQ files: every matrix
    stays in its blocks."""
    from converter_fixtures import FIXTURES, QUANTIZED

    from inflight.model.linear import blocks_usable
    from inflight.model.loader import GGUFRows, load_blocks, load_embedding

    if not blocks_usable():
        pytest.skip("these kernels read no GGUF blocks (built without AVX2)")
    if name.startswith("mix-"):
        path = tmp_path / "tiny.gguf"
        write_tiny_gguf(path, {"mix-a": {"embd": "F16", "q": "BF16", "k": "Q8_0", "v": "Q4_0", "o": "Q4_1",
                                         "gate": "Q4_1", "up": "Q4_1", "down": "Q8_0"},
                               "mix-b": {"embd": "Q8_0", "q": "Q8_0", "k": "Q8_0", "v": "Q8_0", "o": "F32",
                                         "gate": "Q4_0", "up": "Q4_1", "down": "Q8_0"},
                               "mix-c": {"embd": "Q6_K", "q": "Q4_K", "k": "Q4_K", "v": "Q4_K", "o": "Q4_0",
                                         "gate": "Q4_K", "up": "Q4_K", "down": "Q5_0"},
                               # llama.cpp's IQ4_XS: its 32-weight fallback IQ4_NL beside it, a fused q/k/v of both
                               "mix-iq4": {"embd": "IQ4_XS", "q": "IQ4_XS", "k": "IQ4_XS", "v": "IQ4_NL",
                                           "o": "IQ4_NL", "gate": "IQ4_XS", "up": "IQ4_NL", "down": "IQ4_XS"},
                               "mix-grid": MIX_GRID, "mix-ternary": MIX_TERNARY, "mix-mxfp4": MIX_MXFP4}[name])
    elif name in QUANTIZED_FIXTURES or name in QUANTIZED_MOE_FIXTURES:
        path = QUANTIZED / f"{name}.gguf"
    else:
        arch, kind = name.rsplit("-", 1)
        path = requantized(FIXTURES / f"{arch}.gguf", tmp_path / f"{name}.gguf", kind)
    source = resolve_model(str(path))
    config, weights = load_checkpoint(source, torch.float32)
    _, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
    blocks = load_blocks(source, config)
    embedding = load_embedding(source, config)
    assert blocks and any(t.is_meta for t in shapes.values())
    # The embedding read by row from the file unless a tied head needs it whole in fp32.
    assert shapes["model.embed_tokens.weight"].is_meta == isinstance(embedding, GGUFRows)
    assert embedding is not None or (config.tie_word_embeddings and "lm_head.weight" not in blocks)
    dense = LlamaModel(config, weights, torch.device("cpu"))
    kept = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=blocks, embedding=embedding)
    linears = [m for layer in kept.layers for f in ("qkv", "o", "gate_up", "down") if (m := getattr(layer, f))]
    linears.append(kept.lm_head)
    experts = [m for layer in kept.layers if layer.experts is not None and layer.experts.router is not None
               for m in (*layer.experts.gate_up, *layer.experts.down)]
    assert all(m.blocks is not None and m.weight.numel() == 0 for m in experts)
    linears += experts
    assert any(linear.blocks is not None for linear in linears)
    assert all(linear.weight.numel() == 0 for linear in linears if linear.blocks is not None)
    if name in QUANTIZED_FIXTURES or name in QUANTIZED_MOE_FIXTURES:
        assert all(linear.blocks is not None for linear in linears)
    assert_kept_computes_as_dense(kept, dense)


def test_a_gguf_tensor_inflight_does_not_know_is_refused(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, {}, extra=("blk.0.ssm_norm.weight",))
    with pytest.raises(ModelLoadError, match="tensor inflight does not know: blk.0.ssm_norm.weight"):
        load_checkpoint(resolve_model(str(path)), torch.float32)


def test_gguf_metadata_that_changes_the_arithmetic_is_refused_by_name(tmp_path):
    path = tmp_path / "partial.gguf"
    write_tiny_gguf(path, {}, rope_dims=TINY["hidden"] // TINY["heads"] // 2)
    with pytest.raises(ModelLoadError, match="llama.rope.dimension_count = 32 rotates part of each 64-wide head"):
        load_checkpoint(resolve_model(str(path)), torch.float32)
    write_tiny_gguf(path, {}, metadata=lambda w: (w.add_uint32("llama.expert_group_count", 4),
                                                  w.add_uint32("llama.expert_group_used_count", 2)))
    with pytest.raises(ModelLoadError, match="expert_group_used_count = 2 of 4: inflight chooses llama's experts "
                                             "from all of them, not within groups"):
        load_checkpoint(resolve_model(str(path)), torch.float32)


def test_other_dtypes_load(loaded):
    source = resolve_model(None)
    config, weights = load_checkpoint(source, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    model = LlamaModel(config, weights, torch.device("cpu"))
    ids = loaded.tokenizer.encode("The capital of France is")
    logits = inflight_logits(model, ids)
    reference = inflight_logits(loaded.model, ids)
    assert logits[-1].argmax() == reference[-1].argmax()


# --- tokenizer ---------------------------------------------------------------------------------

TEXTS = ["Hello world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café — “quotes”",
         "人工智能和机器学习", "emoji 🚀🔥 mixed", "def f(x):\n    return x ** 2\n"]


def test_tokenizer_matches_transformers(loaded):
    from transformers import AutoTokenizer

    path = resolve_model(None).path
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == reference(text)["input_ids"]
        assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好, who are you?"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert loaded.tokenizer.apply_chat_template(messages) == list(expected)




def vocab_gguf(tmp_path: Path, name: str, architecture: str | None = None,
               overrides: dict[str, str | bool] | None = None, reader: Any = None) -> Path:
    """llama.cpp's vocabulary-only GGUF `name` (tests/fixtures/gguf-vocab), unpacked; with
    `architecture`, its tokenizer metadata (from `reader`, the `vocab_reader` fixture's reader of
    that file) written again under that `general.architecture`, the keys of `overrides` with
    their values there."""
    import gzip

    import gguf

    if architecture is None:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(gzip.decompress((VOCABS / f"{name}.gguf.gz").read_bytes()))
        return path
    renamed = tmp_path / f"{name}-{architecture}.gguf"
    writer = gguf.GGUFWriter(str(renamed), architecture)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key not in (overrides or {}):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for key, value in (overrides or {}).items():
        (writer.add_bool if isinstance(value, bool) else writer.add_string)(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return renamed


@pytest.mark.parametrize(("name", "architecture"), [
    ("qwen2", None),  # byte-level BPE
    ("llama-bpe", None),  # Llama 3's byte-level BPE (SmolLM3's too): ignore_merges, a BOS by default
    ("phi-3", None), ("phi-3", "llama"),  # SentencePiece, as Phi-3's and as Llama 2's or Mistral's files say
    # Splits transformers' reader does not know (llama.cpp's, `gguf_splits`); plain-text user tokens
    ("falcon", None), ("starcoder", None), ("deepseek-llm", None), ("deepseek-coder", None), ("mpt", None),
])
def test_gguf_vocabularies_give_their_hugging_face_tokenizers_ids(tmp_path, monkeypatch, vocab_reader, name,
                                                                  architecture):
    """The tokenizer rebuilt from a GGUF file's vocabulary gives the ids the model's own Hugging
    Face tokenizer gives, on llama.cpp's multilingual test texts (whitespace runs, code, emoji,
    Cyrillic, Chinese, numbers, ...), special tokens whole, and decodes them back. Each of the
    last five fails with transformers' GPT-2 split in its stead (1 to 9 texts of 47)."""
    from inflight.model.loader import ModelSource
    from inflight.model.tokenizer import Tokenizer

    # The conversions of files that go away stay out of the user's cache.
    monkeypatch.setattr("inflight.model.tokenizer.tokenizer_cache_dir", lambda: tmp_path / "cache")
    texts = (VOCABS / f"{name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = (VOCABS / f"{name}.out").read_text(encoding="utf-8").split("\n")
    reader = vocab_reader(name) if architecture else None
    tokenizer = Tokenizer.load(ModelSource(vocab_gguf(tmp_path, name, architecture, reader=reader), "gguf"))
    assert len(texts) == 47
    for text, ids in zip(texts, expected, strict=False):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], text
        if name != "phi-3":  # byte-level: every text comes back as it was
            assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    if name == "qwen2":
        assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    elif name == "llama-bpe":  # <|begin_of_text|> first; <|eot_id|> one token between words
        ids = tokenizer.encode("hi<|eot_id|>there")
        assert ids[0] == 128000 and ids.count(128009) == 1 and len(ids) == 4
    elif name == "phi-3":  # a BOS first; <|end|> one token between words
        ids = tokenizer.encode("hi<|end|>there")
        assert ids[0] == 1 and ids.count(32007) == 1 and len(ids) == 4
    elif name == "deepseek-coder":  # infilling marks, stored as plain text, whole (llama.cpp's ids)
        ids = tokenizer.encode("<｜fim▁begin｜>def f():<｜fim▁hole｜>\n<｜fim▁end｜>", add_special_tokens=False)
        assert ids == [32016, 1551, 267, 10942, 32015, 185, 32017]
    elif name == "mpt":  # every run of 2 to 24 spaces is one token, 50254 to 50276
        assert [tokenizer.encode(" " * n, add_special_tokens=False) for n in range(2, 25)] == \
            [[50278 - n] for n in range(2, 25)]


def test_a_vocabulary_of_an_unknown_pre_tokenizer_is_refused(tmp_path, monkeypatch, vocab_reader):
    """A byte-level vocabulary naming a pre-tokenizer neither transformers nor inflight can split
    text by (one llama.cpp splits by code of its own, or a name from a newer converter) is
    refused at load by name, as llama.cpp refuses it, not tokenized by a guess."""
    from inflight.model.loader import ModelSource
    from inflight.model.tokenizer import Tokenizer

    monkeypatch.setattr("inflight.model.tokenizer.tokenizer_cache_dir", lambda: tmp_path / "cache")
    for pre in ("kimi-k2", "a-new-one"):
        path = vocab_gguf(tmp_path, "starcoder", "starcoder", {"tokenizer.ggml.pre": pre}, vocab_reader("starcoder"))
        with pytest.raises(ModelLoadError, match=f"pre-tokenizer type '{pre}'"):
            Tokenizer.load(ModelSource(path, "gguf"))


@pytest.mark.parametrize("pre", ["glm4", "glm5"])
def test_a_glm_vocabulary_splits_text_as_llama_3s_and_adds_no_bos(tmp_path, monkeypatch, vocab_reader, pre):
    """GLM-4's files name a pre-tokenizer transformers' GGUF reader has no split for; llama.cpp
    splits their text with Llama 3's expression (and takes a word held whole, as Llama 3 does),
    and adds no BOS, even where the file says to: Llama 3's vocabulary under GLM's names gives
    Llama 3's ids on llama.cpp's test texts (numbers in groups of three among them), nothing
    before them."""
    from inflight.model.loader import ModelSource
    from inflight.model.tokenizer import Tokenizer

    monkeypatch.setattr("inflight.model.tokenizer.tokenizer_cache_dir", lambda: tmp_path / "cache")
    texts = (VOCABS / "llama-bpe.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = (VOCABS / "llama-bpe.out").read_text(encoding="utf-8").split("\n")
    overrides = {"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": True}
    path = vocab_gguf(tmp_path, "llama-bpe", "glm4", overrides, vocab_reader("llama-bpe"))
    tokenizer = Tokenizer.load(ModelSource(path, "gguf"))
    for text, ids in zip(texts, expected, strict=False):
        assert tokenizer.encode(text) == [int(i) for i in ids.split()], text


def test_a_llama3_vocabulary_takes_a_word_it_holds_whole(tmp_path, monkeypatch):
    """Llama 3's tokenizer takes a word its vocabulary holds as one token before any merge (its
    BPE's `ignore_merges`; llama.cpp's too, for the `llama-bpe` pre-tokenizer): a byte-level
    vocabulary holding "abc" with no merge that makes it, in a file of an architecture whose
    config transformers cannot read (OLMo 2)."""
    import gguf

    from inflight.model.loader import ModelSource
    from inflight.model.tokenizer import Tokenizer

    monkeypatch.setattr("inflight.model.tokenizer.tokenizer_cache_dir", lambda: tmp_path / "cache")
    for pre, whole in [("llama-bpe", True), ("qwen2", False)]:
        path = tmp_path / f"{pre}.gguf"
        writer = gguf.GGUFWriter(str(path), "olmo2")
        tokens = ["a", "b", "c", "bc", "abc", "<|end_of_text|>"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([1, 1, 1, 1, 1, 3])
        writer.add_token_merges(["b c"])
        writer.add_eos_token_id(5)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        tokenizer = Tokenizer.load(ModelSource(path, "gguf"))
        assert tokenizer.encode("abc", add_special_tokens=False) == ([4] if whole else [0, 3])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_equals_full_decode(loaded, text):
    tok = loaded.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"))
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_character_split_across_tokens(loaded):
    tok = loaded.tokenizer
    ids = tok.encode("🚀")
    assert len(ids) > 1, "the test needs a character spread over several byte tokens"
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🚀"


# --- errors ------------------------------------------------------------------------------------

def test_loading_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF garbage")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_checkpoint(resolve_model(str(tmp_path / "broken.gguf")), torch.float32)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    (hf_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_checkpoint(resolve_model(str(hf_dir)), torch.float32)
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # its own keys, none given
    with pytest.raises(ModelLoadError, match="incomplete or invalid .*config.json: KeyError"):
        load_checkpoint(resolve_model(str(hf_dir)), torch.float32)
    pickled = tmp_path / "pickled"  # an older checkpoint: weights as a PyTorch pickle
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (pickled / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights .*pytorch_model.bin: PyTorch pickles"):
        resolve_model(str(pickled))


def test_a_checkpoint_without_a_tokenizer_is_one_clear_line(tmp_path, loaded):
    """Weights and config but no tokenizer files: said before any weight is read, in one line
    (transformers' own message spans five)."""
    import transformers

    from inflight.model.loaded import LoadedModel

    config = transformers.LlamaConfig(vocab_size=TINY["vocab"], hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ModelLoadError, match="holds no tokenizer .*copy the model's tokenizer files") as info:
        LoadedModel.load(str(tmp_path), torch.float32, torch.device("cpu"))
    assert "\n" not in str(info.value)
    (tmp_path / "tokenizer_config.json").write_text("{}")  # a file, but no vocabulary in it
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer of") as info:
        LoadedModel.load(str(tmp_path), torch.float32, torch.device("cpu"))
    assert "\n" not in str(info.value)


def test_unsupported_gguf_architecture_and_quantization(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_checkpoint(resolve_model(str(tmp_path / "mamba.gguf")), torch.float32)


def test_a_shard_of_a_split_gguf_is_refused_with_the_way_to_merge_it(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama", split_max_tensors=1)  # llama.cpp's gguf-split form
    for name in ("token_embd.weight", "output_norm.weight"):
        w.add_tensor(name, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for shard in (1, 2):
        with pytest.raises(ModelLoadError, match=f"shard {shard} of 2 of a split GGUF .*llama-gguf-split --merge"):
            load_checkpoint(resolve_model(str(tmp_path / f"model-0000{shard}-of-00002.gguf")), torch.float32)


def test_cli_errors_are_one_line(tmp_path):
    for args in (["generate", "hi", "--model", str(tmp_path / "nope.gguf")],
                 ["generate", "hi", "--max-batch-size", "0", "--num-kv-blocks", "4"],
                 ["generate", "hi", "--hf-overrides", '{"rope_scaling": ', "--num-kv-blocks", "4"],
                 ["generate", "hi", "--hf-overrides", '{"num_hidden_layers": 1}', "--num-kv-blocks", "4"]):
        proc = subprocess.run([sys.executable, "-m", "inflight.cli", *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("inflight: error:"), proc.stderr
        assert "Traceback" not in proc.stderr


def test_gguf_tokenizer_cache_gives_the_same_tokenizer(tmp_path, monkeypatch):
    """The tokenizer rebuilt from GGUF metadata and the one read back from the cache agree."""
    from transformers import AutoTokenizer

    from inflight.model.tokenizer import Tokenizer, tokenizer_cache_dir

    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path))
    source = resolve_model(None)
    rebuilt = Tokenizer.load(source, (2,))
    (saved,) = tokenizer_cache_dir().glob("*/tokenizer.json")  # written by the first load
    read_from = []
    original = AutoTokenizer.from_pretrained

    def recording(path, *args, **kwargs):
        read_from.append((Path(path), kwargs.get("gguf_file")))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    cached = Tokenizer.load(source, (2,))
    assert read_from == [(saved.parent, None)]  # the cache, not the GGUF file
    texts = ["Hello world", "  leading spaces\n\ttabs", "写一首诗 🚀", "<|im_start|>user<|im_end|>", "x" * 300, ""]
    for text in texts:
        assert cached.encode(text) == rebuilt.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    assert cached.apply_chat_template(messages) == rebuilt.apply_chat_template(messages)
    ids = rebuilt.encode("The quick brown fox 🦊")
    assert cached.decode(ids) == rebuilt.decode(ids)
    assert (cached.eos_token_ids, cached.vocab_size) == (rebuilt.eos_token_ids, rebuilt.vocab_size)
    assert cached.hf.all_special_ids == rebuilt.hf.all_special_ids


def test_gguf_index_cache_gives_the_same_weights(tmp_path, monkeypatch):
    """The second load reads the saved tensor table instead of parsing the GGUF metadata, and
    gets the same config, weights and raw blocks, for every tensor type; a corrupt table falls
    back to parsing."""
    from inflight.model import gguf_reader, loader

    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {"embd": "F16", "q": "BF16", "k": "Q4_0", "v": "Q4_K", "o": "Q4_1", "gate": "Q6_K",
                           "up": "F16", "down": "Q8_0"})
    source = resolve_model(str(path))
    loader._read_gguf.cache_clear()
    config, weights = load_checkpoint(source, torch.float32)
    blocks = loader.load_blocks(source, config)
    assert {kind for kind, _ in blocks.values()} == {"F16", "BF16", "Q4_0", "Q4_K", "Q4_1", "Q6_K", "Q8_0"}
    (table,) = (tmp_path / "cache" / "gguf").glob("*.json")
    loader._read_gguf.cache_clear()
    real_reader = gguf_reader.read_gguf
    monkeypatch.setattr(gguf_reader, "read_gguf", lambda *a, **k: pytest.fail("parsed the file again"))
    config2, weights2 = load_checkpoint(source, torch.float32)
    assert config2 == config and weights2.keys() == weights.keys()
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
    blocks2 = loader.load_blocks(source, config2)
    assert blocks2.keys() == blocks.keys() and all(torch.equal(blocks[k][1], blocks2[k][1]) for k in blocks)
    monkeypatch.setattr(gguf_reader, "read_gguf", real_reader)
    table.write_text("{not json")
    loader._read_gguf.cache_clear()
    assert load_checkpoint(source, torch.float32)[0] == config
    loader._read_gguf.cache_clear()


def test_the_gguf_reader_over_a_plain_view_reads_what_gguf_reads(tmp_path):
    """`gguf_reader.read_gguf` (gguf's reader slicing a plain array over the file's map instead of
    the `np.memmap`, 3x faster on a large vocabulary) gives gguf's own reader's fields and tensors,
    value for value, and keeps the map whose pages a load gives back (`release_file_pages`)."""
    import mmap

    import gguf

    from inflight.model.gguf_reader import read_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {"embd": "F16", "q": "BF16", "k": "Q4_0", "v": "Q4_K", "o": "Q4_1", "gate": "Q6_K",
                           "up": "F16", "down": "Q8_0"},
                    metadata=lambda w: w.add_token_list([f"w{i}" for i in range(TINY["vocab"])]))
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields) and "tokenizer.ggml.tokens" in ours.fields
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.types, mine.data) == (field.types, field.data), key
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), key
        assert type(mine.parts[-1]) is np.ndarray  # not a memmap: the plain view's slices
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))
    assert isinstance(ours.mapping, np.memmap) and isinstance(ours.mapping.base, mmap.mmap)
    assert np.shares_memory(ours.tensors[0].data, ours.mapping)


def test_rotary_tables_cover_the_served_context_and_grow_alike(tmp_path):
    """A 131072-position model serving 256 tokens builds its rotary tables for those (not 67 MB
    of them at head_dim 128); a step past them grows the tables, and every position's values are
    the same however far the tables reach, in what steps they grew and on how many threads they
    were built, so the logits are too."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=TINY["vocab"], hidden_size=256, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=131072, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    cfg, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    served = LlamaModel(cfg, weights, torch.device("cpu"))
    served.use_context(256)
    assert [cos.shape for cos, _ in served.rope_tables] == [(256, 128)] * 3
    ids = [3 + i % 200 for i in range(600)]
    logits = inflight_logits(served, ids)  # past the 256 positions: grown to 640
    assert served.rope_tables[0][0].shape[0] == 640
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = LlamaModel(cfg, weights, torch.device("cpu"))
        whole.use_context(2048)
    finally:
        torch.set_num_threads(threads)
    for (cos, sin), (cos_whole, sin_whole) in zip(served.rope_tables, whole.rope_tables, strict=True):
        assert torch.equal(cos, cos_whole[:640]) and torch.equal(sin, sin_whole[:640])
    assert torch.equal(inflight_logits(whole, ids), logits)
