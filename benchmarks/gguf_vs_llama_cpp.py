"""inflight beside llama.cpp on llama.cpp's own ground: the same GGUF file, computed from its
quantized blocks by both, the same thread count, each engine loaded once in its own fresh
subprocess. For each file and engine:

  load        seconds from the engine's constructor call to a model ready to step (llama.cpp: the
              model and its context; inflight: `LLM(model=...)`, model, tokenizer and KV pool)
  memory      /proc/self/status after the load: VmRSS, split into RssAnon (heap: repacked or
              widened weights, KV cache, buffers) and RssFile (pages of the mapped GGUF file), and
              VmHWM, the resident peak of the whole run
  single      one request, a 32-token prompt, greedy, a fixed number of tokens (EOS ignored):
              decode tok/s = (tokens - 1) / (last token's time - first token's time)
  burst-64    64 requests submitted at once, prompts of 32..128 tokens, a fixed number of output
              tokens each: generated tokens / wall time (submission to the last token)

Equal work: the same prompt token ids (seeded, random ids, no BOS added by either engine), the same
output lengths, greedy by argmax, the same threads (torch intra-op and llama.cpp's n_threads and
n_threads_batch), the same step budget (512 tokens a step, decodes first, then prompt chunks) and
the same KV capacity in tokens (64 sequences x a per-sequence context rounded up to 256 tokens) in
the same bytes: llama.cpp's f16 cache, inflight's pool in fp16 (`--kv-cache-dtype float16`;
`--kv-cache-dtype auto` gives inflight its fp32 pool, twice the bytes). llama.cpp runs through
llama-cpp-python's low-level batch API with the loop of `peers/llama_cpp_runner.py` (row (f) of
peers.py), its file mapped (mmap, its default) and its CPU "extra" buffer types as they come (it may
repack weights to interleaved layouts, in anonymous memory); inflight through
`LLMEngine.add_request` / `step` as `peers/inflight_runners.py` drives it. Before each engine's
process the file is read once (untimed) so that both load from the page cache, and inflight's
per-file caches (GGUF index, converted tokenizer, a large file's packed weights for each inflight
engine's form, unless INFLIGHT_PACKED_CACHE=off) and its C++ kernels are built by an untimed process
first, so that the load timed is the one a restarted server sees (marked m where it mapped kept
packed weights). Each child warms up with two short requests before the single-stream and burst
runs. The weights may be random: this measures speed and memory, and how often the two engines'
greedy tokens agree is reported only as a sanity check (they do not compute bit-identical logits:
llama.cpp quantizes activations to 8 bits for its dot products, inflight multiplies fp32 activations
by the dequantized weights; `inflight-a8`, inflight with `--quantization int8-activations`, computes
llama.cpp's way, its own contract).
Engines (`--engines`, in this order by default): inflight, inflight-a8, llama.cpp; also
inflight-bf16 (for a BF16 file: `--quantization bf16-activations`). Prompts are
random ids below 128000 and the file's vocabulary size (any Llama-shaped file, the embedded
model too).

Making the models (random N(0, 0.02) weights, norms 1.0 in F32, Llama 3's tokenizer from
tests/fixtures/gguf-vocab/llama-bpe.gguf.gz; Q8_0 (and with `--bf16`, BF16) written by gguf-py,
Q4_K_M (and any other of `--quantize-types`: IQ4_XS, ...) by llama.cpp's own `llama-quantize
--allow-requantize` from the Q8_0 file):

    .venv/bin/python benchmarks/gguf_vs_llama_cpp.py --make-models /tmp/ggufs --sizes 1b,8b \\
        --llama-quantize /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize

  1b: Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256,
      tied embeddings, rope theta 500000, no llama3 rope scaling), 1.3 GB in Q8_0
  8b: Llama-3.1-8B-shaped (hidden 4096, 32 layers, 32/8 heads, FFN 14336, untied output), 8.5 GB
  phi-2: Phi-2's 32 layers (hidden 2560, 32 heads of 80 each with its own K and V, 32 dims of each
      rotated, FFN 10240, ungated GELU, LayerNorms and biases), Llama 3's vocabulary; 3.2 GB in Q8_0
  lfm2-1.2b: LFM2-1.2B's 16 layers (hidden 2048; 10 short convolutions of 3 taps, 6 attending layers of 32
      heads of 64 over 8 KV heads with q/k norms, FFN 8192), Llama 3's vocabulary; 1.4 GB in Q8_0
  gpt-oss-20b: gpt-oss-20b's 24 layers (hidden 2880, 64/8 heads of 64, sinks, a window of 128 every
      other layer, 32 experts of 2880, 4 a token) as llama.cpp's MXFP4_MOE leaves them (experts
      MXFP4 with random codes, the rest Q8_0), Llama 3's vocabulary; 11.7 GB, no llama-quantize
  deepseek-v2-lite: DeepSeek-V2-Lite's 27 layers (hidden 2048, latent attention of 16 heads over a
      latent of 512 and a rotated key of 64, a dense first layer, then 64 experts of 1408, 6 a token,
      beside 2 shared) as llama.cpp's converter writes them, all Q8_0, Llama 3's vocabulary; 16.7 GB

llama-cpp-python in its own environment (compiles llama.cpp for this CPU; ~10+ min on 2 cores):

    python3.11 -m venv /tmp/llama-env && /tmp/llama-env/bin/pip install numpy
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llama-env/bin/pip install --no-binary llama-cpp-python \\
        llama-cpp-python==0.3.36

Running (the 1B files; the 8B ones with `--single-tokens 32 --burst-tokens 16`):

    .venv/bin/python benchmarks/gguf_vs_llama_cpp.py --llama-cpp-python /tmp/llama-env/bin/python \\
        --model /tmp/ggufs/llama-3.2-1b-shaped-Q4_K_M.gguf --model /tmp/ggufs/llama-3.2-1b-shaped-Q8_0.gguf \\
        --output benchmarks/results/gguf-vs-llama-cpp-1b.json

The script runs itself as each child (`--child inflight|inflight-a8|llama.cpp JOB RESULT`), under the Python
of that engine: standard library only at the top, each engine's imports inside its child.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS = HERE / "peers"
VOCAB_FIXTURE = REPO / "tests" / "fixtures" / "gguf-vocab" / "llama-bpe.gguf.gz"
# inflight-a8: inflight with `--quantization int8-activations` (the blocks times int8 activations,
# llama.cpp's arithmetic) in place of its default bit-exact fp32 one; inflight-bf16 with
# `--quantization bf16-activations` (a BF16 file's matrices times bf16 activations, as llama.cpp
# computes BF16 tensors).
QUANTIZATION = {"inflight": "none", "inflight-a8": "int8-activations", "inflight-bf16": "bf16-activations"}
ENGINES = (*QUANTIZATION, "llama.cpp")
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")

SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"name": "llama-3.2-1b-shaped", "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8,
           "ffn": 8192, "vocab": 128256, "tied": True},
    "8b": {"name": "llama-3.1-8b-shaped", "hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8,
           "ffn": 14336, "vocab": 128256, "tied": False},
    # gpt-oss-20b's layers (64 heads of 64 over 8 KV heads, sinks, a window of 128 every other layer, 32
    # experts of 2880, 4 a token) as llama.cpp's MXFP4_MOE writes them; Llama 3's vocabulary (128256 in
    # place of its 201088: the tokenizer of the fixture)
    # Phi-2's layers (a parallel block on one LayerNorm, an ungated GELU, biases everywhere, 32 heads of 80 each
    # with its own K and V, 32 of their dims rotated), Llama 3's vocabulary in place of its 51200
    "phi-2": {"name": "phi-2-shaped", "arch": "phi2", "hidden": 2560, "layers": 32, "heads": 32, "kv_heads": 32,
              "ffn": 10240, "vocab": 128256, "tied": False, "rotary": 32},
    # LFM2-1.2B's layers (short convolutions, and 6 attending layers with q/k norms), Llama 3's vocabulary in
    # place of its 65536
    "lfm2-1.2b": {"name": "lfm2-1.2b-shaped", "arch": "lfm2", "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8,
                  "ffn": 8192, "vocab": 128256, "tied": True, "attending": (2, 5, 8, 10, 12, 14)},
    # DeepSeek-V2-Lite's layers (latent attention: 16 heads, a latent of 512 and a rotated key of 64; a dense first
    # layer, then 64 experts of 1408, 6 a token by softmax scores, beside 2 shared), as llama.cpp's converter
    # writes them (the latent's up-projections in two, attn_k_b and attn_v_b), Llama 3's vocabulary in place
    # of its 102400
    "deepseek-v2-lite": {"name": "deepseek-v2-lite-shaped", "arch": "deepseek2", "hidden": 2048, "layers": 27,
                         "heads": 16, "kv_lora": 512, "rope": 64, "nope": 128, "v": 128, "ffn": 10944,
                         "experts": 64, "experts_used": 6, "expert_ffn": 1408, "shared": 2, "vocab": 128256,
                         "tied": False},
    "gpt-oss-20b": {"name": "gpt-oss-20b-shaped", "arch": "gpt-oss", "hidden": 2880, "layers": 24, "heads": 64,
                    "kv_heads": 8, "head_dim": 64, "experts": 32, "experts_used": 4, "ffn": 2880, "vocab": 128256,
                    "window": 128, "tied": False},
}


# ---------------------------------------------------------------------------------------------
# The models


def make_models(out_dir: Path, sizes: list[str], llama_quantize: str | None, threads: int, seed: int,
                pool_blocks: int, bf16: bool = False, quantize_types: tuple[str, ...] = ("Q4_K_M",)) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        shape = SHAPES[size]
        if shape.get("arch") in ("gpt-oss", "deepseek2"):
            made = out_dir / f"{shape['name']}-{'MXFP4_MOE' if shape['arch'] == 'gpt-oss' else 'Q8_0'}.gguf"
            if made.is_file():
                print(f"{made} exists; kept", file=sys.stderr)
                continue
            t = time.perf_counter()
            (write_gpt_oss_model if shape["arch"] == "gpt-oss" else write_deepseek2_model)(made, shape, seed,
                                                                                             pool_blocks)
            print(f"wrote {made} ({made.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s",
                  file=sys.stderr)
            continue
        for kind in ("Q8_0", "BF16") if bf16 else ("Q8_0",):
            made = out_dir / f"{shape['name']}-{kind}.gguf"
            if made.is_file():
                print(f"{made} exists; kept", file=sys.stderr)
                continue
            t = time.perf_counter()
            write_model(made, shape, seed, pool_blocks, kind)
            print(f"wrote {made} ({made.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s",
                  file=sys.stderr)
        q8 = out_dir / f"{shape['name']}-Q8_0.gguf"
        for quant in quantize_types:  # llama-quantize's names: Q4_K_M, IQ4_XS, ...
            made = out_dir / f"{shape['name']}-{quant}.gguf"
            if made.is_file():
                print(f"{made} exists; kept", file=sys.stderr)
                continue
            if llama_quantize is None:
                print(f"no --llama-quantize: {made} not made", file=sys.stderr)
                continue
            t = time.perf_counter()
            tmp = made.with_suffix(".tmp")
            with open(made.with_suffix(".quantize.log"), "w") as log:
                subprocess.run([llama_quantize, "--allow-requantize", str(q8), str(tmp), quant, str(threads)],
                               check=True, stdout=log, stderr=subprocess.STDOUT)
            os.replace(tmp, made)
            print(f"wrote {made} ({made.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s",
                  file=sys.stderr)


def write_model(path: Path, shape: dict[str, Any], seed: int, pool_blocks: int = 0, kind: str = "Q8_0") -> None:
    """A Llama-shaped (or, for the "phi2" and "lfm2" archs, Phi-2- or LFM2-shaped) GGUF file of Q8_0
    (or BF16) matrices (gguf-py's quantizer) and F32 norms (and biases, 0; LFM2's convolution taps
    N(0, 0.3)), written one slab of rows at a time (the 8B embedding alone is 2 GB in fp32), with
    the tokenizer.* keys of llama.cpp's ggml-vocab-llama-bpe.gguf. With `pool_blocks`, gguf-py
    quantizes that many 32-weight blocks of N(0, 0.02) once and every matrix is made of blocks
    drawn from them at random (with replacement): the same distribution, minutes instead of an
    hour for the 8B on 2 cores."""
    import gguf
    import numpy as np

    vocab = _llama_bpe_vocab()

    h, n_layers, heads, kv_heads = shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"]
    head_dim = h // heads
    q8 = gguf.GGMLQuantizationType[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[q8]

    phi, lfm2 = shape.get("arch") == "phi2", shape.get("arch") == "lfm2"
    attending = shape.get("attending", range(n_layers))
    w = gguf.GGUFWriter(str(path), shape.get("arch", "llama"))
    w.add_name(shape["name"] + " (random weights)")
    w.add_block_count(n_layers)
    w.add_context_length(2048 if phi else 8192)
    w.add_embedding_length(h)
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(heads)
    if lfm2:  # a KV head count per layer, 0 where it convolves (as llama.cpp's converter writes LFM2)
        w.add_head_count_kv([kv_heads if i in attending else 0 for i in range(n_layers)])
        w.add_shortconv_l_cache(3)
    else:
        w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0 if phi else 1000000.0 if lfm2 else 500000.0)
    if phi:
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape["vocab"])
    w.add_rope_dimension_count(shape.get("rotary", head_dim))
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{kind}"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocabulary(w, vocab)

    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape["vocab"], h))]
    for i in range(n_layers):
        matrices = [("attn_q", (h, h)), ("attn_k", (kv_heads * head_dim, h)), ("attn_v", (kv_heads * head_dim, h)),
                    ("attn_output", (h, h))]
        if lfm2 and i not in attending:  # a short convolution between in_proj (b, c, x) and out_proj
            matrices = [("shortconv.in_proj", (3 * h, h)), ("shortconv.conv", (h, 3)), ("shortconv.out_proj", (h, h))]
        elif lfm2:
            tensors += [(f"blk.{i}.attn_q_norm.weight", (head_dim,)), (f"blk.{i}.attn_k_norm.weight", (head_dim,))]
        if phi:  # one LayerNorm, an ungated MLP, a bias beside each matrix and norm
            matrices += [("ffn_up", (shape["ffn"], h)), ("ffn_down", (h, shape["ffn"]))]
            tensors += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_norm.bias", (h,))]
            for name, dims in matrices:
                tensors += [(f"blk.{i}.{name}.weight", dims), (f"blk.{i}.{name}.bias", (dims[0],))]
            continue
        tensors += [(f"blk.{i}.attn_norm.weight", (h,)), *((f"blk.{i}.{n}.weight", d) for n, d in matrices),
                    (f"blk.{i}.ffn_norm.weight", (h,)), (f"blk.{i}.ffn_gate.weight", (shape["ffn"], h)),
                    (f"blk.{i}.ffn_up.weight", (shape["ffn"], h)), (f"blk.{i}.ffn_down.weight", (h, shape["ffn"]))]
    tensors.append(("token_embd_norm.weight" if lfm2 else "output_norm.weight", (h,)))
    if phi:
        tensors.append(("output_norm.bias", (h,)))
    if not shape["tied"]:
        tensors.append(("output.weight", (shape["vocab"], h)))
    if phi:
        tensors.append(("output.bias", (shape["vocab"],)))
    for name, dims in tensors:
        if len(dims) == 1 or name.endswith("shortconv.conv.weight"):  # (taps: F32, as llama.cpp keeps them)
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            row_bytes = dims[1] // block * block_bytes
            w.add_tensor_info(name, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes, raw_dtype=q8)
    fout, rng, pool = _start_data(w, seed, pool_blocks, q8, block)
    for name, dims in tensors:
        w.write_padding(fout, fout.tell())
        if len(dims) == 1 or name.endswith("shortconv.conv.weight"):  # a norm's scales 1, a bias 0, taps random
            data = (np.ones(dims, dtype=np.float32) if "norm.weight" in name else np.zeros(dims, dtype=np.float32)
                    if len(dims) == 1 else (rng.standard_normal(dims, dtype=np.float32) * 0.3))
            data.tofile(fout)
            w.write_padding(fout, data.nbytes)
            continue
        rows_at_once = max(1, (16 << 20) // dims[1])
        for start in range(0, dims[0], rows_at_once):
            rows = min(rows_at_once, dims[0] - start)
            if pool is not None:
                pool[rng.integers(0, len(pool), rows * dims[1] // block)].tofile(fout)
                continue
            slab = rng.standard_normal((rows, dims[1]), dtype=np.float32)
            slab *= 0.02
            gguf.quants.quantize(slab, q8).tofile(fout)
        w.write_padding(fout, dims[0] * (dims[1] // block * block_bytes))
    w.close()


def write_gpt_oss_model(path: Path, shape: dict[str, Any], seed: int, pool_blocks: int = 0) -> None:
    """A gpt-oss-shaped GGUF file as llama.cpp's `llama-quantize ... MXFP4_MOE` leaves one: the
    experts' stacks in MXFP4 (random codes, each block's scale 2^-10..2^-6: weights up to 0.012-0.19),
    the other matrices Q8_0 (as `write_model`'s), the router, biases, sinks and norms F32 (biases and
    sinks N(0, 0.02), norms 1)."""
    import gguf

    vocab = _llama_bpe_vocab()
    h, n_layers, heads, kv_heads, hd = (shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim"))
    experts, ffn = shape["experts"], shape["ffn"]
    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
    arch = "gpt-oss"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(shape["name"] + " (random weights)")
    w.add_block_count(n_layers)
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_expert_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(experts)
    w.add_expert_used_count(shape["experts_used"])
    w.add_sliding_window(shape["window"])
    w.add_vocab_size(shape["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocabulary(w, vocab)

    # (name, numpy-order dims, type): F32 vectors and matrices, Q8_0 matrices, MXFP4 stacks
    tensors: list[tuple[str, tuple[int, ...], Any]] = [("token_embd.weight", (shape["vocab"], h), q8)]
    for i in range(n_layers):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", (h,), None), (b + "post_attention_norm.weight", (h,), None),
            (b + "attn_q.weight", (heads * hd, h), q8), (b + "attn_q.bias", (heads * hd,), None),
            (b + "attn_k.weight", (kv_heads * hd, h), q8), (b + "attn_k.bias", (kv_heads * hd,), None),
            (b + "attn_v.weight", (kv_heads * hd, h), q8), (b + "attn_v.bias", (kv_heads * hd,), None),
            (b + "attn_output.weight", (h, heads * hd), q8), (b + "attn_output.bias", (h,), None),
            (b + "attn_sinks.weight", (heads,), None),
            (b + "ffn_gate_inp.weight", (experts, h), None), (b + "ffn_gate_inp.bias", (experts,), None),
            (b + "ffn_gate_exps.weight", (experts, ffn, h), mx), (b + "ffn_gate_exps.bias", (experts, ffn), None),
            (b + "ffn_up_exps.weight", (experts, ffn, h), mx), (b + "ffn_up_exps.bias", (experts, ffn), None),
            (b + "ffn_down_exps.weight", (experts, h, ffn), mx), (b + "ffn_down_exps.bias", (experts, h), None),
        ]
    tensors += [("output_norm.weight", (h,), None), ("output.weight", (shape["vocab"], h), q8)]
    _write_tensors(w, tensors, seed, pool_blocks)


def write_deepseek2_model(path: Path, shape: dict[str, Any], seed: int, pool_blocks: int = 0) -> None:
    """A DeepSeek-V2-Lite-shaped GGUF file as llama.cpp's converter writes the model (its query
    unranked, YaRN's settings V2-Lite's), every matrix and stack Q8_0 (drawn as `write_model`
    draws them), the router and norms F32 (router N(0, 0.02), norms 1)."""
    import gguf

    vocab = _llama_bpe_vocab()
    h, n_layers, heads = shape["hidden"], shape["layers"], shape["heads"]
    rank, rope, nope, v, experts = (shape[k] for k in ("kv_lora", "rope", "nope", "v", "experts"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name(shape["name"] + " (random weights)")
    w.add_block_count(n_layers)
    w.add_context_length(163840)
    w.add_embedding_length(h)
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v)
    w.add_kv_lora_rank(rank)
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(10000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(40.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_log_mul(0.1 * 0.707)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_leading_dense_block_count(1)
    w.add_expert_count(experts)
    w.add_expert_used_count(shape["experts_used"])
    w.add_expert_feed_forward_length(shape["expert_ffn"])
    w.add_expert_shared_count(shape["shared"])
    w.add_expert_weights_scale(1.0)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_vocab_size(shape["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocabulary(w, vocab)

    # (name, numpy-order dims, type): F32 vectors and routers, Q8_0 matrices and stacks
    shared, ffn = shape["shared"] * shape["expert_ffn"], shape["expert_ffn"]
    tensors: list[tuple[str, tuple[int, ...], Any]] = [("token_embd.weight", (shape["vocab"], h), q8)]
    for i in range(n_layers):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", (h,), None), (b + "attn_q.weight", (heads * (nope + rope), h), q8),
            (b + "attn_kv_a_mqa.weight", (rank + rope, h), q8), (b + "attn_kv_a_norm.weight", (rank,), None),
            (b + "attn_k_b.weight", (heads, rank, nope), q8), (b + "attn_v_b.weight", (heads, v, rank), q8),
            (b + "attn_output.weight", (h, heads * v), q8), (b + "ffn_norm.weight", (h,), None)]
        if i == 0:
            tensors += [(b + "ffn_gate.weight", (shape["ffn"], h), q8), (b + "ffn_up.weight", (shape["ffn"], h), q8),
                        (b + "ffn_down.weight", (h, shape["ffn"]), q8)]
            continue
        tensors += [
            (b + "ffn_gate_inp.weight", (experts, h), None),
            (b + "ffn_gate_exps.weight", (experts, ffn, h), q8), (b + "ffn_up_exps.weight", (experts, ffn, h), q8),
            (b + "ffn_down_exps.weight", (experts, h, ffn), q8),
            (b + "ffn_gate_shexp.weight", (shared, h), q8), (b + "ffn_up_shexp.weight", (shared, h), q8),
            (b + "ffn_down_shexp.weight", (h, shared), q8)]
    tensors += [("output_norm.weight", (h,), None), ("output.weight", (shape["vocab"], h), q8)]
    _write_tensors(w, tensors, seed, pool_blocks)


def _write_tensors(w: Any, tensors: list[tuple[str, tuple[int, ...], Any]], seed: int, pool_blocks: int) -> None:
    """The tensor table and data of a file whose metadata `w` holds: F32 vectors and matrices (norms
    1, the rest N(0, 0.02)), Q8_0 ones drawn as `write_model` draws them, MXFP4 ones of random codes
    (a scale byte 2^(e - 128), e 118..122, then 16 bytes of codes a block)."""
    import gguf
    import numpy as np

    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
    for name, dims, kind in tensors:
        if kind is None:
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            stored = (*dims[:-1], dims[-1] // block * block_bytes)
            w.add_tensor_info(name, stored, np.dtype(np.uint8), int(np.prod(stored)), raw_dtype=kind)
    fout, rng, pool = _start_data(w, seed, pool_blocks, q8, 32)
    for name, dims, kind in tensors:
        w.write_padding(fout, fout.tell())
        if kind is None:
            data = (np.ones(dims, dtype=np.float32) if name.endswith("norm.weight")
                    else rng.standard_normal(dims, dtype=np.float32) * 0.02)
            data.tofile(fout)
            w.write_padding(fout, data.nbytes)
            continue
        rows, k = int(np.prod(dims[:-1])), dims[-1]
        rows_at_once = max(1, (16 << 20) // k)
        for start in range(0, rows, rows_at_once):
            n = min(rows_at_once, rows - start)
            if kind == mx:
                blocks = rng.integers(0, 256, (n * k // 32, 17), dtype=np.uint8)
                blocks[:, 0] = rng.integers(118, 123, n * k // 32, dtype=np.uint8)
                blocks.tofile(fout)
            elif pool is not None:
                pool[rng.integers(0, len(pool), n * k // 32)].tofile(fout)
            else:
                slab = rng.standard_normal((n, k), dtype=np.float32)
                slab *= 0.02
                gguf.quants.quantize(slab, q8).tofile(fout)
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        w.write_padding(fout, rows * (k // block * block_bytes))
    w.close()


def _add_vocabulary(w: Any, vocab: Any) -> None:
    """The tokenizer.* keys of `vocab` (llama.cpp's Llama 3 vocabulary, read) into the writer `w`."""
    import gguf

    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)


def _start_data(w: Any, seed: int, pool_blocks: int, kind: Any, block: int) -> tuple[Any, Any, Any]:
    """The file's header, metadata and tensor table written; (its stream for the data, the seeded
    generator, and with `pool_blocks` that many blocks of `block` weights of N(0, 0.02) quantized
    to `kind` once, to draw the matrices' blocks from; else None)."""
    import gguf
    import numpy as np

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = None
    if pool_blocks:
        pool = np.concatenate([gguf.quants.quantize(rng.standard_normal((1 << 15, block), dtype=np.float32) * 0.02,
                                                    kind) for _ in range(0, pool_blocks, 1 << 15)])
    return w.fout[0], rng, pool


def _llama_bpe_vocab() -> Any:
    """llama.cpp's ggml-vocab-llama-bpe.gguf (the fixture, unpacked once into the temp dir), read."""
    import gzip
    import shutil

    import gguf

    vocab_file = Path(tempfile.gettempdir()) / "ggml-vocab-llama-bpe.gguf"
    if not vocab_file.is_file():
        with gzip.open(VOCAB_FIXTURE) as src, open(vocab_file, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return gguf.GGUFReader(vocab_file)


# ---------------------------------------------------------------------------------------------
# The workload


def workload(seed: int, single_prompt: int, single_tokens: int, burst_requests: int, burst_prompt: tuple[int, int],
             burst_tokens: int, vocab: int = 128000) -> dict[str, Any]:
    """Random token ids in [1000, vocab) (below the special tokens of Llama 3's vocabulary,
    128000+); the prompt lengths do not depend on `vocab`."""
    lengths, values = random.Random(seed), random.Random(seed + 1)
    ids = lambda n: [values.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    single = {"prompt_token_ids": ids(single_prompt), "max_tokens": single_tokens, "arrival_s": 0.0}
    burst = [{"prompt_token_ids": ids(lengths.randint(*burst_prompt)), "max_tokens": burst_tokens, "arrival_s": 0.0}
             for _ in range(burst_requests)]
    return {"single": single, "burst": burst}


def vocabulary_size(path: str) -> int:
    """Tokens in a GGUF file's vocabulary (the prompts' ids stay below it and below 128000)."""
    import gguf

    return min(128000, len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data))


# ---------------------------------------------------------------------------------------------
# The children (each engine's own process and Python)


def proc_status() -> dict[str, int]:
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in keys:
                out[key] = int(line.split()[1]) * 1024
    return out


def child(engine: str, job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    sys.path.insert(0, str(PEERS))
    from peer_protocol import Clock, PeerRequest, warmup_requests

    single = [PeerRequest(**job["single"])]
    burst = [PeerRequest(**r) for r in job["burst"]]
    threads, n_ctx_per_seq, n_seq = job["threads"], job["n_ctx_per_seq"], job["n_seq_max"]
    info: dict[str, Any] = {}
    t_import = time.perf_counter()
    if engine.startswith("inflight"):
        import torch

        torch.set_num_threads(threads)
        from inflight_runners import _drive

        from inflight import LLM
        from inflight.model import packed_cache
        from inflight.model.kernels import cpu_kernels
        from inflight.model.linear import linear_backend
        from inflight.model.loader import resolve_model

        kernels = cpu_kernels()  # built by the untimed prepare step; loaded here, before the clock
        # A large file's packed weights kept by an earlier load are mapped, not packed again
        # (`packed_cache`): which of the two the load time is.
        kept = packed_cache.locate(resolve_model(job["model"]), QUANTIZATION[engine], kernels)
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    kernels=kernels.isa() if kernels is not None else None,
                    linear=linear_backend(torch.device("cpu"), torch.float32),
                    packed_weights="mapped" if kept is not None and packed_cache.kept_bytes(kept) else "packed")
        import_s = time.perf_counter() - t_import
        before = proc_status()
        t0 = time.perf_counter()
        options = {"dtype": "float32", "device": "cpu", "max_batch_size": n_seq, "max_num_tokens": job["n_batch"],
                   "enable_chunked_prefill": True, "num_kv_blocks": n_seq * n_ctx_per_seq // 16,
                   "block_size": 16, "max_model_len": n_ctx_per_seq,
                   "quantization": QUANTIZATION[engine],
                   "kv_cache_dtype": job.get("kv_cache_dtype", "auto")}
        engine_obj = LLM(job["model"], **options).engine
        load_s = time.perf_counter() - t0
        info["options"] = options

        def run(requests):
            clock = Clock(requests)
            return _drive(engine_obj, requests, clock), clock

        def close() -> None:
            pass
    else:
        import llama_cpp
        from llama_cpp_runner import LlamaCppRunner

        info.update(version=llama_cpp.__version__, system_info=_system_info(llama_cpp))
        import_s = time.perf_counter() - t_import
        before = proc_status()
        t0 = time.perf_counter()
        runner = LlamaCppRunner(job["model"], n_seq, n_ctx_per_seq, job["n_batch"], threads)
        load_s = time.perf_counter() - t0
        info.update(n_seq_max=n_seq, n_ctx=n_seq * n_ctx_per_seq, n_batch=job["n_batch"], n_threads=threads,
                    use_mmap=True)

        def run(requests):
            clock = Clock(requests)
            return runner.run(requests, clock), clock

        close = runner.close
    after_load = proc_status()
    run(warmup_requests())
    records, _ = run(single)
    times = records[0].token_times_s
    single_out = {"tokens": records[0].token_ids, "ttft_s": times[0],
                  "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None}
    records, clock = run(burst)
    wall = clock.wall_s(records)
    generated = sum(len(r.token_ids) for r in records)
    burst_out = {"tokens": [r.token_ids for r in records], "wall_s": wall, "generated": generated,
                 "tok_s": generated / wall}
    end = proc_status()
    close()
    result = {"engine": engine, "import_s": import_s, "load_s": load_s, "before_load": before,
              "after_load": after_load, "end": end, "single": single_out, "burst": burst_out, "info": info}
    Path(result_path).write_text(json.dumps(result))


def _system_info(llama_cpp: Any) -> str:
    try:
        raw = llama_cpp.llama_print_system_info()
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception as exc:  # an older binding: not worth failing the run for
        return f"unavailable ({exc})"


_PREPARE = """
import sys
import torch
from inflight.model import packed_cache
from inflight.model.kernels import cpu_kernels
from inflight.model.loaded import LoadedModel
from inflight.model.loader import load_model_config, resolve_model
from inflight.model.tokenizer import Tokenizer
cpu_kernels()
source = resolve_model(sys.argv[1])
Tokenizer.load(source, load_model_config(source).eos_token_ids)
for quantization in sys.argv[2:]:  # a large file's packed weights, kept for the timed loads to map
    entry = packed_cache.locate(source, quantization, cpu_kernels())
    if entry is not None and not packed_cache.kept_bytes(entry):
        LoadedModel.load(sys.argv[1], torch.float32, torch.device("cpu"), quantization)
"""


# ---------------------------------------------------------------------------------------------
# The parent


def machine_info() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lscpu.splitlines())}
    flags = set(fields.get("Flags", "").split())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    # The working tree's own changes to inflight/, if any, named by a digest of their diff.
    diff = subprocess.run(["git", "diff", "HEAD", "--", "inflight"], capture_output=True, cwd=REPO).stdout
    return {"cpu": fields.get("Model name", platform.processor()), "num_cpus": os.cpu_count(),
            "flags": {f: f in flags for f in FLAGS_OF_INTEREST}, "platform": platform.platform(),
            "mem_total_gb": _meminfo("MemTotal") / 1e9, "inflight_commit": commit or None,
            "inflight_uncommitted_diff_sha256": hashlib.sha256(diff).hexdigest()[:16] if diff else None}


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def read_file_once(path: str) -> float:
    """Brings the file into the page cache (both engines then load from memory, not disk)."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t


def run_child(python: str, engine: str, job: dict[str, Any], tmp: Path, timeout: float) -> dict[str, Any]:
    stem = f"{Path(job['model']).stem}-{engine}"
    job_path, result_path, log_path = tmp / f"{stem}-job.json", tmp / f"{stem}-result.json", tmp / f"{stem}.log"
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "MKL_NUM_THREADS": str(job["threads"])}
    load_avg = os.getloadavg()
    (busy0, steal0), ours0, t0 = _cpu_s(), _children_cpu_s(), time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run([python, str(Path(__file__).resolve()), "--child", engine, str(job_path),
                               str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                              timeout=timeout)
    wall = time.perf_counter() - t0
    busy, steal = _cpu_s()
    others, stolen = (busy - busy0) - (_children_cpu_s() - ours0), steal - steal0
    if done.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{engine} failed (exit {done.returncode}); the end of {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["load_avg_before"] = load_avg
    # The machine's busy CPU time during the child, less the child's own: what other processes
    # took from the run (a quiet machine: a few seconds of the child's wall x CPUs).
    result["child_wall_s"], result["other_processes_cpu_s"], result["stolen_cpu_s"] = wall, others, stolen
    result["log"] = str(log_path)
    # llama.cpp's own account of its buffers (model, repacked weights, KV cache, compute).
    result["buffer_lines"] = [line.strip() for line in log_path.read_text().splitlines() if "buffer size" in line]
    return result


def _cpu_s() -> tuple[float, float]:
    """Seconds of CPU time the whole machine has been busy (user, nice, system, irq, softirq), and
    stolen by the hypervisor (a virtual machine's CPUs given to other guests), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]] + [0] * 8
    hz = os.sysconf("SC_CLK_TCK")
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / hz, ticks[7] / hz


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """How far the two engines' greedy tokens agree (a sanity check, not a correctness test)."""
    pairs = [(a["single"]["tokens"], b["single"]["tokens"])] + list(zip(a["burst"]["tokens"], b["burst"]["tokens"],
                                                                          strict=True))

    def common(x: list[int], y: list[int]) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    prefixes = [common(x, y) for x, y in pairs]
    return {"requests": len(pairs), "first_token_equal": sum(p > 0 for p in prefixes),
            "mean_common_prefix": sum(prefixes) / len(prefixes),
            "all_equal": sum(p == len(x) for p, (x, _) in zip(prefixes, pairs, strict=True))}


def distinct_tokens(result: dict[str, Any]) -> float:
    """Mean number of distinct tokens in a burst output (1 would be a degenerate repeat)."""
    outs = result["burst"]["tokens"]
    return sum(len(set(t)) for t in outs) / len(outs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="a GGUF file (repeatable)")
    p.add_argument("--llama-cpp-python", metavar="PATH", help="a Python where `import llama_cpp` works")
    p.add_argument("--engines", default="inflight,inflight-a8,llama.cpp", help="comma-separated, run in this order")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--single-prompt", type=int, default=32, help="single stream: prompt tokens (default 32)")
    p.add_argument("--single-tokens", type=int, default=128, help="single stream: generated tokens (default 128)")
    p.add_argument("--burst-requests", type=int, default=64)
    p.add_argument("--burst-prompt", default="32,128", help="burst: prompt lengths, uniform in MIN,MAX")
    p.add_argument("--burst-tokens", type=int, default=64, help="burst: generated tokens each (default 64)")
    p.add_argument("--n-batch", type=int, default=512,
                   help="tokens a step (llama.cpp n_batch, inflight max_num_tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds a child may run")
    p.add_argument("--output", default="benchmarks/results/gguf-vs-llama-cpp.json")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "gguf-vs-llama-cpp"),
                   help="the children's jobs, results and logs (kept; one set per file and engine)")
    p.add_argument("--make-models", metavar="DIR", help="write the GGUF files to DIR and exit")
    p.add_argument("--sizes", default="1b",
                   help="with --make-models: 1b, 8b, phi-2, lfm2-1.2b, gpt-oss-20b, deepseek-v2-lite or several, "
                        "comma-separated")
    p.add_argument("--llama-quantize", metavar="PATH", help="with --make-models: llama.cpp's llama-quantize")
    p.add_argument("--bf16", action="store_true", help="with --make-models: also a BF16 file of each size")
    p.add_argument("--quantize-types", default="Q4_K_M",
                   help="with --make-models: llama-quantize's types to make of each Q8_0 file (default Q4_K_M; "
                        "e.g. Q4_K_M,IQ4_XS)")
    p.add_argument("--pool-blocks", type=int, default=0,
                   help="with --make-models: draw the Q8_0 blocks from a pool of this many (default 0: all quantized)")
    p.add_argument("--kv-cache-dtype", default="float16",
                   help="inflight's KV pool (default float16: llama.cpp's f16 cache, the same bytes; auto: fp32)")
    p.add_argument("--child", nargs=3, metavar=("ENGINE", "JOB", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        child(*args.child)
        return 0
    if args.make_models:
        make_models(Path(args.make_models), [s.strip() for s in args.sizes.split(",") if s.strip()],
                    args.llama_quantize, args.threads, args.seed, args.pool_blocks, args.bf16,
                    tuple(t.strip() for t in args.quantize_types.split(",") if t.strip()))
        return 0
    if not args.model:
        p.error("give --model FILE (or --make-models DIR)")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := [e for e in engines if e not in ENGINES]:
        p.error(f"unknown engine(s) {unknown}; choose from {','.join(ENGINES)}")
    if "llama.cpp" in engines and not args.llama_cpp_python:
        p.error("llama.cpp needs --llama-cpp-python PATH (or --engines inflight)")
    pythons = {**dict.fromkeys(QUANTIZATION, sys.executable), "llama.cpp": args.llama_cpp_python}

    lo, hi = (int(x) for x in args.burst_prompt.split(","))
    work = workload(args.seed, args.single_prompt, args.single_tokens, args.burst_requests, (lo, hi),
                    args.burst_tokens)
    longest = max(hi + args.burst_tokens, args.single_prompt + args.single_tokens)
    n_ctx_per_seq = 256 * ((longest + 255) // 256)
    machine = machine_info()
    record: dict[str, Any] = {
        "machine": machine,
        "config": {"threads": args.threads, "single_prompt": args.single_prompt, "single_tokens": args.single_tokens,
                   "burst_requests": args.burst_requests, "burst_prompt": [lo, hi], "burst_tokens": args.burst_tokens,
                   "n_batch": args.n_batch, "n_seq_max": args.burst_requests, "n_ctx_per_seq": n_ctx_per_seq,
                   "kv_cache_dtype": args.kv_cache_dtype, "seed": args.seed,
                   "burst_prompt_tokens": sum(len(r["prompt_token_ids"]) for r in work["burst"])},
        "runs": [],
    }
    print(f"{machine['cpu']}, {machine['num_cpus']} CPUs, flags "
          f"{' '.join(f for f, on in machine['flags'].items() if on)}; {args.threads} threads", file=sys.stderr)
    tmp = Path(args.work_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    for model in args.model:
        model = str(Path(model).resolve())
        entry: dict[str, Any] = {"model": model, "size_bytes": Path(model).stat().st_size, "results": {}}
        if any(e.startswith("inflight") for e in engines):
            subprocess.run([sys.executable, "-c", _PREPARE, model,
                            *(QUANTIZATION[e] for e in engines if e.startswith("inflight"))], check=True, cwd=REPO)
        work = workload(args.seed, args.single_prompt, args.single_tokens, args.burst_requests, (lo, hi),
                        args.burst_tokens, vocabulary_size(model))
        job = {"model": model, "threads": args.threads, "n_ctx_per_seq": n_ctx_per_seq,
               "n_seq_max": args.burst_requests, "n_batch": args.n_batch, "kv_cache_dtype": args.kv_cache_dtype,
               **work}
        for engine in engines:
            read_s = read_file_once(model)
            print(f"{Path(model).name}: {engine} (file read in {read_s:.1f} s; load average "
                  f"{os.getloadavg()[0]:.2f}) ...", file=sys.stderr)
            try:
                result = run_child(pythons[engine], engine, job, tmp, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(str(exc), file=sys.stderr)
                entry["results"][engine] = {"error": str(exc)[-3000:]}
                continue
            result["distinct_tokens_per_request"] = distinct_tokens(result)
            entry["results"][engine] = result
            print(f"  load {result['load_s']:.1f} s, single {result['single']['decode_tok_s']:.2f} tok/s, "
                  f"burst {result['burst']['tok_s']:.1f} tok/s; other processes took "
                  f"{result['other_processes_cpu_s']:.0f} CPU-s of the {result['child_wall_s']:.0f} s run, "
                  f"the hypervisor {result['stolen_cpu_s']:.0f}",
                  file=sys.stderr)
        ok = {e: r for e, r in entry["results"].items() if "error" not in r}
        if "llama.cpp" in ok:  # each inflight form's greedy tokens against llama.cpp's
            entry["agreement"] = {e: agreement(r, ok["llama.cpp"]) for e, r in ok.items() if e != "llama.cpp"}
        record["runs"].append(entry)
        _save(args.output, record)  # after each file: a later failure keeps the earlier ones
    _save(args.output, record)
    print_table(record)
    print(f"\nwrote {args.output}")
    return 0


def _save(path: str, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1))


def print_table(record: dict[str, Any]) -> None:
    """One row per file and engine; a load time marked m mapped packed weights an earlier load
    kept (`packed_cache`) instead of packing them."""
    cfg = record["config"]
    gb = 1e9
    print(f"\n{record['machine']['cpu']}; {cfg['threads']} threads; single: {cfg['single_prompt']}-token prompt, "
          f"{cfg['single_tokens']} tokens; burst: {cfg['burst_requests']} x ({cfg['burst_prompt'][0]}.."
          f"{cfg['burst_prompt'][1]} prompt, {cfg['burst_tokens']} out)")
    header = (f"{'file':<34} {'engine':<9} {'load s':>7} {'RSS GB':>7} {'anon':>6} {'file':>6} {'peak GB':>8} "
              f"{'end anon':>8} {'1-stream tok/s':>14} {'burst tok/s':>11} {'others CPU-s':>12}")
    print(header)
    print("-" * len(header))
    for entry in record["runs"]:
        name = Path(entry["model"]).name.removesuffix(".gguf")
        for engine, r in entry["results"].items():
            if "error" in r:
                print(f"{name:<34} {engine:<9} failed: {r['error'].splitlines()[0][:60]}")
                continue
            m, end = r["after_load"], r["end"]
            mapped = "m" if r.get("info", {}).get("packed_weights") == "mapped" else " "
            print(f"{name:<34} {engine:<9} {r['load_s']:6.2f}{mapped} {m['VmRSS'] / gb:7.2f} {m['RssAnon'] / gb:6.2f} "
                  f"{m['RssFile'] / gb:6.2f} {end['VmHWM'] / gb:8.2f} {end['RssAnon'] / gb:8.2f} "
                  f"{r['single']['decode_tok_s']:14.2f} {r['burst']['tok_s']:11.1f} "
                  f"{r.get('other_processes_cpu_s', float('nan')):12.0f}")
        for engine, a in entry.get("agreement", {}).items():
            print(f"{'':<34} {engine} and llama.cpp's greedy tokens agree: first token "
                  f"{a['first_token_equal']}/{a['requests']}, all {a['all_equal']}/{a['requests']}, "
                  f"mean common prefix {a['mean_common_prefix']:.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
