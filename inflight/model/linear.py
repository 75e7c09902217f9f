"""Weight matmuls `y = x @ W.T (+ b)` with the weight laid out once, at load, for the kernel.

On CPU in fp32, `F.linear` goes to MKL's sgemm, which repacks the weight on every call; at the
few rows of a decode step that packing costs as much as the multiply, and on AMD processors MKL
also leaves out its AVX-512 kernels. Two prepacked paths replace it:

- `inflight`: our own kernel (`csrc/cpu_kernels.cpp`, `packed_linear`): panels of 32 columns
  streamed from memory with the next one prefetched, so that at decode sizes, where the weights
  come from DRAM, the stream overlaps the arithmetic. Used where it was compiled for AVX2 or
  AVX-512 (its portable build only when asked for by name).
- `onednn`: the weight reordered for oneDNN (bundled with PyTorch as MKL-DNN).

Measured here by `benchmarks/kernels_bench.py` (2 Zen 5 cores, every weight of SmolLM2 once, as
a decode step reads them): 64 rows take 38 ms with `inflight`, 45 ms with `onednn`, 109 ms with
`F.linear`; a 512-row prefill is within a few percent between the two prepacked paths.
`INFLIGHT_LINEAR=inflight|onednn|torch` forces one (default `auto`: the first available in that
order). Other devices and dtypes always take `F.linear`.

A decode step of a few requests is memory-bound: it streams every weight from DRAM once.
Where the checkpoint stores a matrix as GGUF blocks (`loader.BLOCK_TYPES`) or 16-bit values,
`inflight` keeps only those (`Linear`), repacked once into panels of about the same size. Steps
of a few rows dequantize them in registers; larger ones one panel at a time into cache, for the
fp32 microkernel. Both give exactly the fp32 values the loader would have made of them, and the
same sums: bit for bit the result of the fp32 panels.

`--quantization int8-activations` (`int8_activations`) trades that equality for speed, as
llama.cpp does: the quantized blocks stay integers and each step's activations are quantized
per row and 32 inputs, so every sub-block is an exact integer dot product, scaled after
(`csrc`: gguf_blocks_a8_linear states the arithmetic). `--quantization bf16-activations` does the
same for matrices stored in bf16: each step's activations are rounded to bf16 and multiplied
by pairs with AVX512_BF16's `vdpbf16ps` where the CPU has it (`csrc`: gguf_blocks_bf16_linear).
`--quantization int8` instead quantizes any checkpoint's matmul weights (the decoder's and the
LM head) to int8 per output channel (W8A8).

`GreedyHead` gives greedy rows their tokens from a head kept as quantized blocks without its fp32
logits, the fp32 head's argmax exactly (an integer screen, then the fp32 sums of a few columns).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

import torch
import torch.nn.functional as F

from inflight.errors import ModelLoadError
from inflight.model.grid_quants import GRID_TYPES, INT8_KIND, int8_blocks
from inflight.model.kernels import cpu_kernels

BACKENDS = ("inflight", "onednn", "torch")


def linear_backend(device: torch.device, dtype: torch.dtype) -> str:
    """Which implementation the weight matmuls on this device and dtype use."""
    choice = os.environ.get("INFLIGHT_LINEAR", "auto")
    if choice not in (*BACKENDS, "auto"):
        raise ModelLoadError(f"INFLIGHT_LINEAR={choice!r}: expected auto, {', '.join(BACKENDS)}")
    if device.type != "cpu" or dtype != torch.float32 or choice == "torch":
        return "torch"
    kernels = cpu_kernels()
    ours = kernels is not None
    # Built without AVX2, our kernel's 8-column panels lose to oneDNN: asked for by name only.
    ours_first = kernels is not None and kernels.gemm_panel_width() >= 16
    onednn = torch.backends.mkldnn.is_available()
    if choice == "auto":
        return "inflight" if ours_first else "onednn" if onednn else "torch"
    if (choice == "inflight" and not ours) or (choice == "onednn" and not onednn):
        raise ModelLoadError(f"INFLIGHT_LINEAR={choice}: not available on this machine")
    return choice


def blocks_usable() -> bool:
    """Whether fp32 matmuls on CPU read GGUF blocks (the `inflight` backend, built with AVX2):
    then the loader leaves the weights stored in `loader.BLOCK_TYPES` in their blocks."""
    kernels = cpu_kernels()
    return (linear_backend(torch.device("cpu"), torch.float32) == "inflight" and kernels is not None
            and kernels.gguf_blocks_available())


def keeps_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model loaded in `dtype` on `device` keeps its stored matrices as stored (and
    so packs them, `packed_cache` keeps them): fp32 on a CPU whose kernels read blocks."""
    return dtype == torch.float32 and device.type == "cpu" and blocks_usable()


def int8_row_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's max |w|: (scale = max / 127, inv = 127 / max, 0 for an all-zero row)."""
    return amax / 127, torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q in [-127, 127], scale) with weight ~ q * scale[:, None],
    q = round(w * inv) (half to even, as the activations' are); an all-zero row gets scale 0 and
    zeros. The reference of the kernels' one-pass `quantize_pack_int8`, which `Linear` uses."""
    scale, inv = int8_row_scales(weight.float().abs().amax(dim=1))
    q = torch.round(weight.float() * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


# GGUF types the block matmuls read as integers (all but the 16-bit ones).
INTEGER_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                       "IQ4_NL", "IQ4_XS", "MXFP4", *GRID_TYPES)


def pack_gguf_blocks(kernels: ModuleType, parts: list[torch.Tensor], kinds: list[str], k: int,
                     int8_activations: bool = False, bf16_activations: bool = False) -> torch.Tensor:
    """The kernels' packing of a matrix's parts (GGUF rows of `kinds`, `loader.BLOCK_TYPES`), the
    grid and ternary types' first decoded into int8 blocks (`grid_quants`)."""
    decoded = [int8_blocks(kind, part, kernels) if kind in GRID_TYPES else part
               for kind, part in zip(kinds, parts, strict=True)]
    return kernels.pack_gguf_blocks([p.contiguous() for p in decoded],
                                    [INT8_KIND if kind in GRID_TYPES else kind for kind in kinds], k,
                                    int8_activations, bf16_activations)


def check_bf16_activations(blocks: Mapping[str, tuple[str, object]], kept: bool) -> None:
    """`--quantization bf16-activations` needs the block kernels and a checkpoint with matrices
    stored in bf16; refused in one line otherwise, never ignored."""
    if not kept:
        raise ModelLoadError("--quantization bf16-activations runs on inflight's CPU block kernels in fp32 "
                             "(a CPU with AVX2, --dtype float32)")
    if not any(kind == "BF16" for kind, _ in blocks.values()):
        raise ModelLoadError("--quantization bf16-activations multiplies matrices stored in bf16 (safetensors or "
                             "GGUF BF16); this checkpoint stores none")


def check_int8_activations(blocks: Mapping[str, tuple[str, object]], kept: bool) -> None:
    """`--quantization int8-activations` needs the block kernels and a checkpoint with quantized
    blocks (`load_blocks`' result); refused in one line otherwise, never ignored."""
    if not kept:
        raise ModelLoadError("--quantization int8-activations runs on inflight's CPU block kernels in fp32 "
                             "(a CPU with AVX2, --dtype float32)")
    if not any(kind in INTEGER_BLOCK_TYPES for kind, _ in blocks.values()):
        raise ModelLoadError("--quantization int8-activations multiplies a GGUF file's quantized blocks "
                             f"({', '.join(INTEGER_BLOCK_TYPES)}); this checkpoint stores none "
                             "(--quantization int8 quantizes any weights)")


class Linear:
    """One weight matmul; with a prepacked backend the weight is kept only in its packed form.

    With `gguf_blocks` (the weight's raw GGUF blocks and their type (`loader.BLOCK_TYPES`), one tensor of
    rows or the parts of a fused matrix, of which `weight` is the dequantized form, or only its
    shape: a meta tensor) and the `inflight` backend, every step reads those blocks and no fp32
    form is kept: the same values and the same sums as the fp32 panels, bit for bit, from far
    fewer bytes."""

    __slots__ = ("backend", "bias", "in_features", "out_features", "weight", "blocks", "_kernels")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "torch",
                 gguf_blocks: tuple[str | list[str], torch.Tensor | list[torch.Tensor]] | None = None,
                 int8: bool = False, int8_activations: bool = False, bf16_activations: bool = False,
                 packed: torch.Tensor | None = None) -> None:
        """`packed`: this matrix's packing as an earlier load of the same file by the same build
        made it (`packed_cache`), in place of packing `gguf_blocks` or quantizing again."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.backend = backend
        self._kernels: ModuleType | None = None
        self.blocks: torch.Tensor | None = None
        if weight.is_meta and not (backend == "inflight" and gguf_blocks is not None and blocks_usable()):
            raise ModelLoadError("a weight was left in its GGUF blocks on a path that cannot read them")
        if packed is not None and backend == "inflight":
            self._kernels = cpu_kernels()
            self.blocks = packed
            self.weight = torch.empty(0)
        elif int8:
            if backend != "inflight":
                raise ModelLoadError("quantization int8 runs on inflight's CPU kernels in fp32 (a CPU with AVX2, "
                                     "--dtype float32)")
            self._kernels = cpu_kernels()
            assert self._kernels is not None
            if gguf_blocks is not None and weight.is_meta:  # from its blocks, widened a panel of rows at a time
                weight = self._pack_blocks(gguf_blocks)
            else:
                weight = weight.float().contiguous()
            scales, inv = int8_row_scales(self._kernels.row_absmax(weight))
            self.blocks = self._kernels.quantize_pack_int8(weight, inv, scales)  # quantize_int8, packed
            self.weight = torch.empty(0)
        elif backend == "inflight":
            self._kernels = cpu_kernels()
            assert self._kernels is not None
            if gguf_blocks is not None and self._kernels.gguf_blocks_available():
                self.blocks = self._pack_blocks(gguf_blocks, int8_activations, bf16_activations)
                self.weight = torch.empty(0)  # every step reads the blocks
            else:
                self.weight = self._kernels.pack_linear_weight(weight.contiguous())
        elif backend == "onednn":
            # The reorder's batch-size hint only tunes the layout; any number of rows works.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight

    def _pack_blocks(self, gguf_blocks: tuple[str | list[str], torch.Tensor | list[torch.Tensor]],
                     int8_activations: bool = False, bf16_activations: bool = False) -> torch.Tensor:
        assert self._kernels is not None
        kinds, raw = gguf_blocks  # one tensor of rows, or the parts of a fused matrix (a type each)
        parts = [raw] if isinstance(raw, torch.Tensor) else raw
        kinds = [kinds] * len(parts) if isinstance(kinds, str) else list(kinds)
        try:
            return pack_gguf_blocks(self._kernels, parts, kinds, self.in_features, int8_activations, bf16_activations)
        except RuntimeError as err:  # blocks the packing cannot hold (a Q4_0 scale past fp16's range)
            raise ModelLoadError(str(err).splitlines()[0]) from None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None:  # the kernel chooses blocks or panels, as DecoderStack's layers do
            return self._kernels.linear_forward(x.contiguous(), self.weight, self.blocks, self.bias, self.out_features)
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class GreedyHead:
    """The greedy rows of an LM head kept as quantized GGUF blocks: each row's argmax of `head(x)`,
    exactly (the fp32 head's own argmax, bit for bit), without its fp32 logits. An integer screen
    (int8 activations against the blocks, llama.cpp's dot products) bounds how far each logit can
    lie from its fp32 value, and only the few columns that can still be the largest are summed in
    fp32 (`csrc`: gguf_blocks_greedy states the bound). The embedded model's head (Q8_0, 49152
    columns) on a 9-row speculative verify: 1.8 ms against 2.7 (`kernels_bench.py --greedy-head`,
    2 Zen 4 cores).
    INFLIGHT_GREEDY_SCREEN=0 turns it off (the fp32 head and argmax then choose)."""

    __slots__ = ("head", "table", "_kernels")

    def __init__(self, head: Linear, kernels: ModuleType) -> None:
        self.head = head
        self._kernels = kernels
        self.table = kernels.gguf_blocks_screen_table(head.blocks)  # K / 32 floats a column

    @staticmethod
    def of(head: Linear) -> GreedyHead | None:
        """The screen of a head whose packing it reads (quantized GGUF blocks, fp32 activations,
        no bias), else None."""
        kernels = cpu_kernels()
        if (os.environ.get("INFLIGHT_GREEDY_SCREEN", "1") == "0" or kernels is None or head.blocks is None
                or head.bias is not None or not kernels.gguf_blocks_screenable(head.blocks)):
            return None
        return GreedyHead(head, kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The argmax of each row of `head(x)` (int64)."""
        tokens, _ = self._kernels.gguf_blocks_greedy(x.contiguous(), self.head.blocks, self.table,
                                                     self.head.out_features)
        return tokens

