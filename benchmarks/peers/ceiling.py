"""The ceiling: the workload's arithmetic divided by an fp32 GEMM timed in the same run.

The GEMM is timed through MKL (`torch.mm`), oneDNN (a prepacked weight) and inflight's own
packed kernel, and the peak is the best rate of any of them at any shape: on AMD processors MKL
runs well below what the cores can do, and a ceiling taken from it alone would flatter every
engine; one taken from a library slower than ours would flatter inflight.

FLOPs count the weight matmuls only, 2 per parameter per token: every non-embedding weight for
each token that passes through the model (prompt tokens, and every generated token but the last,
which is never fed back), plus the LM head once per generated token. Attention's own
QK^T and PV products are counted apart (`attention_flop`) and left out of the ceiling, as in the
issue's reference figure; they add about 5% on the burst64 workload.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from peer_protocol import PeerRequest

from inflight.model.kernels import cpu_kernels

GEMM_SHAPES = {  # (m, k, n): m tokens through a k x n weight
    "square_2048": (2048, 2048, 2048),
    "prefill_512x576x1536": (512, 576, 1536),
    "decode_64x576x1536": (64, 576, 1536),
}


def _timed(fn: Any, flop: float, reps: int) -> float:
    """Best-of-`reps` seconds of one call of `fn`, timing batches of ~2 GFLOP."""
    fn()  # warm-up
    inner = max(1, int(2e9 // flop))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def time_gemm(m: int, k: int, n: int, reps: int) -> dict[str, float]:
    """`m x k` activations through a `k x n` weight, by MKL and (where built in) oneDNN."""
    flop = 2 * m * k * n
    a, b = torch.randn(m, k), torch.randn(k, n)
    result = {"m": m, "k": k, "n": n}
    result["mkl_s"] = _timed(lambda: torch.mm(a, b), flop, reps)
    best = result["mkl_s"]
    if torch.backends.mkldnn.is_available():
        weight = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
        result["onednn_s"] = _timed(
            lambda: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], ""), flop, reps)
        best = min(best, result["onednn_s"])
    kernels = cpu_kernels()
    if kernels is not None:
        packed = kernels.pack_linear_weight(b.t().contiguous())
        result["inflight_s"] = _timed(lambda: kernels.packed_linear(a, packed, None, n), flop, reps)
        best = min(best, result["inflight_s"])
    result["best_s"] = best
    result["gflops"] = flop / best / 1e9
    return result


def measure_gemm(reps: int) -> dict[str, Any]:
    """Best-of-`reps` fp32 GEMM rates; the peak is the best of the shapes and implementations."""
    with torch.inference_mode():
        shapes = {name: time_gemm(*shape, reps) for name, shape in GEMM_SHAPES.items()}
    return {"threads": torch.get_num_threads(), "shapes": shapes,
            "peak_gflops": max(s["gflops"] for s in shapes.values())}


def workload_flop(config: Any, requests: list[PeerRequest]) -> dict[str, float]:
    """`config` is inflight's ModelConfig (read from the GGUF)."""
    h, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * config.intermediate_size
    body_params = config.num_layers * per_layer
    head_params = h * config.vocab_size
    fed = sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in requests)
    generated = sum(r.max_tokens for r in requests)
    # Token at position p attends to p + 1 keys: QK^T and PV, 2 FLOP per multiply-add each.
    positions = sum(
        (len(r.prompt_token_ids) + r.max_tokens - 1) * (len(r.prompt_token_ids) + r.max_tokens) // 2
        for r in requests
    )
    linear = 2 * body_params * fed
    lm_head = 2 * head_params * generated
    return {
        "body_params": body_params,
        "lm_head_params": head_params,
        "tokens_fed": fed,
        "tokens_generated": generated,
        "linear_flop": linear,
        "lm_head_flop": lm_head,
        "attention_flop": 4 * config.num_layers * q_dim * positions,
        "total_flop": linear + lm_head,
    }


def ceiling(flop: dict[str, float], peak_gflops: float, last_arrival_s: float) -> dict[str, float]:
    """The fastest the workload could go at the GEMM peak; a trickle of arrivals (mixed) cannot
    finish before its last request arrives, so that bounds it too."""
    compute_s = flop["total_flop"] / (peak_gflops * 1e9)
    wall_s = max(compute_s, last_arrival_s)
    return {"compute_s": compute_s, "wall_s": wall_s, "tok_s": flop["tokens_generated"] / wall_s}


def int8_peak(reps: int) -> float:
    """GOP/s (2 per multiply-add) of inflight's int8 matmul's inner instructions (`vpdpbusd`, or
    AVX2's `vpmaddubsw` sequence) on every intra-op thread, from registers: best of `reps`. 0
    where the kernels (or their int8 branch's instructions) are not there."""
    from inflight.model.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        return 0.0
    return max(2 * kernels.int8_peak_macs(500_000) for _ in range(reps)) / 1e9


def int8_ceiling(flop: dict[str, float], int8_gops: float, last_arrival_s: float) -> dict[str, float]:
    """As `ceiling` for an engine whose weight matmuls, the LM head's too, are int8 (at
    `int8_gops`)."""
    compute_s = flop["total_flop"] / (int8_gops * 1e9)
    wall_s = max(compute_s, last_arrival_s)
    return {"compute_s": compute_s, "wall_s": wall_s, "tok_s": flop["tokens_generated"] / wall_s}
