"""DeepSeek's multi-head latent attention (MLA): DeepSeek V2 and V3 and GLM-4.7-Flash against
transformers, the pool's one row a token, the simulator's counts, and the settings refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_loading import assert_setting_refused, hf_logits, inflight_logits, tiny_hf_model

from inflight.engine.block_manager import BlockManager
from inflight.engine.runner import ModelRunner
from inflight.engine.sampler import Sampler
from inflight.engine.scheduler import ScheduledRequest
from inflight.model.llama import LlamaModel
from inflight.model.loader import load_checkpoint, resolve_model
from inflight.perf.shapes import attention_params
from inflight.request import Request, SamplingParams

LATENT_ARCHITECTURES = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


@pytest.mark.parametrize("arch", LATENT_ARCHITECTURES)
def test_latent_attention_matches_transformers_from_fp32_and_bf16(tmp_path, arch):
    """Each from a Hugging Face directory, fp32 and bf16 (widened at load, as transformers reads
    it), over 90 positions (past V2's 64 original ones, where its YaRN and DeepSeek's softmax scale
    apply): transformers' logits within 1e-4, the latent read as one key head of the latent's and
    the rotated part's width."""
    from transformers import AutoModelForCausalLM

    model = tiny_hf_model(arch)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "half", safe_serialization=True)
    rounded = AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32).eval()
    ids = list(range(5, 5 + 90))
    for source, reference in [(tmp_path / "hf", model), (tmp_path / "half", rounded)]:
        config, weights = load_checkpoint(resolve_model(str(source)), torch.float32)
        latent = config.latent_attention
        assert latent is not None and (latent.q_lora_rank is None) == (arch == "deepseek_v2")
        assert (config.num_kv_heads, config.head_dim, config.rotary_dim) == (1, 32 + 16, 16)
        ours = LlamaModel(config, weights, torch.device("cpu"))
        torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)


def test_the_pool_keeps_each_layers_normalized_latent_and_rotated_key_one_row_a_token(tmp_path):
    """The pool holds one row a token a layer (not K and V): the latent as transformers' layer
    normalizes it, then the shared key part rotated; the engine's memory counts that row."""
    model = tiny_hf_model("deepseek_v3")
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    assert config.pool_values_per_token == config.num_layers * (32 + 16)
    ours = LlamaModel(config, weights, torch.device("cpu"))
    runner = ModelRunner(ours, 8, 16, Sampler(torch.device("cpu")))
    assert runner.kv_cache.shape == (config.num_layers, 1, 8 * 16, 1, 48)
    assert runner.kv_bytes_per_block(ours, 16) == 16 * config.num_layers * 48 * 4
    ids = list(range(7, 7 + 20))
    blocks = BlockManager(8, 16)
    request = Request("r", ids, SamplingParams())
    blocks.allocate_slots(request, len(ids))
    table = blocks.block_table("r")
    inputs = runner.prepare([ScheduledRequest(request, 0, len(ids), table)])
    ours.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_meta, torch.arange(len(ids)))
    slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(len(ids))])
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        normed = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor(ids)))
        compressed = attn.kv_a_proj_with_mqa(normed)
        latent = attn.kv_a_layernorm(compressed[:, :32])
        cos, sin = model.model.rotary_emb(normed[None], torch.arange(len(ids))[None])
        # (DeepSeek's interleaved pairs, rotated into halves: transformers' layout and the pool's)
        rotated, _ = apply_rotary_pos_emb_interleave(compressed[None, None, :, 32:], compressed[None, None, :, 32:],
                                                     cos, sin)
    stored = runner.kv_cache[0, 0, slots, 0]
    torch.testing.assert_close(stored, torch.cat([latent, rotated[0, 0]], dim=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", LATENT_ARCHITECTURES)
def test_the_simulator_counts_a_latent_layers_weights_as_the_checkpoint_holds_them(arch):
    config_source = tiny_hf_model(arch)
    from inflight.model.hf_config import parse_hf_config

    config = parse_hf_config(config_source.config.to_dict())
    attn = config_source.model.layers[0].self_attn
    matrices = sum(p.numel() for name, p in attn.named_parameters() if "norm" not in name)
    assert attention_params(config) == matrices


@pytest.mark.parametrize(("arch", "key", "value", "match"), [
    ("deepseek_v2", "norm_topk_prob", True, "norm_topk_prob"),
    ("deepseek_v2", "scoring_func", "sigmoid", "scoring_func"),
    ("deepseek_v3", "scoring_func", "softmax", "scoring_func"),
    ("deepseek_v3", "topk_method", "random", "topk_method"),
    ("deepseek_v3", "moe_layer_freq", 2, "moe_layer_freq"),
    ("deepseek_v3", "n_group", 4, "groups must divide"),  # 6 experts: no 4 equal groups
    ("qwen3_moe", "n_group", 2, "n_group"),  # no groups in its router
    ("deepseek_v3", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 64}, "llama_4_scaling_beta")])
def test_deepseeks_expert_settings_that_inflight_does_not_compute_are_refused(tmp_path, arch, key, value, match):
    assert_setting_refused(tmp_path, arch, key, value, match)


@pytest.mark.parametrize("arch", [*LATENT_ARCHITECTURES, "glm4_moe"])
def test_experts_are_chosen_within_groups_as_transformers_chooses_them(tmp_path, arch):
    """8 experts in 4 groups, a token's 3 chosen within its best 2 groups (V2's scored by their
    best expert, under its topk_method "group_limited_greedy"; the others' by their best two's sum,
    the bias for the choice included): transformers' logits within 1e-4, the compiled stack's bit
    for bit the Python loop's; the same weights with the choice from all experts miss them (the
    groups change the choice). V2's "greedy" leaves the groups unused, as its code does."""
    from transformers import AutoModelForCausalLM

    from inflight.model.kernels import cpu_kernels

    method = {"topk_method": "group_limited_greedy"} if arch == "deepseek_v2" else {}
    model = tiny_hf_model(arch, n_routed_experts=8, n_group=4, topk_group=2, **method)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ids = list(range(5, 5 + 90))
    expected = hf_logits(model, ids)

    def logits(python_loop: bool = False, **overrides: object) -> tuple[torch.Tensor, tuple[int, int]]:
        if overrides:
            raw = json.loads((tmp_path / "config.json").read_text())
            (tmp_path / "config.json").write_text(json.dumps({**raw, **overrides}))
        config, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
        ours = LlamaModel(config, weights, torch.device("cpu"))
        if python_loop:
            ours.decoder_stack = None
        else:
            assert ours.decoder_stack is not None or cpu_kernels() is None
        return inflight_logits(ours, ids), config.expert_groups

    compiled, groups = logits()
    assert groups == (4, 2)
    torch.testing.assert_close(compiled, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits(python_loop=True)[0], compiled)
    ungrouped, groups = logits(**({"topk_method": "greedy"} if arch == "deepseek_v2" else {"topk_group": 4}))
    assert groups == (1, 1) and (ungrouped - expected).abs().max() > 1e-2
    if arch == "deepseek_v2":  # as transformers computes it
        torch.testing.assert_close(ungrouped, hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), ids),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", LATENT_ARCHITECTURES)
def test_a_latent_layers_matmuls_are_read_as_stored(tmp_path, arch):
    """A bf16 checkpoint's and a Q8_0 file's fused projection (the query's or its rank's beside the
    compressed KV's), the query rank's up-projection and o are read as stored, not widened to fp32,
    and the file's up-projections of the latent (llama.cpp's attn_k_b and attn_v_b) a block matmul a
    head, with the logits of the same weights widened; compiled, the Python loop's logits bit for bit."""
    from converter_fixtures import FIXTURES
    from test_loading import requantized

    from inflight.model.linear import blocks_usable
    from inflight.model.loader import load_blocks, load_embedding

    if not blocks_usable():
        pytest.skip("these kernels read no stored blocks (built without AVX2)")
    tiny_hf_model(arch).to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    q8 = requantized(FIXTURES / f"{arch}.gguf", tmp_path / "q8.gguf", "Q8_0")
    ids = list(range(5, 45))
    for path in (tmp_path / "bf16", q8):
        source = resolve_model(str(path))
        config, weights = load_checkpoint(source, torch.float32)
        _, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
        kept = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=load_blocks(source, config),
                          embedding=load_embedding(source, config))
        assert all(layer.qkv.blocks is not None and layer.o.blocks is not None for layer in kept.layers), path.name
        latent = [layer.latent for layer in kept.layers if layer.latent is not None]
        assert len(latent) == config.num_layers
        if arch != "deepseek_v2":
            assert all(w.q_up is not None and w.q_up.blocks is not None for w in latent)
        heads = [m for w in latent for m in w.head_matmuls]
        if path.suffix == ".gguf":  # a key and a value up-projection a head, in Q8_0
            assert len(heads) == 2 * config.num_heads * config.num_layers and all(m.blocks is not None for m in heads)
        else:  # (a checkpoint's kv_b_proj: fp32 panels, a matmul a head, each row's sums its own)
            assert len(heads) == 2 * config.num_heads * config.num_layers and all(m.blocks is None for m in heads)
        dense = LlamaModel(config, weights, torch.device("cpu"))
        torch.testing.assert_close(inflight_logits(kept, ids), inflight_logits(dense, ids), atol=1e-4, rtol=1e-4)
        assert kept.decoder_stack is not None  # the compiled step reads the heads' matmuls as the Python loop does
        compiled = inflight_logits(kept, ids)
        kept.decoder_stack = None
        assert torch.equal(inflight_logits(kept, ids), compiled)


def test_the_simulators_deepseek_v2_lite_has_its_published_size_and_one_latent_row_a_token():
    """The built-in shapes of DeepSeek-V2-Lite: 15.7B parameters, 2.4B of them a token computes with
    (its card's figures: the routed experts' 6 of 64, the head), and a pool of 27 x 576 values a
    token, which the simulator prices."""
    from inflight.perf.cost_model import CostModel
    from inflight.perf.profiles import load_hardware
    from inflight.perf.shapes import BUILTIN_MODELS, num_active_linear_params, num_params

    lite = BUILTIN_MODELS["deepseek-v2-lite"]
    assert round(num_params(lite) / 1e9, 1) == 15.7
    assert abs(num_active_linear_params(lite) + lite.vocab_size * lite.hidden_size - 2.4e9) < 0.1e9
    assert lite.pool_values_per_token == 27 * 576
    assert CostModel(lite, load_hardware("h100")).kv_bytes_per_token == 27 * 576 * 2  # bf16


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_a_16_bit_model_runs_latent_attention_in_its_own_dtype(tmp_path, arch):
    """Loaded in bf16 (as a GPU engine loads it: the PyTorch interpreter over PyTorch's ops), the
    up-projections' batched matmuls run in bf16 beside bf16 queries; the logits within bf16's
    rounding of transformers' fp32 ones."""
    model = tiny_hf_model(arch)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.bfloat16)
    ours = LlamaModel(config, weights, torch.device("cpu"))
    latent = ours.layers[0].latent
    assert ours.dtype == torch.bfloat16 and latent is not None and isinstance(latent.k_up, torch.Tensor)
    assert latent.k_up.dtype == latent.v_up.dtype == torch.bfloat16  # type: ignore[union-attr]
    ids = list(range(5, 45))
    torch.testing.assert_close(inflight_logits(ours, ids).float(), hf_logits(model, ids), atol=5e-2, rtol=5e-2)
