"""GGUF files made by llama.cpp's own `convert_hf_to_gguf.py`, one per architecture, for
tests/test_loading.py to read: the reference for llama.cpp's names, row orders and metadata, which
the suite's own GGUF writer only imitates.

Each comes from a tiny Hugging Face checkpoint that `tiny_model` rebuilds exactly (seeded random
weights, norm scales and biases moved off 1 and 0) with a SentencePiece vocabulary of 320 pieces
trained on `inflight/data`'s corpus. They are made once, outside the suite, in an optional
environment with sentencepiece and llama.cpp's sources (the llama-cpp-python sdist carries them),
and committed under `tests/fixtures/converted/`:

    python3.11 -m venv /tmp/conv && /tmp/conv/bin/pip install torch==2.13.0 transformers==5.24.0 \\
        sentencepiece safetensors numpy
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/*.tar.gz -C /tmp/lcp
    /tmp/conv/bin/python tests/converter_fixtures.py /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp [ARCH...]

`--quantized` in place of the architectures makes instead, under `tests/fixtures/quantized/`, the
files llama.cpp's own quantizer writes, in the K-quants gguf-py cannot produce: a Llama-shaped
checkpoint ("llama256") whose matrices have rows of 256 weights, the K-quants' block, converted to
f32 (not kept) and quantized by `llama-quantize` to each of `QUANT_TYPES`, and the committed MoE fixtures
quantized to `MOE_QUANT_TYPES` (MXFP4_MOE: the experts in MXFP4). That tool is built from
the same sources first (low priority: the build takes a while):

    cd /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp && nice -n 19 cmake -B build -DLLAMA_CURL=OFF \\
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    nice -n 19 cmake --build build --target llama-quantize -j2 && cd -
    /tmp/conv/bin/python tests/converter_fixtures.py /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp --quantized

OLMo 2's, Qwen2-MoE's, Qwen3-MoE's, OLMoE's, Phi-2's, StarCoder2's and Command R's converters ask for a
byte-level BPE tokenizer they recognize by hash, GLM-4's and GLM-4.5's for their own special tokens, EXAONE 4's
for a byte-level BPE of its own, StableLM's for Qwen's, Hunyuan's for its tiktoken file;
here they take the SentencePiece vocabulary instead (`_convert` patches those methods), which
changes no weight or setting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "converted"
QUANTIZED = Path(__file__).parent / "fixtures" / "quantized"
VOCAB = 320

# the types `llama-quantize` makes of the llama256 checkpoint, by its own names: each keeps output.weight
# in Q6_K, and the _M mixes and Q2_K widen some more tensors
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_M", "TQ1_0", "TQ2_0")
# the types `llama-quantize` makes of a committed MoE fixture (`converted/ARCH.gguf`, f32): MXFP4_MOE puts
# the experts in MXFP4 and the other matrices in Q8_0
MOE_QUANT_TYPES = {"qwen3_moe": ("MXFP4_MOE",), "gpt_oss": ("MXFP4_MOE",)}

# DeepSeek's latent attention and experts, small
_LATENT = {"num_hidden_layers": 3, "num_key_value_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
           "qk_rope_head_dim": 8, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1}

# architecture -> (transformers class prefix, the config's settings beyond the shared ones)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16}}),
    "mistral": ("Mistral", {"sliding_window": None}),
    "qwen2": ("Qwen2", {}),
    # Ministral 3: YaRN past 16 positions with DeepSeek's mscales, queries scaled by position past them
    "ministral3": ("Ministral3", {"head_dim": 16, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7, "llama_4_scaling_beta": 0.1}}),
    "qwen3": ("Qwen3", {"head_dim": 32}),
    # Qwen3 past its original context: YaRN over an original 16 positions
    "qwen3_yarn": ("Qwen3", {"head_dim": 32, "max_position_embeddings": 64,
                             "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                 "original_max_position_embeddings": 16}}),
    "olmo2": ("Olmo2", {}),
    # EXAONE 4 as its 1.2B: OLMo 2's layer, q/k normalized per head, no window
    "exaone4": ("Exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 2}),
    # OLMo 3: three sliding layers to one global, YaRN past 16 positions on the global ones only
    "olmo3": ("Olmo3", {"num_hidden_layers": 4, "sliding_window": 8,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    "granite": ("Granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.1,
                            "logits_scaling": 8.0}),
    "smollm3": ("SmolLM3", {"num_hidden_layers": 4, "pad_token_id": 0}),
    "phi3": ("Phi3", {"sliding_window": None, "pad_token_id": 0}),
    # Phi-3.5 / Phi-4-mini: longrope past an original 16 positions, a rotary over half of each head
    "phi3_longrope": ("Phi3", {"sliding_window": None, "pad_token_id": 0, "original_max_position_embeddings": 16,
                               "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5,
                                                   "original_max_position_embeddings": 16,
                                                   "short_factor": [1.0, 1.1, 1.3, 1.6],
                                                   "long_factor": [2.0, 3.0, 5.0, 8.0]}}),
    # Gemma: a GeGLU; its config says hidden_act "gelu", which transformers reads as the tanh GeGLU
    "gemma": ("Gemma", {"head_dim": 16, "tie_word_embeddings": True, "hidden_act": "gelu"}),
    "gemma2": ("Gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "tie_word_embeddings": True,
                          "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0,
                          "attn_implementation": "eager"}),
    "gemma3_text": ("Gemma3", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                               "tie_word_embeddings": True, "num_hidden_layers": 6, "rope_parameters": {
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # GLM-4: sandwich norms, q/k/v biases, half of each head rotated as interleaved pairs
    "glm4": ("Glm4", {"head_dim": 16, "pad_token_id": 0}),
    # ERNIE 4.5: Llama's layer, each head rotated as interleaved pairs
    "ernie4_5": ("Ernie4_5", {"head_dim": 16}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen3_moe": ("Qwen3Moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "norm_topk_prob": True}),
    # Qwen2-MoE: q/k/v biases, routed experts beside a shared one gated by a sigmoid
    "qwen2_moe": ("Qwen2Moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 64}),
    # Granite MoE: its multipliers, experts stacked in the checkpoint (gate and up fused in the file)
    "granitemoe": ("GraniteMoe", {"num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 12.0,
                                  "residual_multiplier": 0.22, "attention_multiplier": 0.1, "logits_scaling": 8.0}),
    # the converter writes OLMoE's eps of 1e-5 whatever the checkpoint says
    "olmoe": ("Olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "rms_norm_eps": 1e-5}),
    # Seed-OSS as its 36B: q/k/v biases (llama.cpp's reads no o bias)
    "seed_oss": ("SeedOss", {"head_dim": 16, "attention_bias": True, "attention_out_bias": False}),
    # Arcee: an ungated MLP, down(relu(up(x)) ** 2)
    "arcee": ("Arcee", {}),
    # GLM-4.5-Air: q/k/v biases, half of each head rotated; a dense first layer, then 4 experts (2 a token) chosen by
    # sigmoid scores plus a bias, scaled by 2.5, beside a shared one; one MTP layer counted (the file's last block)
    "glm4_moe": ("Glm4Moe", {"head_dim": 16, "num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                             "routed_scaling_factor": 2.5, "attention_bias": True, "use_qk_norm": False,
                             "num_nextn_predict_layers": 1}),
    # gpt-oss: attention sinks, sliding and global layers in turn, YaRN past 16 positions (its ramp truncated, as
    # llama.cpp computes every file), experts stacked [experts, in, out] with gate and up interleaved, with biases
    "gpt_oss": ("GptOss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "num_hidden_layers": 4,
                           "sliding_window": 8, "attn_implementation": "eager", "rope_parameters": {
                               "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                               "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": True}}),
    # Phi-2: a parallel block on one LayerNorm, an ungated GELU, biases on every matmul and the LM head, 0.4 of each
    # head rotated; its converter writes every head's own K and V and an MLP 4 times the width, as Phi-2 has them
    "phi": ("Phi", {"num_key_value_heads": 2, "intermediate_size": 128, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}}),
    # StableLM 2: LayerNorms, q/k/v biases, a quarter of each head rotated
    "stablelm": ("StableLm", {"use_qkv_bias": True}),
    # StarCoder2: LayerNorms, biases, an ungated GELU (llama.cpp's files carry no window: none here)
    "starcoder2": ("Starcoder2", {"sliding_window": None}),
    # ERNIE 4.5's MoE: a dense first layer, then 4 experts (2 a token) chosen by softmax scores plus a bias, beside
    # two shared ones (as many as its converter's width for them, the dense MLP's over the KV heads, makes them)
    "ernie4_5_moe": ("Ernie4_5_Moe", {"head_dim": 16, "num_hidden_layers": 3, "moe_num_experts": 4, "moe_k": 2,
                                      "moe_intermediate_size": 32, "moe_num_shared_experts": 2,
                                      "moe_layer_start_index": 1, "moe_layer_end_index": 2}),
    # Apertus: q/k norm, an ungated MLP of xIELU (its numbers drawn as every other weight), llama3 rope scaling (its
    # config's default, past 8192 positions: llama.cpp's converter writes it as rope_freqs)
    "apertus": ("Apertus", {"head_dim": 16, "pad_token_id": 0}),
    # Hunyuan (dense): q/k norm after the rotary, its rope a fixed NTK alpha (its converter checks the base and the
    # context of the published configs)
    "hunyuan_v1_dense": ("HunYuanDenseV1", {"head_dim": 16, "max_position_embeddings": 32768, "rope_parameters": {
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}}),
    # Nemotron: LayerNorms of (1 + w), an ungated MLP of relu squared, half of each head rotated
    "nemotron": ("Nemotron", {"head_dim": 16}),
    # Command R: a parallel block on a LayerNorm without bias, interleaved rotary pairs, the logits scaled, tied
    "cohere": ("Cohere", {"logit_scale": 0.3, "tie_word_embeddings": True, "pad_token_id": 0}),
    # LFM2: short convolutions around an attending layer with q/k norm, the MLP's width derived from the config's
    "lfm2": ("Lfm2", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"],
                      "norm_eps": 1e-6, "block_multiple_of": 32}),
    # LFM2-MoE: LFM2's layers, a dense first layer, then 4 experts (2 a token) chosen by sigmoid scores plus a bias
    "lfm2_moe": ("Lfm2Moe", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"],
                             "norm_eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                             "num_dense_layers": 1, "tie_word_embeddings": True}),
    # DeepSeek V2 (V2-Lite's shape): latent attention, the query projected directly, YaRN past 16 positions with
    # V2-Lite's mscales; a dense first layer, then 4 experts (2 a token) chosen by softmax scores, not renormalized,
    # beside a shared one (every head its own K and V in the config, as DeepSeek's say: its converter splits the
    # latent's up-projection by them)
    "deepseek_v2": ("DeepseekV2", {**_LATENT, "q_lora_rank": None, "max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    # DeepSeek V3: the query through a rank, experts chosen by sigmoid scores plus a bias, renormalized, scaled by
    # 2.5 (its published config names the scoring, which the converter writes)
    "deepseek_v3": ("DeepseekV3", {**_LATENT, "q_lora_rank": 32, "n_group": 1, "topk_group": 1,
                                   "routed_scaling_factor": 2.5, "scoring_func": "sigmoid"}),
    # DeepSeek V3's group-limited choice: 8 experts in 4 groups, 3 a token from its best 2 groups (its converter
    # writes n_group and topk_group as expert_group_count and expert_group_used_count)
    "deepseek_v3_grouped": ("DeepseekV3", {**_LATENT, "q_lora_rank": 32, "n_routed_experts": 8, "n_group": 4,
                                           "topk_group": 2, "num_experts_per_tok": 3, "routed_scaling_factor": 2.5,
                                           "scoring_func": "sigmoid"}),
    # GLM-4.7-Flash: V3's layer, scaled by 1.8; its config names no scoring (llama.cpp's file neither)
    "glm4_moe_lite": ("Glm4MoeLite", {**_LATENT, "q_lora_rank": 32, "n_group": 1, "topk_group": 1,
                                      "routed_scaling_factor": 1.8}),
    # GPT-2: learned positions, Conv1D matrices its converter transposes, an MLP 4 x n_embd wide (its converter's
    # rule); GPTBigCode (StarCoder): one K/V head, written as llama.cpp's starcoder; GPT-NeoX (Pythia): q/k/v
    # fused head by head (its converter reorders them), a quarter of each head rotated, the parallel block
    "gpt2": ("GPT2", {"n_inner": None, "n_ctx": 256, "n_positions": 256, "layer_norm_epsilon": 1e-5}),
    "gpt_bigcode": ("GPTBigCode", {"n_inner": None, "n_positions": 256, "multi_query": True,
                                   "layer_norm_epsilon": 1e-5}),
    "gpt_neox": ("GPTNeoX", {"rotary_pct": 0.25, "layer_norm_eps": 1e-5, "use_parallel_residual": True}),
    # OLMo (1): Llama's layer on LayerNorms without scale or bias (none in the file either)
    "olmo": ("Olmo", {}),
    # Falcon's newer layer (Falcon2-11B's): q/k/v fused in K/V groups (its converter reorders them), one LayerNorm
    # for the parallel block, no biases, an MLP 4 x hidden wide (its converter's rule)
    "falcon": ("Falcon", {"new_decoder_architecture": True, "num_kv_heads": 1, "num_ln_in_parallel_attn": 1,
                          "bias": False, "layer_norm_epsilon": 1e-5}),
    # Falcon-40B's: the parallel block on two LayerNorms (llama.cpp's attn_norm_2)
    "falcon_ln2": ("Falcon", {"new_decoder_architecture": True, "num_kv_heads": 1, "num_ln_in_parallel_attn": 2,
                              "bias": False, "layer_norm_epsilon": 1e-5}),
    # BLOOM: ALiBi, a LayerNorm of the embeddings, q/k/v fused head by head (its converter reorders them), biases
    # everywhere, an MLP 4 x hidden wide; MPT: ALiBi, no biases, its MLP expansion_ratio x d_model wide (neither
    # config has the shared settings' K/V heads or MLP width: None keeps them out of the reading)
    "bloom": ("Bloom", {"num_attention_heads": 4, "num_key_value_heads": None, "intermediate_size": None,
                        "layer_norm_epsilon": 1e-5}),
    "mpt": ("Mpt", {"num_attention_heads": 4, "num_key_value_heads": None, "intermediate_size": None,
                    "max_seq_len": 256, "expansion_ratio": 4}),
    # GLM-4-9B's transformers port, written as llama.cpp's chatglm: gate and up fused, q/k/v biases, half of each
    # head rotated as interleaved pairs (its converter writes a rotary base of 10000, an eps of 1e-5, a context
    # of `seq_length` and heads of hidden / heads whatever the config says: these are those)
    "glm": ("Glm", {"attention_bias": True, "pad_token_id": 0, "rms_norm_eps": 1e-5, "head_dim": 16,
                    "seq_length": 256}),
    # Phi-3.5-MoE: 4 experts, 2 a token by its sparse mixer (eps 0.01, what llama.cpp's files imply), LayerNorms,
    # biases on attention and the LM head
    "phimoe": ("Phimoe", {"num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": True,
                          "lm_head_bias": True, "router_jitter_noise": 0.01, "original_max_position_embeddings": 256}),
    # Command R7B: three sliding layers to one global, which rotates nothing (its converter reads rotary_pct)
    "cohere2": ("Cohere2", {"logit_scale": 0.3, "tie_word_embeddings": True, "pad_token_id": 0, "head_dim": 16,
                            "num_hidden_layers": 4, "sliding_window": 8, "rotary_pct": 1.0}),
}

# The class names of the models' own checkpoints where transformers' differ (MosaicML's, Microsoft's)
_OWN_CLASS_NAMES = {"mpt": "MPTForCausalLM", "phimoe": "PhiMoEForCausalLM"}

# the quantized fixtures' checkpoint: every row 256 weights long (head_dim 64), as the K-quants' blocks need
QUANTIZED_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama256": ("Llama", {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                           "num_key_value_heads": 2}),
}


def tiny_model(arch: str) -> Any:
    """The checkpoint the fixture of `arch` was converted from, rebuilt: every parameter drawn
    here from torch's seeded CPU generator in the model's own order, so transformers' way of
    initializing does not enter (norm scales about 1, biases and weights about 0)."""
    import transformers

    prefix, extra = (ARCHITECTURES | QUANTIZED_ARCHITECTURES)[arch]
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2)
    settings.update(extra)
    config_class = getattr(transformers, "Gemma3TextConfig" if arch == "gemma3_text" else f"{prefix}Config")
    # (GPT-2's class is its LMHeadModel)
    head = getattr(transformers, f"{prefix}ForCausalLM", None) or getattr(transformers, f"{prefix}LMHeadModel")
    model = head(config_class(**settings))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.3 * values if "norm" in name else 0.3 * values if name.endswith("bias") else 0.2 * values)
        for name, b in model.named_buffers():  # GLM-4.5's and LFM2-MoE's bias for the choice of experts
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(0.05 * torch.randn(b.shape, generator=generator))
    return model.eval()


def _train_vocab(path: Path) -> None:
    import sentencepiece as spm

    corpus = Path(__file__).parents[1] / "inflight" / "data"
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(corpus.glob("corpus-*.txt")))
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_prefix=str(path / "tokenizer"),
                                   vocab_size=VOCAB, model_type="bpe", bos_id=1, eos_id=2, unk_id=0,
                                   character_coverage=1.0, byte_fallback=False)


def _convert(llama_cpp: Path, arch: str, vocab: Path, work: Path, out: Path) -> None:
    """Save `tiny_model(arch)` with the vocabulary in `vocab` under `work`, and convert it to the f32
    GGUF `out` with llama.cpp's converter."""
    import subprocess

    hf = work / arch
    tiny_model(arch).save_pretrained(hf, safe_serialization=True)
    (hf / "tokenizer.model").write_bytes((vocab / "tokenizer.model").read_bytes())
    if arch in _OWN_CLASS_NAMES:  # as the model's own checkpoints name it (llama.cpp's converter knows no other)
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**config, "architectures": [_OWN_CLASS_NAMES[arch]]}))
    runner = ("import runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0]);"
              "from conversion.base import TextModel; "
              "TextModel._set_vocab_gpt2 = lambda self: self._set_vocab_sentencepiece(); "
              "from conversion.glm import Glm4Model; "
              "Glm4Model.set_vocab = lambda self: self._set_vocab_sentencepiece(); "
              "from conversion.exaone import Exaone4Model; "
              "Exaone4Model.set_vocab = lambda self: self._set_vocab_sentencepiece(); "
              "from conversion.glm import Glm4MoeModel; "
              "Glm4MoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece(); "
              "from conversion.stablelm import StableLMModel; "
              "StableLMModel.set_vocab = lambda self: self._set_vocab_sentencepiece(); "
              "from conversion.glm import Glm4MoeLiteModel; "
              "Glm4MoeLiteModel.set_vocab = lambda self: self._set_vocab_sentencepiece(); "
              "from conversion.chatglm import ChatGLMModel; "
              "ChatGLMModel.set_vocab = lambda self: self._set_vocab_sentencepiece(); "
              "from conversion.hunyuan import HunYuanModel; "
              "HunYuanModel.set_vocab = lambda self: self._set_vocab_sentencepiece(); "
              # (its converter reads GPT-NeoX's rotary_pct, which transformers 5 reads into rope_parameters)
              "from conversion.gptneox import GPTNeoXModel; _neox = GPTNeoXModel.set_gguf_parameters; "
              "GPTNeoXModel.set_gguf_parameters = lambda self: (self.hparams.setdefault('rotary_pct', "
              "self.hparams['rope_parameters']['partial_rotary_factor']), _neox(self)); "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    subprocess.run([sys.executable, "-c", runner, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf),
                    "--outfile", str(out), "--outtype", "f32"], check=True)
    print(f"{arch}: {out} ({out.stat().st_size} bytes)")


def main(llama_cpp: Path, only: list[str]) -> int:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab"
        vocab.mkdir()
        _train_vocab(vocab)
        if only == ["--quantized"]:
            QUANTIZED.mkdir(parents=True, exist_ok=True)
            f32 = Path(tmp) / "llama256-F32.gguf"
            _convert(llama_cpp, "llama256", vocab, Path(tmp), f32)
            for kind in QUANT_TYPES:
                out = QUANTIZED / f"llama256-{kind}.gguf"
                subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f32), str(out), kind],
                               check=True)
                print(f"llama256 {kind}: {out} ({out.stat().st_size} bytes)")
            for arch, kinds in MOE_QUANT_TYPES.items():
                for kind in kinds:
                    out = QUANTIZED / f"{arch}-{kind}.gguf"
                    subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(FIXTURES / f"{arch}.gguf"),
                                    str(out), kind], check=True)
                    print(f"{arch} {kind}: {out} ({out.stat().st_size} bytes)")
            return 0
        FIXTURES.mkdir(parents=True, exist_ok=True)
        for arch in only or ARCHITECTURES:
            _convert(llama_cpp, arch, vocab, Path(tmp), FIXTURES / f"{arch}.gguf")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), sys.argv[2:]))
