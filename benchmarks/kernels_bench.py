"""The kernel figures of docs/benchmarks.md ("What was done for speed"), each timed in this run:

- every weight matmul of SmolLM2-135M once (30 layers + LM head, distinct weights, so they
  stream from DRAM as in a real step) at 64 and 512 rows, through inflight's packed kernel,
  oneDNN prepacked and F.linear; and at 1-6 rows from GGUF blocks (Q4_1 and Q8_0, as stored in
  the embedded model) against the fp32 panels;
- paged decode attention, 64 requests of 256 tokens and one of 512, ms per layer, over enough
  distinct layer pools (128 MB) that they come from DRAM, beside the rate at which a plain sum
  reads the same blocks in the same order (the bound on attention's memory stream); and the
  64-request case with the pool in 4 KiB pages against 2 MiB ones, alternated; and over an fp32
  pool against the same values in bf16 and fp16 (`--kv-cache-dtype`), alternated, at 64 x 256,
  8 x 2048 and 1 x 4096 tokens (`--kv` for these alone);
- paged prefill attention of one 300-token prompt against scaled_dot_product_attention;
- the memory read rate: a sum over 540 MB of fp32 (the model's weights once), the bound of a
  single-stream decode step.

With `--types`, instead: each GGUF type the matmuls read as stored (`loader.BLOCK_TYPES`), its packed
bytes a weight and the time of two Llama-3.2-1B-shaped layers' matmuls (hidden 2048, FFN 8192,
8 KV heads of 64) at 1 to 256 rows beside fp32 panels of the same shapes, alternated; and for
each quantized type a second row, `+int8 act.`: the same blocks times int8 activations
(`--quantization int8-activations`), its time and the fp32-arithmetic blocks' time / its own;
for BF16 likewise `+bf16 act.` (`--quantization bf16-activations`). `--type KIND`: only those.

With `--residency`, instead: how long one layer's K/V (64 requests of 224 tokens, 22 MB) stays in
the last-level cache: decode attention over it cold (after 256 MB of other reads), right after
reading it once, and after 1 and 3 ms of matmuls on data of their own in between (medians of 11).

With `--greedy-head`, instead: the embedded model's LM head as stored (Q8_0, 49152 x 576) choosing
greedy tokens for 1 to 64 rows of its own final hidden states (the text of the repo's corpus),
through the fp32 head and argmax against the integer screen that sums only the columns it cannot
rule out (`GreedyHead`), alternated, each call after 96 MB of other reads (as a step's body leaves
the cache), with the columns the screen summed a row; then the same for a 32768 x 1024 head of
random blocks of each of seven types at 1, 9 and 64 random rows.

With `--body-rate`, instead: the embedded model's body as Q4_1 blocks (30 layers of random blocks,
as it ships) chained as a step reads it, in registers at 1 to 12 rows (a single stream's plain and
verifying steps) and a dequantized panel at a time at 128, 220 and 370 rows (prompts' prefills), in
GFLOP/s beside the fp32 GEMM peak timed in the same round (the packed kernel at 512 rows, in cache),
and each in-register size's rows past the first at what rate they add (three rounds).

With `--against REV`, instead: the kernels of this checkout beside those of git revision REV
(built from its `cpu_kernels.cpp` under another name), alternated in one process, several rounds:
the model's body matmuls chained at 8, 16, 32, 64 and 512 rows, the same body as Q4_1 blocks at 1,
3, 5, 8, 12 and 16 rows (as a step reads them: in registers or a dequantized panel at a time, each
build's choice) and times int8 activations at 1, 5, 9 and 12 rows, two 1B-shaped layers' fp32
matmuls at 64 rows, the same body as int8 W8A8 at 16, 64 and 512 rows, two 1B-shaped layers of
Q4_K, Q6_K and Q8_0 blocks times int8 activations at 1, 4 and 16 rows (Q8_0 also at 64; each
build packs its own), decode attention of 64 requests of 100-400 tokens, and prefill
attention of one step's 8 prompts of 17-300 tokens and of 5 new tokens after 450, and the token-wise
ops of 30 layers at 64 rows (the norms with the residual add, the rotary with the KV store, SwiGLU).
On a host whose speed drifts, that is how a change to a kernel is measured.

    .venv/bin/python benchmarks/kernels_bench.py [--types [--type KIND ...] | --kv | --residency | --greedy-head
                                                  | --body-rate | --against REV]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from inflight.engine.memory import huge_page_zeros
from inflight.model.gguf_copy import random_blocks
from inflight.model.kernels import CFLAGS, LDFLAGS, cpu_kernels
from inflight.model.linear import INTEGER_BLOCK_TYPES, GreedyHead, Linear, int8_row_scales

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down


def best_of(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _every_matmul(layers: list[list[Linear]], lm_head: Linear, x576: torch.Tensor, x1536: torch.Tensor) -> None:
    for qkv, o, gate_up, down in layers:
        qkv(x576), o(x576), gate_up(x576), down(x1536)
    lm_head(x576)


def matmuls() -> None:
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.02 for k, n in LAYER_SHAPES] for _ in range(30)]
    head = torch.randn(49152, 576) * 0.02
    for backend in ("inflight", "onednn", "torch"):
        layers = [[Linear(w, None, backend) for w in ws] for ws in weights]
        lm_head = Linear(head, None, backend)
        for rows in (64, 512):
            x576, x1536 = torch.randn(rows, 576), torch.randn(rows, 1536)

            step = functools.partial(_every_matmul, layers, lm_head, x576, x1536)
            print(f"every weight matmul once, {rows:>3} rows, {backend:<8}: {1000 * best_of(step):7.1f} ms")


_BLOCK_READER = """
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
// Sums every float of each request's K blocks, then its V blocks, in table order (requests
// taken from a shared counter, as the decode kernel takes them): the memory stream of paged
// decode attention without its arithmetic.
double read_blocks(torch::Tensor k, torch::Tensor v, torch::Tensor tables, torch::Tensor lens, int64_t block_size) {
  const int64_t slot = k.size(1) * k.size(2), batch = tables.size(0), max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::atomic<int64_t> next{0};
  std::vector<double> sums(at::get_num_threads(), 0.0);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t t, int64_t) {
    float acc[16] = {};
    for (int64_t b = next++; b < batch; b = next++)
      for (const float* pool : {k.data_ptr<float>(), v.data_ptr<float>()})
        for (int64_t j = 0; j * block_size < lp[b]; ++j) {
          const float* x = pool + tp[b * max_blocks + j] * block_size * slot;
          // The next block's line at the same offset, as the decode kernel prefetches ahead.
          const float* ahead = (j + 1) * block_size < lp[b] ? pool + tp[b * max_blocks + j + 1] * block_size * slot : x;
          const int64_t n = std::min(block_size, lp[b] - j * block_size) * slot;
          for (int64_t i = 0; i + 16 <= n; i += 16) {
            __builtin_prefetch(ahead + i, 0, 2);  // into L2, as the decode kernel does
#pragma omp simd
            for (int e = 0; e < 16; ++e) acc[e] += x[i + e];
          }
        }
    for (float a : acc) sums[t] += a;
  });
  double total = 0;
  for (double x : sums) total += x;
  return total;
}
"""


@functools.cache
def _block_reader() -> object:
    from torch.utils.cpp_extension import load_inline

    return load_inline("inflight_bench_block_reader", _BLOCK_READER, functions=["read_blocks"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])


def _random_blocks(kind: str, rows: int, cols: int, rng: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF rows of `kind` with sane fp16 scales (`_stored_rows`), and their dequantized fp32 weight."""
    import gguf

    raw = _stored_rows(kind, rows, cols, rng)
    weight = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind]).astype("float32")
    return raw, torch.from_numpy(weight.reshape(rows, cols))


def gguf_block_matmuls() -> None:
    """Every weight matmul once at 1 to 512 rows, from the GGUF blocks (Q4_1 body, Q8_0 LM head,
    as in the embedded model; dequantized in registers up to the build's gguf_blocks_max_rows() rows, a panel
    at a time past it, as `Linear` runs them) and from fp32 panels of the same values."""
    import numpy as np

    rng = np.random.default_rng(0)
    layers, fp32 = [], []
    for _ in range(30):
        for k, n in LAYER_SHAPES:
            raw, weight = _random_blocks("Q4_1", n, k, rng)
            layers.append(Linear(weight, None, "inflight", gguf_blocks=("Q4_1", raw)))
            fp32.append(Linear(weight, None, "inflight"))
    raw, weight = _random_blocks("Q8_0", 49152, 576, rng)
    layers.append(Linear(weight, None, "inflight", gguf_blocks=("Q8_0", raw)))
    fp32.append(Linear(weight, None, "inflight"))

    def run(linears: list[Linear], x: dict[int, torch.Tensor]) -> None:
        for linear in linears:
            linear(x[linear.in_features])

    for rows in (1, 2, 3, 4, 5, 6, 8, 16, 64, 256, 512):
        x = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
        times = _alternated({"blocks": functools.partial(run, layers, x), "fp32": functools.partial(run, fp32, x)},
                            rounds=3)
        blocks_s, fp32_s = min(times["blocks"]), min(times["fp32"])
        print(f"every weight matmul once, {rows:3d} rows: from GGUF blocks {1000 * blocks_s:6.1f} ms, "
              f"fp32 panels {1000 * fp32_s:6.1f} ms ({fp32_s / blocks_s:.2f}x)")


def _stored_rows(kind: str, rows: int, cols: int, rng: object) -> torch.Tensor:
    """Random GGUF rows of `kind` (any of `loader.BLOCK_TYPES`) with sane fp16 scales."""
    return torch.from_numpy(random_blocks(kind, rows, cols, rng))  # type: ignore[arg-type]


def block_types(kinds: list[str] | None = None) -> None:
    """Each stored type's packed size (or `kinds`'), and its matmuls' time against fp32 panels (`--types`)."""
    import numpy as np

    from inflight.model.loader import BLOCK_TYPES

    shapes = BLOCK_SHAPES
    rng = np.random.default_rng(0)
    fp32 = [Linear(torch.randn(n, k) * 0.02, None, "inflight") for _ in range(2) for k, n in shapes]
    numel = sum(linear.in_features * linear.out_features for linear in fp32)
    print(f"two Llama-3.2-1B-shaped layers' matmuls ({numel / 1e6:.0f}M weights), ms at each row count:")
    row_counts = (1, 4, 16, 64, 256)
    print("type   bytes/weight " + " ".join(f"{r:>16d}" for r in row_counts))

    def run(linears: list[Linear], x: dict[int, torch.Tensor]) -> None:
        for linear in linears:
            linear(x[linear.in_features])

    for kind in kinds or BLOCK_TYPES:
        raw = [_stored_rows(kind, n, k, rng) for _ in range(2) for k, n in shapes]
        meta = [torch.empty(n, k, device="meta") for _ in range(2) for k, n in shapes]
        stored = [Linear(w, None, "inflight", gguf_blocks=(kind, r)) for w, r in zip(meta, raw, strict=True)]
        a8 = [Linear(w, None, "inflight", gguf_blocks=(kind, r), int8_activations=kind != "BF16",
                     bf16_activations=kind == "BF16")
              for w, r in zip(meta, raw, strict=True)] if kind in (*INTEGER_BLOCK_TYPES, "BF16") else []
        packed = sum(linear.blocks.numel() for linear in stored if linear.blocks is not None)
        cells, a8_cells = [], []
        for rows in row_counts:
            x = {k: torch.randn(rows, k) for k in {k for k, _ in shapes}}
            fns = {"stored": functools.partial(run, stored, x), "fp32": functools.partial(run, fp32, x)}
            if a8:
                fns["a8"] = functools.partial(run, a8, x)
            times = _alternated(fns, rounds=2)
            ours, theirs = min(times["stored"]), min(times["fp32"])
            cells.append(f"{1000 * ours:6.1f} ({theirs / ours:4.2f}x)")
            if a8:
                a8_cells.append(f"{1000 * min(times['a8']):6.1f} ({ours / min(times['a8']):4.2f}x)")
        print(f"{kind:6s} {packed / numel:12.3f} " + " ".join(f"{c:>16s}" for c in cells))
        if a8_cells:
            label = "  +bf16 act." if kind == "BF16" else "  +int8 act."
            print(f"{label:19s} " + " ".join(f"{c:>16s}" for c in a8_cells))
        del stored, a8
    print("(x: fp32 panels' time / this type's; +int8 act. (+bf16 act.): the type's fp32-arithmetic time / its own "
          "with int8 (bf16) activations; in the same rounds)")
    if "BF16" in (kinds or BLOCK_TYPES):
        dots = cpu_kernels().bf16_dot_products()  # type: ignore[union-attr]
        way = "vdpbf16ps (AVX512_BF16)" if dots else "the fp32 block matmuls (no AVX512_BF16)"
        print(f"(+bf16 act. here: {way})")


def _layers_beyond_cache(batch: int, context: int) -> int:
    """Layer pools enough (128 MB of K/V at least) that they come from DRAM, as in a step."""
    return max(8, 2 ** 27 // (batch * context * KV_HEADS * DIM * 8))


def _alternated(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each function's best-of-3 time in every round, the functions taking turns, in the reverse
    order every other round (whichever ran first in a round was up to 7% slower on Zen 4)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds):
        for name, fn in (reversed(fns.items()) if round_ % 2 else fns.items()):
            times[name].append(best_of(fn))
    return times


def decode_attention(kernels: object, batch: int, context: int) -> None:
    torch.manual_seed(0)
    layers = _layers_beyond_cache(batch, context)
    num_blocks = batch * context // BLOCK + 8
    pools = [(torch.randn(num_blocks * BLOCK, KV_HEADS, DIM), torch.randn(num_blocks * BLOCK, KV_HEADS, DIM))
             for _ in range(layers)]
    tables = torch.randperm(num_blocks)[: batch * context // BLOCK].view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, DIM)

    def run() -> None:
        for k, v in pools:
            kernels.paged_decode_attention(q, k, v, tables, lens, BLOCK, DIM ** -0.5)  # type: ignore[attr-defined]

    seconds = best_of(run) / layers
    nbytes = 2 * batch * context * KV_HEADS * DIM * 4

    def read() -> None:
        for k, v in pools:
            _block_reader().read_blocks(k, v, tables, lens, BLOCK)  # type: ignore[attr-defined]

    line = (f"paged decode attention, {batch} x {context} tokens: {1000 * seconds:.2f} ms per layer, "
            f"{nbytes / seconds / 1e9:.1f} GB/s of K/V")
    if batch >= 2 * torch.get_num_threads():  # the reader gives each thread whole requests
        line += f"; a plain sum reads the same blocks at {nbytes / (best_of(read) / layers) / 1e9:.1f} GB/s"
    print(line)


def _pools_alternated(kernels: object, pools: dict[str, torch.Tensor], batch: int, context: int,
                      num_blocks: int, rounds: int) -> dict[str, list[float]]:
    """Decode attention of `batch` requests of `context` tokens, their blocks drawn at random from
    `num_blocks`, over each pool `[layers, 2, slots, KV, D]` in turn: seconds a layer, each round."""
    tables = torch.randperm(num_blocks)[: batch * context // BLOCK].view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, DIM)

    def run(pool: torch.Tensor) -> None:
        for layer in pool:
            kernels.paged_decode_attention(q, layer[0], layer[1], tables, lens, BLOCK, DIM ** -0.5)  # type: ignore[attr-defined]

    times = _alternated({name: functools.partial(run, pool) for name, pool in pools.items()}, rounds)
    return {name: [t / len(pools[name]) for t in ts] for name, ts in times.items()}


def decode_attention_pages(kernels: object, batch: int = 64, context: int = 256, rounds: int = 4) -> None:
    """The KV pool in 4 KiB pages against 2 MiB ones (the engine's, huge_page_zeros), alternated."""
    torch.manual_seed(0)
    layers = _layers_beyond_cache(batch, context)
    num_blocks = batch * context // BLOCK * 4  # the used blocks scattered over a pool 4x their size
    shape = (layers, 2, num_blocks * BLOCK, KV_HEADS, DIM)
    small = torch.randn(shape)
    huge = huge_page_zeros(*shape, dtype=torch.float32).copy_(small)
    times = _pools_alternated(kernels, {"4 KiB": small, "2 MiB": huge}, batch, context, num_blocks, rounds)
    small_s, huge_s = min(times["4 KiB"]), min(times["2 MiB"])
    wins = sum(b < a for a, b in zip(times["4 KiB"], times["2 MiB"], strict=True))
    print(f"paged decode attention, {batch} x {context} tokens, pool pages: 4 KiB {1000 * small_s:.2f} ms, "
          f"2 MiB {1000 * huge_s:.2f} ms per layer; 2 MiB pages {small_s / huge_s:.2f}x, "
          f"faster in {wins} of {rounds} rounds")


def decode_attention_kv_dtypes(kernels: object, batch: int, context: int, rounds: int = 4) -> None:
    """Decode attention over an fp32 pool and the same values in 16 bits (`--kv-cache-dtype`),
    alternated: ms per layer and the rate at which each reads its pool's bytes."""
    torch.manual_seed(0)
    layers = _layers_beyond_cache(batch, context)
    num_blocks = batch * context // BLOCK + 8
    pools = {"float32": torch.randn(layers, 2, num_blocks * BLOCK, KV_HEADS, DIM)}
    pools |= {name: pools["float32"].to(getattr(torch, name)) for name in ("bfloat16", "float16")}
    times = _pools_alternated(kernels, pools, batch, context, num_blocks, rounds)
    fp32 = min(times["float32"])
    parts = []
    for name, pool in pools.items():
        seconds = min(times[name])
        nbytes = 2 * batch * context * KV_HEADS * DIM * pool.element_size()
        parts.append(f"{name} {1000 * seconds:.2f} ms ({fp32 / seconds:.2f}x, {nbytes / seconds / 1e9:.1f} GB/s)")
    print(f"paged decode attention, {batch} x {context} tokens, KV pool: " + ", ".join(parts))


def decode_attention_residency(kernels: object, batch: int = 64, context: int = 224) -> None:
    """Decode attention over one layer's pool cold, right after a first pass, and after 1 and 3 ms
    of other work (a small matmul whose data stays in L2): what the last-level cache keeps."""
    torch.manual_seed(0)
    num_blocks = batch * context // BLOCK + 8
    k, v = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM), torch.randn(num_blocks * BLOCK, KV_HEADS, DIM)
    tables = torch.randperm(num_blocks)[: batch * context // BLOCK].view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, DIM)
    other, x, w = torch.randn(64_000_000), torch.randn(64, 576), torch.randn(128, 576)

    def attend() -> float:
        start = time.perf_counter()
        kernels.paged_decode_attention(q, k, v, tables, lens, BLOCK, DIM ** -0.5)  # type: ignore[attr-defined]
        return time.perf_counter() - start

    def median_after(gap_s: float | None) -> float:
        times = []
        for _ in range(11):
            other.sum()  # 256 MB read: the pool leaves the caches
            if gap_s is not None:
                attend()
                start = time.perf_counter()
                while time.perf_counter() - start < gap_s:
                    torch.mm(x, w.t())
            times.append(attend())
        return sorted(times)[5]

    cells = [("cold", median_after(None)), ("right after", median_after(0.0)),
             ("after 1 ms", median_after(1e-3)), ("after 3 ms", median_after(3e-3))]
    mb = 2 * batch * context * KV_HEADS * DIM * 4 / 1e6
    print(f"decode attention over one layer's K/V ({batch} x {context} tokens, {mb:.0f} MB): "
          + ", ".join(f"{name} {1000 * s:.2f} ms" for name, s in cells))


def prefill_attention(kernels: object) -> None:
    torch.manual_seed(0)
    length = 300
    num_blocks = 64
    k_cache, v_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM), torch.randn(num_blocks * BLOCK, KV_HEADS, DIM)
    table = torch.randperm(num_blocks)[: -(-length // BLOCK)].view(1, -1)
    q = torch.randn(length, HEADS, DIM)
    one = torch.tensor([length])
    zero = torch.tensor([0])
    ours = best_of(lambda: kernels.paged_prefill_attention(  # type: ignore[attr-defined]
        q, k_cache, v_cache, table, zero, one, zero, BLOCK, DIM ** -0.5), reps=20)
    qh, k, v = (q.transpose(0, 1).unsqueeze(0), torch.randn(1, KV_HEADS, length, DIM),
                torch.randn(1, KV_HEADS, length, DIM))
    sdpa = best_of(lambda: F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True), reps=20)
    flop = 4 * HEADS * DIM * length * length / 2
    print(f"prefill attention, one {length}-token prompt: paged kernel {flop / ours / 1e9:.0f} GFLOP/s, "
          f"SDPA {flop / sdpa / 1e9:.0f} GFLOP/s")


def greedy_head(rounds: int = 6) -> None:
    """The embedded model's head choosing greedy tokens: fp32 logits and argmax against the screen."""
    from inflight import LLM, SamplingParams
    from inflight.bench.corpus import corpus_text

    llm = LLM()
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    screen = model.greedy_head
    if screen is None:
        print("the embedded model's head has no greedy screen here")
        return
    kernels = screen._kernels
    seen: list[torch.Tensor] = []

    def recorded(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.clone())
        return screen(x)

    model.greedy_head = recorded
    text = corpus_text()
    llm.generate([text[i * 2000:i * 2000 + 1500] for i in range(8)], SamplingParams(max_tokens=16, temperature=0))
    model.greedy_head = screen
    hidden = torch.cat(seen)[-64:].contiguous()
    other = torch.randn(24_000_000)  # 96 MB

    def cold(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            other.sum()
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return run

    def compare(head: Linear, greedy: GreedyHead, rows_of: Callable[[int], torch.Tensor],
                counts: tuple[int, ...]) -> list[str]:
        cells = []
        for rows in counts:
            x = rows_of(rows)
            fns = {"fp32 head + argmax": cold(lambda x=x: kernels.argmax_rows(head(x))),
                   "screen": cold(lambda x=x: greedy(x))}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for round_ in range(rounds):
                for name, fn in (reversed(fns.items()) if round_ % 2 else fns.items()):
                    times[name].append(min(float(fn()) for _ in range(3)))  # type: ignore[arg-type]
            assert torch.equal(greedy(x), kernels.argmax_rows(head(x)))
            _, computed = kernels.gguf_blocks_greedy(x, head.blocks, greedy.table, head.out_features)
            fp32, ours = min(times["fp32 head + argmax"]), min(times["screen"])
            cells.append(f"{rows} rows {1000 * fp32:.2f} / {1000 * ours:.2f} ms ({fp32 / ours:.2f}x; "
                         f"columns summed in fp32 a row: median {int(computed.median())}, most {int(computed.max())})")
        return cells

    print(f"LM head {model.lm_head.out_features} x {model.lm_head.in_features} (Q8_0 blocks), greedy tokens on its "
          "own hidden states, each call after 96 MB of other reads: fp32 head + argmax / screen")
    for cell in compare(model.lm_head, screen, lambda rows: hidden[:rows].contiguous(), (1, 4, 9, 16, 64)):
        print("  " + cell)
    import numpy as np

    print("a head of 32768 x 1024 random blocks of each type, random rows, the same:")
    rng = np.random.default_rng(0)
    for kind in ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q5_0", "Q4_0", "IQ4_XS"):
        head = Linear(torch.empty(32768, 1024, device="meta"), None, "inflight",
                      gguf_blocks=(kind, _stored_rows(kind, 32768, 1024, rng)))
        greedy = GreedyHead.of(head)
        assert greedy is not None
        print(f"  {kind:6s} " + "; ".join(compare(head, greedy, lambda rows: torch.randn(rows, 1024), (1, 9, 64))))


def _chain_blocks(m: object, ws: list[tuple[torch.Tensor, int, int]], x: dict[int, torch.Tensor]) -> None:
    """A body's block matmuls chained as a step reads them: in registers up to the build's
    gguf_blocks_max_rows() (5 in builds before it said), a dequantized panel at a time past it."""
    in_registers = len(x[576]) <= (m.gguf_blocks_max_rows() if hasattr(m, "gguf_blocks_max_rows") else 5)
    matmul = m.gguf_blocks_linear if in_registers else m.gguf_blocks_gemm  # type: ignore[attr-defined]
    for w, k, n in ws:
        matmul(x[k], w, n)


def body_rate(rounds: int = 3) -> None:
    """The embedded model's body as Q4_1 blocks at the rows of a single stream's steps and of its
    prompts' prefills, against the fp32 GEMM peak timed in the same round."""
    import numpy as np

    kernels = cpu_kernels()
    rng = np.random.default_rng(0)
    body = [(kernels.pack_gguf_blocks([_stored_rows("Q4_1", n, k, rng)], ["Q4_1"], k), k, n)  # type: ignore[union-attr]
            for _ in range(30) for k, n in LAYER_SHAPES]
    row_flop = 2 * 30 * sum(k * n for k, n in LAYER_SHAPES)
    in_registers = kernels.gguf_blocks_max_rows()  # type: ignore[union-attr]
    x_peak, w_peak = torch.randn(512, 576), kernels.pack_linear_weight(torch.randn(3072, 576))  # type: ignore[union-attr]

    def peak() -> None:
        for _ in range(10):
            kernels.packed_linear(x_peak, w_peak, None, 3072)  # type: ignore[union-attr]

    for _ in range(rounds):
        peak_gflops = 10 * 2 * 512 * 576 * 3072 / best_of(peak) / 1e9
        seconds = {rows: best_of(functools.partial(_chain_blocks, kernels, body,
                                                   {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}))
                   for rows in (1, 2, 5, 8, 9, 12, 128, 220, 370)}
        print(f"fp32 GEMM peak {peak_gflops:.0f} GFLOP/s; body as Q4_1 blocks: " + ", ".join(
            f"{rows} rows {1000 * s:.1f} ms = {rows * row_flop / s / 1e9:.0f} GFLOP/s "
            f"({rows * row_flop / s / 1e9 / peak_gflops:.2f} of the peak"
            + (f", rows past the first {(rows - 1) * row_flop / (s - seconds[1]) / 1e9:.0f}"
               if 1 < rows <= in_registers else "") + ")"
            for rows, s in seconds.items()))


def memory_read() -> None:
    data = torch.randn(135_000_000)  # 540 MB
    seconds = best_of(data.sum, reps=5)
    print(f"memory read, sum of 540 MB: {540e6 / seconds / 1e9:.1f} GB/s")


def _kernels_of(rev: str) -> object:
    """The CPU kernels as of git revision `rev`, built under a name of their own."""
    from torch.utils.cpp_extension import load

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{rev}:inflight/model/csrc/cpu_kernels.cpp"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=root, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(tempfile.mkdtemp()) / f"cpu_kernels_{sha}.cpp"
    path.write_text(source)
    return load(f"inflight_bench_kernels_{sha}", [str(path)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS)


def _scattered_tables(lengths: list[int]) -> tuple[torch.Tensor, int]:
    """Block tables for contexts of these lengths, the blocks at random places in a pool: the
    tables `[len(lengths), max blocks]` and the pool's size in blocks."""
    counts = [-(-n // BLOCK) for n in lengths]
    order = torch.randperm(sum(counts))
    tables = torch.zeros(len(lengths), max(counts), dtype=torch.int64)
    for row, (first, count) in enumerate(zip(itertools.accumulate([0, *counts]), counts, strict=False)):
        tables[row, :count] = order[first:first + count]
    return tables, sum(counts)


# Two Llama-3.2-1B-shaped layers' matmuls, (K, N): q/k/v fused, o, gate/up fused, down.
BLOCK_SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]


def _int8_inverse_scales(m: object, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(127 / max|w| per row, max|w| / 127), as `Linear` quantizes a weight (`int8_row_scales`)."""
    scales, inv = int8_row_scales(m.row_absmax(w))  # type: ignore[attr-defined]
    return inv, scales


def compare(rev: str, rounds: int = 4) -> None:
    """This checkout's kernels against `rev`'s, alternated; best of 3 per round."""
    mods = {"this checkout": cpu_kernels(), rev: _kernels_of(rev)}
    torch.manual_seed(0)
    raw = [[torch.randn(n, k) * 0.02 for k, n in LAYER_SHAPES] for _ in range(30)]
    packed = {name: [[m.pack_linear_weight(w) for w in ws] for ws in raw] for name, m in mods.items()}  # type: ignore[attr-defined]
    cases: list[tuple[str, dict[str, Callable[[], object]]]] = []
    for rows in (8, 16, 32, 64, 512):
        x = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}

        def chain(m: object, ws: list[list[torch.Tensor]], x: dict[int, torch.Tensor] = x) -> None:
            for layer in ws:
                for (k, n), w in zip(LAYER_SHAPES, layer, strict=True):
                    m.packed_linear(x[k], w, None, n)  # type: ignore[attr-defined]

        cases.append((f"body matmuls chained, {rows} rows",
                      {name: functools.partial(chain, m, packed[name]) for name, m in mods.items()}))
    # The embedded model's body as Q4_1 blocks (as it ships), as a step reads them: in registers up
    # to each build's gguf_blocks_max_rows() (5 before it said), a dequantized panel at a time past it.
    import numpy as np

    rng = np.random.default_rng(0)
    q4 = [(_stored_rows("Q4_1", n, k, rng), k, n) for _ in range(30) for k, n in LAYER_SHAPES]
    q4_packed = {name: [(m.pack_gguf_blocks([raw], ["Q4_1"], k), k, n) for raw, k, n in q4]  # type: ignore[attr-defined]
                 for name, m in mods.items()}
    for rows in (1, 3, 5, 8, 9, 12, 13, 16):
        x = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
        cases.append((f"body as Q4_1 blocks, {rows} rows",
                      {name: functools.partial(_chain_blocks, m, q4_packed[name], x) for name, m in mods.items()}))
    # The same body times int8 activations (`--quantization int8-activations`), at the sizes of a
    # single stream's step and of its speculative verifies (k + 1 rows).
    q4_a8 = {name: [(m.pack_gguf_blocks([raw], ["Q4_1"], k, True), k, n) for raw, k, n in q4]  # type: ignore[attr-defined]
             for name, m in mods.items()}
    for rows in (1, 5, 9, 12):
        x = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}

        def chain_q4_a8(m: object, ws: list[tuple[torch.Tensor, int, int]], x: dict[int, torch.Tensor] = x) -> None:
            for w, k, n in ws:
                m.gguf_blocks_a8_linear(x[k], w, n)  # type: ignore[attr-defined]

        cases.append((f"body as Q4_1 blocks x int8 activations, {rows} rows",
                      {name: functools.partial(chain_q4_a8, m, q4_a8[name]) for name, m in mods.items()}))
    # fp32 panels of two 1B-shaped layers (K = 2048 and 8192: rows a multiple of 4 KB apart).
    big = [torch.randn(n, k) * 0.02 for k, n in BLOCK_SHAPES for _ in range(2)]
    big_packed = {name: [(m.pack_linear_weight(w), w.shape[1], w.shape[0]) for w in big]  # type: ignore[attr-defined]
                  for name, m in mods.items()}
    del big
    x_big = {k: torch.randn(64, k) for k, _ in BLOCK_SHAPES}

    def chain_big(m: object, ws: list[tuple[torch.Tensor, int, int]]) -> None:
        for w, k, n in ws:
            m.packed_linear(x_big[k], w, None, n)  # type: ignore[attr-defined]

    cases.append(("1B-shaped fp32 matmuls (K 2048, 8192), 64 rows",
                  {name: functools.partial(chain_big, m, big_packed[name]) for name, m in mods.items()}))
    # int8 W8A8 (`--quantization int8`): the same body, its weights quantized by each build.
    int8 = {name: [[m.quantize_pack_int8(w, *_int8_inverse_scales(m, w)) for w in ws] for ws in raw]  # type: ignore[attr-defined]
            for name, m in mods.items()}
    for rows in (16, 64, 512):
        x = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}

        def chain8(m: object, ws: list[list[torch.Tensor]], x: dict[int, torch.Tensor] = x) -> None:
            for layer in ws:
                for (k, n), w in zip(LAYER_SHAPES, layer, strict=True):
                    m.int8_linear(x[k], w, n)  # type: ignore[attr-defined]

        cases.append((f"body int8 W8A8 matmuls chained, {rows} rows",
                      {name: functools.partial(chain8, m, int8[name]) for name, m in mods.items()}))
    # Q4_K, Q6_K and Q8_0 blocks times int8 activations (`--quantization int8-activations`), two
    # 1B-shaped layers each.
    for kind in ("Q4_K", "Q6_K", "Q8_0"):
        rows_of = [(_stored_rows(kind, n, k, rng), k, n) for _ in range(2) for k, n in BLOCK_SHAPES]
        a8 = {name: [(m.pack_gguf_blocks([raw], [kind], k, True), k, n)  # type: ignore[attr-defined]
                     for raw, k, n in rows_of] for name, m in mods.items()}
        for rows in (1, 4, 16, 64) if kind == "Q8_0" else (1, 4, 16):  # Q8_0's: biased past 8 rows
            x = {k: torch.randn(rows, k) for k in {k for k, _ in BLOCK_SHAPES}}

            def chain_a8(m: object, ws: list[tuple[torch.Tensor, int, int]], x: dict[int, torch.Tensor] = x) -> None:
                for w, k, n in ws:
                    m.gguf_blocks_a8_linear(x[k], w, n)  # type: ignore[attr-defined]

            cases.append((f"{kind} blocks x int8 activations, two 1B-shaped layers, {rows} rows",
                          {name: functools.partial(chain_a8, m, a8[name]) for name, m in mods.items()}))
    lens = torch.randint(100, 401, (64,), dtype=torch.int64)
    tables, blocks = _scattered_tables(lens.tolist())
    pools = [(torch.randn(blocks * BLOCK, KV_HEADS, DIM), torch.randn(blocks * BLOCK, KV_HEADS, DIM)) for _ in range(8)]
    q = torch.randn(64, HEADS, DIM)

    def decode(m: object) -> None:
        for k, v in pools:
            m.paged_decode_attention(q, k, v, tables, lens, BLOCK, DIM ** -0.5)  # type: ignore[attr-defined]

    cases.append(("decode attention, 64 requests of 100-400 tokens, 8 layers",
                  {name: functools.partial(decode, m) for name, m in mods.items()}))
    prompts = [300, 17, 150, 64, 233, 99, 280, 41]
    ptables, blocks = _scattered_tables(prompts)
    k_cache, v_cache = torch.randn(blocks * BLOCK, KV_HEADS, DIM), torch.randn(blocks * BLOCK, KV_HEADS, DIM)
    pq = torch.randn(sum(prompts), HEADS, DIM)
    starts = torch.tensor([0, *torch.tensor(prompts).cumsum(0)[:-1].tolist()])
    qlens, zeros = torch.tensor(prompts), torch.zeros(len(prompts), dtype=torch.int64)

    def prefill(m: object) -> None:
        m.paged_prefill_attention(pq, k_cache, v_cache, ptables, starts, qlens, zeros, BLOCK,  # type: ignore[attr-defined]
                                  DIM ** -0.5)

    cases.append(("prefill attention, 8 prompts of 17-300 tokens",
                  {name: functools.partial(prefill, m) for name, m in mods.items()}))
    # A few-token chunk after a long context (a draft model's catch-up with its request, a
    # prompt's last short chunk): 5 new tokens after 450 cached ones, one request, the embedded
    # model's 30 layers (one work item a KV head: fewer than the threads want). Not a speculative
    # verify: the engine verifies proposed tokens as decodes, one a token.
    vtables, vblocks = _scattered_tables([455])
    vk, vv = torch.randn(vblocks * BLOCK, KV_HEADS, DIM), torch.randn(vblocks * BLOCK, KV_HEADS, DIM)
    vq = torch.randn(5, HEADS, DIM)
    v_starts, v_lens, v_ctx = torch.tensor([0]), torch.tensor([5]), torch.tensor([450])

    def short_chunk(m: object) -> None:
        for _ in range(30):
            m.paged_prefill_attention(vq, vk, vv, vtables, v_starts, v_lens, v_ctx, BLOCK,  # type: ignore[attr-defined]
                                      DIM ** -0.5)

    cases.append(("prefill attention, 5 new tokens after 450, 30 layers",
                  {name: functools.partial(short_chunk, m) for name, m in mods.items()}))
    # The token-wise ops of the embedded model's 30 layers at a 64-request decode step: the two norms
    # with the residual add, the rotary with the KV store, SwiGLU's gate.
    hidden, delta, scale = torch.randn(64, 576), torch.randn(64, 576), torch.randn(576)
    qkv_rows, gate_up = torch.randn(64, (HEADS + 2 * KV_HEADS) * DIM), torch.randn(64, 3072)
    positions, slots = torch.randint(0, 400, (64,)), torch.randperm(64 * 400)[:64]
    angles = torch.outer(torch.arange(400.0), 1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    op_pool = (torch.zeros(64 * 400, KV_HEADS, DIM), torch.zeros(64 * 400, KV_HEADS, DIM))

    def token_ops(m: object) -> None:
        for _ in range(30):
            m.add_rms_norm_(hidden, delta, scale, 1e-5)  # type: ignore[attr-defined]
            m.rotary_qk_(qkv_rows, positions, cos, sin, HEADS, KV_HEADS, DIM, *op_pool, slots)  # type: ignore[attr-defined]
            m.add_rms_norm_(hidden, delta, scale, 1e-5)  # type: ignore[attr-defined]
            m.silu_and_mul(gate_up)  # type: ignore[attr-defined]
        hidden.copy_(delta)  # (the residual stream kept finite round after round)

    cases.append(("token ops (norms, rotary + KV store, SwiGLU), 64 rows, 30 layers",
                  {name: functools.partial(token_ops, m) for name, m in mods.items()}))
    for title, fns in cases:
        times = _alternated(fns, rounds)
        line = ", ".join(f"{name} {1000 * min(t):.2f} ms" for name, t in times.items())
        ours, theirs = min(times["this checkout"]), min(times[rev])
        wins = sum(a < b for a, b in zip(times["this checkout"], times[rev], strict=True))
        print(f"{title}: {line}; this checkout {theirs / ours:.2f}x, faster in {wins} of {rounds} rounds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REV", help="compare with the kernels of this git revision")
    parser.add_argument("--types", action="store_true", help="each stored GGUF type against fp32 panels")
    parser.add_argument("--type", action="append", metavar="KIND", help="with --types: only this type (repeatable)")
    parser.add_argument("--kv", action="store_true", help="decode attention over fp32 and 16-bit KV pools only")
    parser.add_argument("--residency", action="store_true",
                        help="how long one layer's K/V stays in the last-level cache, only")
    parser.add_argument("--body-rate", action="store_true",
                        help="the embedded model's body as Q4_1 blocks, GFLOP/s at a step's rows against the GEMM peak")
    parser.add_argument("--greedy-head", action="store_true",
                        help="the embedded model's LM head: fp32 logits and argmax against the greedy screen, only")
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        print("inflight's CPU kernels are unavailable here (no compiler?)")
        return 1
    print(f"{torch.get_num_threads()} threads")
    if args.against:
        with torch.inference_mode():
            compare(args.against)
        return 0
    if args.types:
        with torch.inference_mode():
            block_types(args.type)
        return 0
    if args.residency:
        with torch.inference_mode():
            decode_attention_residency(kernels)
        return 0
    if args.body_rate:
        with torch.inference_mode():
            body_rate()
        return 0
    if args.greedy_head:
        with torch.inference_mode():
            greedy_head()
        return 0
    if args.kv:
        with torch.inference_mode():
            for batch, context in ((64, 256), (8, 2048), (1, 4096)):
                decode_attention_kv_dtypes(kernels, batch, context)
        return 0
    with torch.inference_mode():
        matmuls()
        if kernels.gguf_blocks_available():  # type: ignore[attr-defined]
            gguf_block_matmuls()
        decode_attention(kernels, 64, 256)
        decode_attention(kernels, 1, 512)  # a single stream: its context split between the threads
        decode_attention_pages(kernels)
        for batch, context in ((64, 256), (8, 2048), (1, 4096)):
            decode_attention_kv_dtypes(kernels, batch, context)
        prefill_attention(kernels)
    memory_read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
