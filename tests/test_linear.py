"""The prepacked weight matmuls give what F.linear gives, at any number of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.errors import ModelLoadError
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import Linear, blocks_usable, linear_backend, pack_gguf_blocks
from inflight.model.loader import PACKED_BYTES


def available(backend: str) -> bool:
    if backend == "inflight":
        return cpu_kernels() is not None
    return backend == "torch" or torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("backend", ["inflight", "onednn"])
@pytest.mark.parametrize("rows", [0, 1, 3, 14, 15, 64, 300])
@pytest.mark.parametrize("out_features,with_bias", [(96, False), (100, True), (5, True)])
def test_prepacked_linear_matches_f_linear(backend, rows, out_features, with_bias):
    if not available(backend):
        pytest.skip(f"{backend} not available here")
    torch.manual_seed(rows)
    weight = torch.randn(out_features, 81)  # odd K; N not a multiple of a panel
    bias = torch.randn(out_features) if with_bias else None
    packed = Linear(weight, bias, backend)
    x = torch.randn(rows, 162)[:, ::2]  # a strided view, as a split of a fused output can be
    with torch.inference_mode():
        out = packed(x)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_inflight_kernel_rows_do_not_depend_on_the_batch():
    """A row's result is a plain in-order sum: the same alone as beside 63 other rows."""
    if not available("inflight"):
        pytest.skip("inflight kernel not available here")
    torch.manual_seed(0)
    packed = Linear(torch.randn(64, 576), None, "inflight")
    x = torch.randn(64, 576)
    with torch.inference_mode():
        together = packed(x)
        for i in (0, 13, 63):
            assert torch.equal(packed(x[i:i + 1]), together[i:i + 1])


@pytest.mark.parametrize("out_features", [5, 1000])  # fewer panels than threads; many chunks
def test_inflight_kernel_results_do_not_depend_on_the_threads(out_features):
    """Threads share the panels out dynamically (one may take chunks of another's range), so which
    thread computes an output changes from call to call; the output may not."""
    if not available("inflight"):
        pytest.skip("inflight kernel not available here")
    torch.manual_seed(out_features)
    weight, bias = torch.randn(out_features, 200), torch.randn(out_features)
    packed = Linear(weight, bias, "inflight")
    x = torch.randn(150, 200)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            alone = packed(x)
            for n in (2, 3, 4):
                torch.set_num_threads(n)
                for _ in range(3):
                    assert torch.equal(packed(x), alone)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


# Where each type keeps its fp16 scales in a block (bytes), and the magnitude that keeps the
# weights near 0.1 once a K-quant's sub-block scales (up to 63, 127, 32 or 15) multiply in. IQ1_M
# keeps its d in the top nibbles of its four scale words at 48, MXFP4 a power of two's exponent in
# its first byte (random_blocks sets them).
SCALE_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
            "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82], "IQ4_NL": [0], "IQ4_XS": [0],
            "IQ1_S": [0], "IQ1_M": [], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
            "TQ1_0": [52], "TQ2_0": [64], "MXFP4": []}
BLOCK_KINDS = [*SCALE_AT, "F16", "BF16"]


def super_block(kind: str) -> int:
    """The weights of one of `kind`'s blocks as stored (256: a K-quant's or IQ4_XS's super-block)."""
    import gguf

    return 32 if kind in ("F16", "BF16") else gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]


def random_blocks(kind: str, rows: int, cols: int, seed: int,
                  d_range: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF rows of `kind` (uint8 [rows, cols / block weights * block bytes]) and their
    dequantized weight, as gguf computes it; `d_range`: the blocks' fp16 scales' range."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind in ("F16", "BF16"):
        values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        if kind == "F16":
            raw = values.astype(np.float16).view(np.uint8)
        else:  # bf16: the top half of each fp32
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        weight = raw.view(np.float16).astype(np.float32) if kind == "F16" else \
            (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(raw.copy()), torch.from_numpy(weight.copy())
    qtype = gguf.GGMLQuantizationType[kind]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    shape = (rows, cols // block_weights)
    blocks = rng.integers(0, 256, size=(*shape, block_bytes), dtype=np.uint8)  # quants and sub-block scales
    low, high = d_range or ((0.0001, 0.005) if block_weights == 256 else (0.001, 0.1))  # 256: a super-block
    for at in SCALE_AT[kind]:  # d, and the minimum or dmin
        sign = -1 if at == 2 and kind in ("Q4_1", "Q5_1") else 1  # a minimum below zero
        scale = (sign * rng.uniform(low, high, size=shape)).astype(np.float16)
        blocks[..., at:at + 2] = scale[..., None].view(np.uint8)
    if kind == "IQ1_M":  # d's 16 bits, a nibble in the top of each scale word
        d = rng.uniform(low, high, size=shape).astype(np.float16).view(np.uint16)
        words = blocks[..., 48:56].copy().view(np.uint16)
        for j in range(4):
            words[..., j] = (words[..., j] & 0x0FFF) | (((d >> (4 * j)) & 0x0F) << 12).astype(np.uint16)
        blocks[..., 48:56] = words.view(np.uint8)
    if kind == "MXFP4":  # E8M0: the scale 2^(e - 128) of values up to 12, within the range's powers of two
        blocks[..., 0] = rng.integers(int(np.log2(low)) + 128, int(np.log2(high)) + 128, size=shape, endpoint=True)
    raw = blocks.reshape(rows, -1)
    weight = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    return torch.from_numpy(raw.copy()), torch.from_numpy(weight.reshape(rows, cols))


@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("out_features,in_features,with_bias", [(96, 96, False), (37, 256, True), (64, 512, False)])
def test_gguf_block_matmul_equals_the_fp32_one_bit_for_bit(kind, out_features, in_features, with_bias):
    """A weight kept as GGUF blocks keeps no fp32 form; every step reads the blocks (in registers
    up to the build's gguf_blocks_max_rows() rows, a panel at a time past it), and its results are exactly
    those of the fp32 panels of gguf-py's dequantization, at every row count, whether the
    model's fp32 weight or only its shape (meta) was given."""
    kernels = cpu_kernels()
    if not available("inflight"):
        pytest.skip("inflight kernel not available here")
    if in_features % super_block(kind):
        pytest.skip("K-quant and IQ4_XS rows are made of 256-weight super-blocks")
    blocks, weight = random_blocks(kind, out_features, in_features, seed=out_features)
    bias = torch.randn(out_features) if with_bias else None
    fp32_only = Linear(weight, bias, "inflight")
    if not kernels.gguf_blocks_available():  # the portable build: every step reads the fp32 panels
        assert not blocks_usable()
        assert Linear(weight, bias, "inflight", gguf_blocks=(kind, blocks)).blocks is None
        with pytest.raises(RuntimeError, match="needs AVX2"):
            pack_gguf_blocks(kernels, [blocks], [kind], in_features)
        with pytest.raises(RuntimeError, match="needs AVX2"):
            kernels.gguf_blocks_dequantize(torch.zeros(64, dtype=torch.uint8))
        with pytest.raises(ModelLoadError, match="cannot read them"):
            Linear(weight.to("meta"), bias, "inflight", gguf_blocks=(kind, blocks))
        return
    both = Linear(weight, bias, "inflight", gguf_blocks=(kind, blocks))
    shape_only = Linear(weight.to("meta"), bias, "inflight", gguf_blocks=(kind, blocks))
    assert both.blocks is not None and both.weight.numel() == 0  # no fp32 panels kept
    # the size the memory estimate counts: a 64-byte header, then whole panels of 16 rows
    assert both.blocks.numel() == 64 + -(-out_features // 16) * 16 * in_features * PACKED_BYTES[kind]
    # A fused matrix packed from its parts where they lie: the packing of their rows joined.
    assert torch.equal(pack_gguf_blocks(kernels, [blocks[:10], blocks[10:]], [kind] * 2, in_features), both.blocks)
    assert torch.equal(kernels.gguf_blocks_dequantize(both.blocks), weight)  # the values it stands for
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(in_features))
    with torch.inference_mode():
        for rows in (1, 2, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 64, 300):  # past each build's passes and its switch
            expected = fp32_only(x[:rows])
            assert torch.equal(both(x[:rows]), expected), rows
            assert torch.equal(shape_only(x[:rows]), expected), rows
        # Each kernel over any number of rows: the register one in passes (of up to 5, or 12), the panel one whole.
        assert kernels.gguf_blocks_linear(x[:0], both.blocks, out_features).shape == (0, out_features)  # no rows
        for rows in (3, 8, 12, 13, 23):
            expected = kernels.packed_linear(x[:rows], fp32_only.weight, None, out_features)
            assert torch.equal(kernels.gguf_blocks_linear(x[:rows], both.blocks, out_features), expected)
            assert torch.equal(kernels.gguf_blocks_gemm(x[:rows], both.blocks, out_features), expected)
        # and close to torch's (another order of the sums: Q6_K's weights reach 20, its outputs hundreds)
        torch.testing.assert_close(both(x[:1]), F.linear(x[:1], weight, bias), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(both(x[:64]), F.linear(x[:64], weight, bias), atol=1e-4, rtol=1e-4)
    with pytest.raises(ModelLoadError, match="cannot read them"):  # a path without the block kernels
        Linear(weight.to("meta"), bias, "torch", gguf_blocks=(kind, blocks))


def test_block_scales_are_kept_in_fp16_and_a_q4_0_scale_beyond_it_is_refused():
    """The packing keeps each block's scales as the file's fp16; Q4_0's m = -8 d, the one scale
    not read from the file, has an fp16 form up to |d| = 8188 (exact there, every weight the
    dequantized one) and none past it: refused with a message, never rounded."""
    import numpy as np

    kernels = cpu_kernels()
    if not available("inflight") or not kernels.gguf_blocks_available():
        pytest.skip("the GGUF block kernels are not built here")
    blocks, _ = random_blocks("Q4_0", 16, 64, seed=3)
    for d, fits in ((8188.0, True), (-8000.0, True), (8192.0, False), (-10000.0, False)):
        raw = blocks.numpy().copy()
        raw[0, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        row = torch.from_numpy(raw)
        if fits:
            import gguf

            weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).astype(np.float32))
            assert torch.equal(kernels.gguf_blocks_dequantize(kernels.pack_gguf_blocks([row], ["Q4_0"], 64)), weight)
        else:
            with pytest.raises(RuntimeError, match="no exact fp16 form"):
                kernels.pack_gguf_blocks([row], ["Q4_0"], 64)
            with pytest.raises(ModelLoadError, match="no exact fp16 form"):  # as the loader meets it: one line
                Linear(torch.empty(16, 64, device="meta"), None, "inflight", gguf_blocks=("Q4_0", row))


@pytest.mark.parametrize("kind", ["IQ2_XXS", "TQ2_0"])
def test_a_grid_block_without_an_exact_int8_form_is_refused(kind):
    """The grid and ternary types are decoded into int8 values times exact fp32 scales; a block
    whose weights are not such (an inf or NaN scale) is refused at load in one line, never rounded."""
    import numpy as np

    kernels = cpu_kernels()
    if not available("inflight") or not kernels.gguf_blocks_available():
        pytest.skip("the GGUF block kernels are not built here")
    blocks, weight = random_blocks(kind, 16, 512, seed=5)
    packed = pack_gguf_blocks(kernels, [blocks], [kind], 512)
    assert torch.equal(kernels.gguf_blocks_dequantize(packed), weight)
    start = blocks.shape[1] // 2 + SCALE_AT[kind][0]  # row 3's second super-block's d: block number 7
    for bad in (np.inf, np.nan):
        raw = blocks.numpy().copy()
        raw[3, start:start + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)
        with pytest.raises(ModelLoadError, match=f"a {kind} block \\(number 7\\) has no exact int8 form"):
            Linear(torch.empty(16, 512, device="meta"), None, "inflight", gguf_blocks=(kind, torch.from_numpy(raw)))


def test_an_mxfp4_scale_without_an_fp16_form_is_refused_and_a_block_of_zeros_takes_any():
    """MXFP4's d is a power of two, 2^(e - 128), kept in fp16 beside its 4-bit indices (the IQ4_NL
    layout's size): exact from 2^-24 to 2^15. A block whose values are all zero needs no scale and
    takes any e; a nonzero block outside that range is refused at load in one line, never rounded."""
    import numpy as np

    kernels = cpu_kernels()
    if not available("inflight") or not kernels.gguf_blocks_available():
        pytest.skip("the GGUF block kernels are not built here")
    blocks, _ = random_blocks("MXFP4", 16, 512, seed=7)
    raw = blocks.numpy().reshape(16, 16, 17).copy()
    raw[2, 5, 0], raw[2, 5, 1:] = 0, np.array([0x80, 0x08] * 8, np.uint8)  # zeros (indices 0 and 8), e = 0
    raw[9, 1, 0], raw[9, 1, 1:] = 255, 0  # zeros at the largest scale
    raw = torch.from_numpy(raw.reshape(16, -1))
    import gguf

    weight = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(16, 512))
    assert not weight[2, 160:192].any() and not weight[9, 32:64].any()
    packed = pack_gguf_blocks(kernels, [raw], ["MXFP4"], 512)
    assert torch.equal(kernels.gguf_blocks_dequantize(packed), weight)
    for e, power in ((103, -25), (144, 16)):
        bad = raw.clone()
        bad[4, 3 * 17] = e
        with pytest.raises(ModelLoadError, match=f"an MXFP4 block scale of 2\\^{power} has no exact fp16 form"):
            Linear(torch.empty(16, 512, device="meta"), None, "inflight", gguf_blocks=("MXFP4", bad))


def test_a_fused_matrix_of_mixed_block_types_reads_each_part_in_its_own_layout():
    """A Q4_K_M file's fused q/k/v (Q4_K q and k beside a Q6_K v), or any mix whose parts meet at
    whole panels of 16 rows, is packed one run of columns per layout, and computes the fp32
    result of the parts' dequantized rows joined, bit for bit; parts of different layouts that
    do not meet at a panel's edge are refused, as is a weight the packing did not make."""
    kernels = cpu_kernels()
    if not available("inflight") or not kernels.gguf_blocks_available():
        pytest.skip("the GGUF block kernels are not built here")
    kinds = ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "BF16", "Q5_K"]  # Q4_0 and Q4_1 share a layout: one run of 32 rows
    rows_of = [24, 8, 16, 16, 16, 21]
    made = [random_blocks(kind, rows, 256, seed=i) for i, (kind, rows) in enumerate(zip(kinds, rows_of, strict=True))]
    weight = torch.cat([w for _, w in made])
    fused = Linear(weight.to("meta"), None, "inflight", gguf_blocks=(kinds, [b for b, _ in made]))
    fp32 = Linear(weight, None, "inflight")
    x = torch.randn(300, 256)
    with torch.inference_mode():
        for rows in (1, 4, 5, 6, 16, 64, 300):
            assert torch.equal(fused(x[:rows]), fp32(x[:rows])), rows
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):  # 21 rows, then another layout
        kernels.pack_gguf_blocks([made[5][0], made[3][0]], ["Q5_K", "Q6_K"], 256)
    with pytest.raises(RuntimeError, match="not packed by pack_gguf_blocks"):
        kernels.gguf_blocks_linear(x[:1], torch.zeros(640, dtype=torch.uint8), 16)


def test_backend_choice(monkeypatch):
    assert linear_backend(torch.device("meta"), torch.float32) == "torch"
    assert linear_backend(torch.device("cpu"), torch.bfloat16) == "torch"
    monkeypatch.delenv("INFLIGHT_LINEAR", raising=False)
    kernels = cpu_kernels()
    if kernels is not None:
        # AVX2 or AVX-512 builds come first; the portable one yields to oneDNN unless named.
        wide = kernels.gemm_panel_width() >= 16
        auto = "inflight" if wide else "onednn" if torch.backends.mkldnn.is_available() else "torch"
        assert linear_backend(torch.device("cpu"), torch.float32) == auto
        monkeypatch.setenv("INFLIGHT_LINEAR", "inflight")
        assert linear_backend(torch.device("cpu"), torch.float32) == "inflight"
    monkeypatch.setenv("INFLIGHT_LINEAR", "torch")
    assert linear_backend(torch.device("cpu"), torch.float32) == "torch"
    monkeypatch.setenv("INFLIGHT_LINEAR", "fastest")
    with pytest.raises(ModelLoadError, match="INFLIGHT_LINEAR"):
        linear_backend(torch.device("cpu"), torch.float32)
