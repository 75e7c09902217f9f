"""GGUF's grid and ternary quants as int8 blocks: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, TQ1_0 and TQ2_0, for the block matmuls (`csrc`: the I8K16 layout).

These types store 1.56 to 3.44 bits a weight as indices into codebooks (grids of 4 or 8 values),
signs and a 3- or 4-bit scale per 16 or 32 weights (TQ: ternary digits, one scale per 256). Every
weight they stand for is a small integer times its sub-block's scale: w = d * s * v / 8, with d the
super-block's fp16 scale, s an odd integer of at most 31 and |v| at most 124 (IQ2's grid values
times their signs, IQ3_XXS's doubled, IQ3_S's and the ternary types' times 8, IQ1's 8 g +- 1 for
its grid value g and its delta of 1/8). Each such product is exact in fp32, as gguf-py's
dequantization computes it, so (d / 8, s, v) in fp32, int8 and int8 holds every weight bit for bit.
The kernels' `grid_int8_blocks` reads the blocks (llama.cpp's formats) into that form, over
gguf-py's own codebooks and sign table, passed in (not a copy of them); a block whose d is not
finite (its weights inf or NaN) is refused. Kept so, a weight takes 1.08 bytes (the int8 layout's
size) instead of fp32's 4: an 8B model of these types fits in about 9 GB. `tests/test_linear.py`
holds every type's decoded weights equal to gguf-py's dequantization.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from inflight.errors import ModelLoadError

# The types decoded here, and the form the kernels read: per 256 weights the fp32 D = d / 8, 16
# int8 sub-block scales s and 256 int8 values v (w = D * s * v), `csrc`'s I8K16 (276 bytes).
GRID_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")
INT8_KIND = "I8K16"


def _codebook(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py's codebook of `kind` as int8 [entries, width] (empty for the ternary types) and its
    128 sign bytes (IQ2_XXS's, which IQ2_XS and IQ3_XXS share)."""
    import gguf

    signs = torch.frombuffer(bytearray(gguf.quants.IQ2_XXS.ksigns), dtype=torch.uint8)
    if kind.startswith("TQ"):
        return torch.zeros(0, 0, dtype=torch.int8), signs
    cls = getattr(gguf.quants, kind)
    cls.init_grid()
    grid = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    values = np.rint(grid).astype(np.int8)
    if not np.array_equal(values.astype(np.float32), grid):  # a gguf-py whose grids are not integers
        raise ModelLoadError(f"gguf's {kind} codebook holds values that are not small integers")
    return torch.from_numpy(values), signs


_codebooks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def int8_blocks(kind: str, raw: torch.Tensor, kernels: ModuleType) -> torch.Tensor:
    """GGUF rows of `kind` (uint8 [rows, K / 256 * block bytes]) -> the same weights as I8K16
    rows (uint8 [rows, K / 256 * 276]), each value exactly gguf-py's; ModelLoadError for a block
    whose scale is inf or NaN."""
    import gguf

    if kind not in GRID_TYPES:
        raise ValueError(f"not a grid or ternary type: {kind}")
    if kind not in _codebooks:
        _codebooks[kind] = _codebook(kind)
    grid, signs = _codebooks[kind]
    rows = raw.shape[0]
    blocks = raw.contiguous().reshape(-1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1])
    # numpy's malloc, not torch's aligned allocation: a load decodes and frees one such buffer a
    # matrix, and glibc's aligned blocks left the heap fragmented (a 1B model's load held 0.5 GB
    # more after it, 0.6 GB higher at its peak).
    out = torch.from_numpy(np.empty((len(blocks), 4 + 16 + 256), np.uint8))
    bad = kernels.grid_int8_blocks(kind, blocks, grid, signs, out)
    if bad >= 0:
        scale = float(out[bad, :4].contiguous().view(torch.float32)[0] * 8)
        raise ModelLoadError(f"a {kind} block (number {bad}) has no exact int8 form (its scale is {scale})")
    return out.reshape(rows, -1)
