"""GGUF's grid and ternary quants as int8 blocks: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, TQ1_0 and TQ2_0, for the block matmuls (`csrc`: the I8K16 layout).

These types store 1.56 to 3.44 bits a weight as indices into codebooks (grids of 4 or 8 values),
signs and a 3- or 4-bit scale per 16 or 32 weights (TQ: ternary digits, one scale per 256). Every
weight they stand for is a small integer times its sub-block's scale: w = d * s * v / 8, with d the
super-block's fp16 scale, s an odd integer of at most 31 and |v| at most 124 (IQ2's grid values
times their signs, IQ3_XXS's doubled, IQ3_S's and the ternary types' times 8, IQ1's 8 g +- 1 for
its grid value g and its delta of 1/8). Each such product is exact in fp32, as gguf-py's
dequantization computes it, so (d / 8, s, v) in fp32, int8 and int8 holds every weight bit for bit.
The values come from gguf-py's own dequantization (its grids, not a copy of them) divided by the
scales read here; a block whose quotients are not integers of int8's range is refused, never
rounded. Kept so, a weight takes 1.08 bytes (the int8 layout's size) instead of fp32's 4: an 8B
model of these types fits in about 9 GB.

Decoding runs once per load, on one thread (gguf-py's numpy: docs/models.md gives its time); for a
file of 512 MiB or more `packed_cache` keeps the packing for the next load.
"""

from __future__ import annotations

import numpy as np
import torch

from inflight.errors import ModelLoadError

# The types decoded here, and the form the kernels read: per 256 weights the fp32 D = d / 8, 16
# int8 sub-block scales s and 256 int8 values v (w = D * s * v), `csrc`'s I8K16 (276 bytes).
GRID_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")
INT8_KIND = "I8K16"
_SUPER = 256
_SUBS = 16
_CHUNK = 1 << 10  # super-blocks decoded at a time (256K weights: 1 MB of fp32, in cache)


def _u16(blocks: np.ndarray, at: int, count: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2 * count]).view(np.uint16)


def _u32(blocks: np.ndarray, at: int, count: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 4 * count]).view(np.uint32)


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(scales: np.ndarray) -> np.ndarray:
    """Bytes of two 4-bit scales each (low nibble first) -> the scales in order."""
    return np.stack([scales & 0x0F, scales >> 4], axis=-1).reshape(len(scales), -1)


def _d_and_scales(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each super-block's d (fp32, from its fp16) and its 16 sub-blocks' odd integer scales s, such
    that every weight of sub-block j is d * s[j] / 8 times an integer (see the module's text)."""
    d = _fp16(blocks, 0)
    if kind in ("IQ2_XXS", "IQ3_XXS"):  # 4-bit ls in the top of a uint32 per 32 weights
        ls = (_u32(blocks, 2, 16)[:, 1::2] if kind == "IQ2_XXS" else _u32(blocks, 66, 8)) >> 28
    elif kind in ("IQ2_XS", "IQ2_S"):  # 4-bit ls per 16 weights, low nibble first
        at = 66 if kind == "IQ2_XS" else 74
        ls = _nibbles(blocks[:, at:at + 8])
    elif kind == "IQ3_S":  # 4-bit ls per 32 weights, low nibble first
        ls = _nibbles(blocks[:, 106:110])
    elif kind == "IQ1_S":  # 3-bit ls in bits 12-14 of qh, per 32 weights
        ls = (_u16(blocks, 34, 8) >> 12) & 7
    elif kind == "IQ1_M":  # d in the top nibbles of the four scale words; 3-bit ls per 16 weights
        words = _u16(blocks, 48, 4)
        bits = (words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0xF0) | ((words[:, 2] >> 4) & 0xF00) | (words[:, 3] & 0xF000)
        d = bits.astype(np.uint16).view(np.float16).astype(np.float32)
        ls = ((words[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(len(blocks), -1)
    elif kind in ("TQ1_0", "TQ2_0"):  # d * t, t in {-1, 0, 1} (TQ2_0's 2 bits also allow 2): s = 1
        d = _fp16(blocks, 52 if kind == "TQ1_0" else 64)
        ls = np.zeros((len(blocks), _SUBS), np.int32)
    else:
        raise ValueError(f"not a grid or ternary type: {kind}")
    s = 2 * ls.astype(np.int32) + 1  # every type's scale is 2 ls + 1 (IQ2's (0.5 + ls) / 4 times 8, ...)
    return d, s if s.shape[1] == _SUBS else np.repeat(s, _SUBS // s.shape[1], axis=1)  # per 32: each half alike


def int8_blocks(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows of `kind` (uint8 [rows, K / 256 * block bytes]) -> the same weights as I8K16
    rows (uint8 [rows, K / 256 * 276]), each value exactly gguf-py's; ModelLoadError for a block
    that has no such form (a scale of inf or NaN)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert block_weights == _SUPER
    rows = raw.shape[0]
    blocks = raw.numpy().reshape(-1, block_bytes)
    out = np.empty((len(blocks), 4 + _SUBS + _SUPER), np.uint8)

    for first in range(0, len(blocks), _CHUNK):
        part = blocks[first:first + _CHUNK]
        d, scales = _d_and_scales(kind, part)
        big_d = d * np.float32(0.125)
        factor = (big_d[:, None] * scales.astype(np.float32))[:, :, None]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            weights = gguf.quants.dequantize(part, qtype).reshape(len(part), _SUBS, _SUPER // _SUBS)
            # Out of int8's range, or not finite, the cast gives some other integer: the check catches it.
            values = np.rint(weights / factor).astype(np.int8)
            values[factor[..., 0] == 0] = 0
            exact = values.astype(np.float32) * factor == weights  # an integer quotient, and exactly so
        if not exact.all():
            at = first + int(np.argwhere(~exact.all(axis=(1, 2)))[0, 0])
            raise ModelLoadError(f"a {kind} block (number {at}) has no exact int8 form (its scale is {d[at - first]})")
        out[first:first + len(part), 0:4] = big_d.view(np.uint8).reshape(-1, 4)
        out[first:first + len(part), 4:4 + _SUBS] = scales.astype(np.int8).view(np.uint8)
        out[first:first + len(part), 4 + _SUBS:] = values.view(np.uint8).reshape(len(part), -1)
    return torch.from_numpy(out.reshape(rows, -1))
