"""GPT-2, GPTBigCode (StarCoder), OPT, GPT-NeoX (Pythia), GPT-J and Falcon: learned absolute
positions, Conv1D matrices, q/k/v fused head by head or in K/V groups, a parallel block on two
LayerNorms (or one, GPT-J's and Falcon's), checkpoints under their own names and config keys;
against transformers, and the settings refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_loading import assert_setting_refused, hf_logits, inflight_logits, save_word_tokenizer, tiny_hf_model

from inflight import LLM, SamplingParams
from inflight.errors import InvalidRequestError, ModelLoadError
from inflight.model.llama import LlamaModel
from inflight.model.loaded import LoadedModel
from inflight.model.loader import load_checkpoint, resolve_model

GPT_FAMILY = ["gpt2", "gpt_bigcode", "opt", "gpt_neox", "gptj", "falcon"]


@pytest.mark.parametrize("arch", GPT_FAMILY)
def test_the_gpt_family_matches_transformers_from_fp32_and_16_bits(tmp_path, arch):
    """Each from a Hugging Face directory in fp32 and in 16 bits (kept as stored: GPT-2's Conv1D
    matrices transposed, GPT-NeoX's fused q/k/v reordered, before packing), over 90 positions
    (OPT's table read from row 2): transformers' logits within 1e-4; the shapes as its config
    gives them under its own keys."""
    from transformers import AutoModelForCausalLM

    model = tiny_hf_model(arch)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    half = torch.float16 if arch == "gpt_neox" else torch.bfloat16  # (Pythia's are fp16)
    copy.deepcopy(model).to(half).save_pretrained(tmp_path / "half", safe_serialization=True)
    rounded = AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32).eval()
    ids = list(range(5, 5 + 90))
    for source, reference in [(tmp_path / "hf", model), (tmp_path / "half", rounded)]:
        config, weights = load_checkpoint(resolve_model(str(source)), torch.float32)
        assert (config.architecture, config.hidden_size, config.num_heads, config.intermediate_size) == (
            arch, 128, 4 if arch == "falcon" else 2, 512)
        assert config.num_kv_heads == {"gpt_bigcode": 1, "falcon": 1}.get(arch, 2)
        assert config.position_offset == {"opt": 2, "gpt_neox": None, "gptj": None, "falcon": None}.get(arch, 0)
        assert config.rotary_dim == {"gpt_neox": 16, "gptj": 32}.get(arch)
        ours = LlamaModel(config, weights, torch.device("cpu"))
        if source.name == "half":  # as the engine loads it: the 16-bit matrices packed as stored
            save_word_tokenizer(source, 320)
            ours = LoadedModel.load(str(source), torch.float32, torch.device("cpu")).model
            assert ours.layers[0].qkv.blocks is not None and ours.layers[0].down.blocks is not None
        torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("fields", "kv_heads", "arch"), [
    ({"multi_query": False}, 4, "falcon"),  # every head its own K and V, q/k/v stored head by head
    ({"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1}, 2, "falcon"),  # Falcon2-11B
    ({"new_decoder_architecture": True, "num_kv_heads": 2}, 2, "falcon_ln2"),  # Falcon-40B's: two LayerNorms
], ids=["heads", "kv-groups", "two-norms"])
def test_falcons_fused_qkv_in_each_of_its_layouts_matches_transformers(tmp_path, fields, kv_heads, arch):
    """Falcon's other two layouts of the fused projection (the one K/V head's, `multi_query`, is
    the default above), and its 40B's block on two LayerNorms (transformers' reading of a newer
    layer that does not say how many): transformers' logits within 1e-4 through both interpreters."""
    model = tiny_hf_model("falcon", **fields)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    assert (config.num_kv_heads, config.architecture) == (kv_heads, arch)
    ids = list(range(5, 5 + 60))
    ours = LlamaModel(config, weights, torch.device("cpu"))
    compiled = inflight_logits(ours, ids)
    torch.testing.assert_close(compiled, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    ours.decoder_stack = None
    assert torch.equal(inflight_logits(ours, ids), compiled)


def test_gpt2_as_openai_published_it(tmp_path):
    """GPT-2's hub checkpoint: its tensors named without `transformer.`, each layer's causal-mask
    buffers beside its weights (left unread), no LM head (tied), a config.json of GPT-2's keys
    without n_inner (an MLP 4 x n_embd wide)."""
    from safetensors.torch import load_file, save_file

    model = tiny_hf_model("gpt2", n_inner=None)
    model.save_pretrained(tmp_path, safe_serialization=True)
    [file] = tmp_path.glob("*.safetensors")
    tensors = {name.removeprefix("transformer."): t for name, t in load_file(file).items() if name != "lm_head.weight"}
    for i in range(model.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(256, 256, dtype=torch.uint8))[None, None]
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, str(file), metadata={"format": "pt"})
    raw = json.loads((tmp_path / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("n_inner", "tie_word_embeddings")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config, weights = load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
    assert (config.intermediate_size, config.tie_word_embeddings) == (4 * 128, True)
    ids = list(range(5, 5 + 40))
    ours = LlamaModel(config, weights, torch.device("cpu"))
    torch.testing.assert_close(inflight_logits(ours, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("arch", "key", "value", "match"), [
    ("opt", "do_layer_norm_before", False, "do_layer_norm_before"),  # OPT-350M's norms after each block
    ("opt", "word_embed_proj_dim", 64, "word_embed_proj_dim = 64 projects"),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", "scale_attn_weights", False, "scale_attn_weights"),
    ("gpt2", "activation_function", "relu", "hidden_act"),
    ("gpt_neox", "use_parallel_residual", False, "use_parallel_residual"),
    ("gpt_neox", "hidden_act", "gelu_new", "hidden_act"),
    ("falcon", "alibi", True, "alibi"),
    ("falcon", "parallel_attn", False, "parallel_attn"),
])
def test_gpt_family_settings_inflight_does_not_compute_are_refused(tmp_path, arch, key, value, match):
    assert_setting_refused(tmp_path, arch, key, value, match)


def saved_in_fp32_and_bf16(tmp_path, model):
    """`model` saved in fp32 under `tmp_path / "hf"` and in bf16 under `tmp_path / "half"` (with a
    tokenizer, as the engine loads it); transformers' model of the bf16 one, in fp32."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "half", safe_serialization=True)
    save_word_tokenizer(tmp_path / "half", 320)
    return AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32).eval()


def test_olmo_matches_transformers_and_its_clipped_qkv_is_refused(tmp_path):
    """OLMo 1's LayerNorms carry no weights: a scale of ones, no bias, transformers' logits within
    1e-4 from fp32 and bf16 (packed as stored); `clip_qkv` (OLMo 1.7's) refused by name."""
    model = tiny_hf_model("olmo")
    assert not [name for name, _ in model.named_parameters() if "norm" in name]
    rounded = saved_in_fp32_and_bf16(tmp_path, model)
    ids = list(range(5, 5 + 90))
    config, weights = load_checkpoint(resolve_model(str(tmp_path / "hf")), torch.float32)
    torch.testing.assert_close(inflight_logits(LlamaModel(config, weights, torch.device("cpu")), ids),
                               hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    half = LoadedModel.load(str(tmp_path / "half"), torch.float32, torch.device("cpu")).model
    torch.testing.assert_close(inflight_logits(half, ids), hf_logits(rounded, ids), atol=1e-4, rtol=1e-4)
    assert_setting_refused(tmp_path / "clipped", "olmo", "clip_qkv", 8.0, "clip_qkv")


def test_learned_positions_bound_the_context(tmp_path):
    """A table of 256 positions serves 256 and no more: the engine's context is capped there (a
    request up to the last position is served, one past it refused by its length), and a config
    claiming more positions than its table holds is refused at load."""
    tiny_hf_model("gpt2").save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path, 320)
    llm = LLM(model=str(tmp_path), max_model_len=4096, num_kv_blocks=64)
    assert llm.engine.scheduler_config.max_model_len == 256
    out = llm.generate([list(range(5, 5 + 250))], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6  # up to the last position the table holds
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len \\(256\\)"):
        llm.generate([list(range(5, 5 + 250))], SamplingParams(max_tokens=7))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "n_positions": 512}))
    with pytest.raises(ModelLoadError, match="learned positions"):
        LLM(model=str(tmp_path), num_kv_blocks=64)


# --- ALiBi: BLOOM and MPT ----------------------------------------------------------------------

@pytest.mark.parametrize(("arch", "fields", "max_bias"), [
    ("bloom", {}, 8.0),
    ("bloom", {"n_embed": 160, "n_head": 5}, 8.0),  # heads not a power of two: the slopes interleaved
    ("mpt", {}, 8.0),
    ("mpt", {"attn_config": {"alibi": True, "alibi_bias_max": 4}}, 4.0),  # steeper slopes, as its config says
], ids=["bloom", "bloom-5-heads", "mpt", "mpt-max-bias-4"])
def test_alibi_models_match_transformers_from_fp32_and_16_bits(tmp_path, monkeypatch, arch, fields, max_bias):
    """BLOOM (a LayerNorm of the embeddings, q/k/v fused head by head, biases everywhere) and MPT
    (no biases, its attention settings nested in `attn_config`): no rotary and no position table,
    each score biased by the key's distance from the query (ALiBi); from fp32 and from 16 bits
    (packed as stored), over 90 positions, transformers' logits within 1e-4, the compiled layer
    loop equal to the Python one bit for bit. The same weights without ALiBi are far off.
    transformers' MPT takes 8 for `alibi_bias_max` whatever its config says; MosaicML's own code
    and llama.cpp take the config's, and so does inflight: the reference here is transformers
    given the config's."""
    import dataclasses

    from transformers.models.mpt import modeling_mpt

    monkeypatch.setattr(modeling_mpt.MptModel, "build_mpt_alibi_tensor",
                        lambda self, heads, length, alibi_bias_max=8, device=None:
                        modeling_mpt.build_mpt_alibi_tensor(heads, length, max_bias, device))

    model = tiny_hf_model(arch, **fields)
    rounded = saved_in_fp32_and_bf16(tmp_path, model)
    ids = list(range(5, 5 + 90))
    config, weights = load_checkpoint(resolve_model(str(tmp_path / "hf")), torch.float32)
    assert (config.alibi_max_bias, config.rope_layers, config.position_offset) == (
        max_bias, (False,) * config.num_layers, None)
    assert config.intermediate_size == 4 * config.hidden_size and config.num_kv_heads == config.num_heads
    ours = LlamaModel(config, weights, torch.device("cpu"))
    compiled = inflight_logits(ours, ids)
    torch.testing.assert_close(compiled, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    ours.decoder_stack = None
    assert torch.equal(inflight_logits(ours, ids), compiled)
    without = LlamaModel(dataclasses.replace(config, alibi_max_bias=None), weights, torch.device("cpu"))
    assert (inflight_logits(without, ids) - compiled).abs().max() > 1e-2
    half = LoadedModel.load(str(tmp_path / "half"), torch.float32, torch.device("cpu")).model
    assert half.layers[0].qkv.blocks is not None
    torch.testing.assert_close(inflight_logits(half, ids), hf_logits(rounded, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("arch", "key", "value", "match"), [
    ("mpt", "alibi", False, "alibi"),  # learned positions in place of ALiBi: transformers' MPT has none
    ("mpt", "clip_qkv", 6.0, "clip_qkv"),
    ("mpt", "qk_ln", True, "qk_ln"),
    ("mpt", "prefix_lm", True, "prefix_lm"),
    ("bloom", "apply_residual_connection_post_layernorm", True, "apply_residual_connection_post_layernorm"),
])
def test_alibi_model_settings_inflight_does_not_compute_are_refused(tmp_path, arch, key, value, match):
    """MPT's attention settings sit in `attn_config` (set there, as its configs carry them), BLOOM's
    at the top: each value inflight does not compute refuses the model by name."""
    model = tiny_hf_model(arch)
    model.save_pretrained(tmp_path, safe_serialization=True)
    load_checkpoint(resolve_model(str(tmp_path)), torch.float32)  # as saved: loads
    raw = json.loads((tmp_path / "config.json").read_text())
    if arch == "mpt":
        raw["attn_config"] = {**raw["attn_config"], key: value}
    else:
        raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=match):
        load_checkpoint(resolve_model(str(tmp_path)), torch.float32)
