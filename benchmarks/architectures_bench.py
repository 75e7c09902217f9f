"""Decode steps of each dense architecture at the embedded model's shapes (SmolLM2-135M: 30
layers, hidden 576, 9 heads of 64, 3 KV heads, MLP 1536, vocabulary 49152), seeded random
weights built from transformers' config classes, against Llama's on the same shapes: what each
plan's extra steps (q/k norm, sandwich norms, GeGLU, soft-capping, windows, NoPE layers, scaled
residuals, fused checkpoints) cost through the compiled stack. For each batch size, one engine
per architecture with that many requests (300-token prompts) decoding; the architectures take
turns, a median of five steps each per round.

    .venv/bin/python benchmarks/architectures_bench.py [--requests 64,1] [--rounds 4] [--archs ...]
    .venv/bin/python benchmarks/architectures_bench.py --archs llama_mha,gpt2,opt,gpt_neox,gptj   # the GPT family
    .venv/bin/python benchmarks/architectures_bench.py --archs gpt2_4x,bloom,mpt   # ALiBi
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

from inflight import LLM, SamplingParams
from inflight.model.hf_config import parse_hf_config
from inflight.model.llama import LlamaModel
from inflight.model.loaded import LoadedModel
from inflight.model.loader import load_checkpoint, resolve_model

SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
              tie_word_embeddings=True)


def transformers_model(arch: str) -> Any:
    import transformers

    extra: dict[str, dict[str, Any]] = {
        "llama": {}, "llama_mha": {"num_key_value_heads": 9}, "qwen3": {"head_dim": 64}, "olmo2": {}, "granite": {
            "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.125,
            "logits_scaling": 8.0},
        "smollm3": {"pad_token_id": 0}, "phi3": {"sliding_window": None, "pad_token_id": 0},
        # Gemma's windows shorter than the contexts here, so that the local layers slide
        "gemma2": {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 128},
        "gemma3_text": {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 128},
    }
    torch.manual_seed(0)
    if arch in GPT_SHAPES:  # every head its own K and V (no grouped heads in these models)
        name, settings = GPT_SHAPES[arch]
        head = getattr(transformers, f"{name}ForCausalLM", None) or getattr(transformers, f"{name}LMHeadModel")
        return head(getattr(transformers, f"{name}Config")(**settings)).eval()
    classes = {"llama": "Llama", "llama_mha": "Llama", "qwen3": "Qwen3", "olmo2": "Olmo2", "granite": "Granite",
               "smollm3": "SmolLM3", "phi3": "Phi3", "gemma2": "Gemma2", "gemma3_text": "Gemma3"}
    name = classes[arch]
    config_class = getattr(transformers, "Gemma3TextConfig" if arch == "gemma3_text" else f"{name}Config")
    settings = {**SHAPES, **extra[arch]}
    return getattr(transformers, f"{name}ForCausalLM")(config_class(**settings)).eval()


# The GPT family at the same widths under their own config keys (against `llama_mha`, Llama's layer with
# as many K/V heads as query heads, as theirs): learned positions (GPT-2, OPT), a
# parallel block on two LayerNorms (GPT-NeoX) or one (GPT-J), a quarter or a half of each head rotated.
_GPT2_KEYS = dict(vocab_size=49152, n_embd=576, n_layer=30, n_head=9, n_inner=1536, n_positions=2048)
GPT_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("GPT2", _GPT2_KEYS),
    "opt": ("OPT", dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, ffn_dim=1536,
                        max_position_embeddings=2048, word_embed_proj_dim=576)),
    "gpt_neox": ("GPTNeoX", dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                 intermediate_size=1536, max_position_embeddings=2048)),
    "gptj": ("GPTJ", {**_GPT2_KEYS, "rotary_dim": 32}),
    # ALiBi (BLOOM: a LayerNorm of the embeddings, biases; MPT: none): their MLPs are 4 x hidden wide in
    # transformers, so against GPT-2's layer as wide (`gpt2_4x`), learned positions in ALiBi's stead
    "gpt2_4x": ("GPT2", {**_GPT2_KEYS, "n_inner": 2304}),
    "bloom": ("Bloom", dict(vocab_size=49152, hidden_size=576, n_layer=30, n_head=9)),
    "mpt": ("Mpt", dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, max_seq_len=2048)),
}


def load(arch: str, tokenizer: Any) -> LoadedModel:
    """The architecture's LoadedModel, its weights as transformers initialized them (Gemma's
    norm scales stored as 1 + w, as the loader stores them; the GPT family's read from a saved
    checkpoint, as their names and layouts are their own)."""
    model = transformers_model(arch)
    if arch in GPT_SHAPES:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            config, weights = load_checkpoint(resolve_model(tmp), torch.float32)
        return LoadedModel(arch, LlamaModel(config, weights, torch.device("cpu")), tokenizer)
    config = parse_hf_config({**model.config.to_dict(), "model_type": arch.removesuffix("_mha")})
    weights = {name: t.detach().float() for name, t in model.state_dict().items()}
    if arch.startswith("gemma"):
        weights = {name: t + 1 if name.endswith("norm.weight") else t for name, t in weights.items()}
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return LoadedModel(arch, LlamaModel(config, weights, torch.device("cpu")), tokenizer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="64,1", help="batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=6, help="at most 12 (64 tokens a request)")
    parser.add_argument("--archs", default="llama,qwen3,olmo2,granite,smollm3,phi3,gemma2,gemma3_text")
    args = parser.parse_args()

    tokenizer = LoadedModel.load(None, torch.float32, torch.device("cpu")).tokenizer
    archs = args.archs.split(",")
    loaded = {arch: load(arch, tokenizer) for arch in archs}
    for arch, model in loaded.items():
        if model.model.decoder_stack is None:
            print(f"{arch}: the compiled layers do not serve it here")
    print(f"{torch.get_num_threads()} threads")
    for batch in (int(n) for n in args.requests.split(",")):
        engines = {}
        for arch, model in loaded.items():
            # Room for the 300-token prompts and the steps timed (about 40 tokens each), no more:
            # eight engines of 64 requests share the machine's memory.
            engine = LLM(loaded=model, max_batch_size=batch, max_num_tokens=2048, num_kv_blocks=24 * batch).engine
            gen = torch.Generator().manual_seed(0)
            params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
            for _ in range(batch):
                engine.add_request(torch.randint(100, 40000, (300,), generator=gen).tolist(), params)
            while not engine.step_records or engine.step_records[-1].num_prefill_tokens:
                engine.step()
            engines[arch] = engine
        times: dict[str, list[float]] = {arch: [] for arch in archs}
        for r in range(args.rounds):
            for arch in archs if r % 2 == 0 else reversed(archs):
                steps = []
                for _ in range(5):
                    start = time.perf_counter()
                    engines[arch].step()
                    steps.append(time.perf_counter() - start)
                times[arch].append(statistics.median(steps))
        base = statistics.median(times[archs[0]])
        for arch in archs:
            ms = statistics.median(times[arch]) * 1e3
            print(f"{batch} requests, {arch}: {ms:.1f} ms a decode step, {batch / ms * 1e3:.0f} tok/s, "
                  f"{base * 1e3 / ms:.2f}x {archs[0]}'s")
        del engines
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
