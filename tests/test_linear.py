"""The prepacked weight matmuls give what F.linear gives, at any number of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.errors import ModelLoadError
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import Linear, blocks_usable, linear_backend


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


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF rows of `kind` (uint8 [rows, cols / 32 * block bytes]) and their dequantized
    weight, as gguf computes it."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    block_weights, block_bytes = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
                                  "Q4_K": (256, 144)}[kind]
    shape = (rows, cols // block_weights)
    blocks = rng.integers(0, 256, size=(*shape, block_bytes), dtype=np.uint8)  # quants and Q4_K's 6-bit scales
    low, high = (0.0001, 0.005) if kind == "Q4_K" else (0.001, 0.1)  # Q4_K's d and dmin are multiplied by <= 63
    blocks[..., 0:2] = rng.uniform(low, high, size=shape).astype(np.float16)[..., None].view(np.uint8)
    if kind == "Q4_1":  # the minimum
        blocks[..., 2:4] = rng.uniform(-0.5, 0.1, size=shape).astype(np.float16)[..., None].view(np.uint8)
    if kind == "Q4_K":  # dmin
        blocks[..., 2:4] = rng.uniform(low, high, size=shape).astype(np.float16)[..., None].view(np.uint8)
    raw = blocks.reshape(rows, -1)
    weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    return torch.from_numpy(raw.copy()), torch.from_numpy(weight.reshape(rows, cols))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("out_features,in_features,with_bias", [(96, 96, False), (37, 256, True), (64, 512, False)])
def test_gguf_block_matmul_equals_the_fp32_one_bit_for_bit(kind, out_features, in_features, with_bias):
    """A weight kept as GGUF blocks keeps no fp32 form; every step reads the blocks (in registers
    up to GGUF_BLOCKS_MAX_ROWS rows, a panel at a time past it), and its results are exactly
    those of the fp32 panels of gguf-py's dequantization, at every row count, whether the
    model's fp32 weight or only its shape (meta) was given."""
    kernels = cpu_kernels()
    if not available("inflight"):
        pytest.skip("inflight kernel not available here")
    if kind == "Q4_K" and in_features % 256:
        pytest.skip("K-quant rows are made of 256-weight super-blocks")
    blocks, weight = random_blocks(kind, out_features, in_features, seed=out_features)
    bias = torch.randn(out_features) if with_bias else None
    fp32_only = Linear(weight, bias, "inflight")
    if not kernels.gguf_blocks_available():  # the portable build: every step reads the fp32 panels
        assert not blocks_usable()
        assert Linear(weight, bias, "inflight", gguf_blocks=(kind, blocks)).blocks is None
        with pytest.raises(RuntimeError, match="needs AVX2"):
            kernels.pack_gguf_blocks([blocks], in_features, kind)
        with pytest.raises(ModelLoadError, match="cannot read them"):
            Linear(weight.to("meta"), bias, "inflight", gguf_blocks=(kind, blocks))
        return
    both = Linear(weight, bias, "inflight", gguf_blocks=(kind, blocks))
    shape_only = Linear(weight.to("meta"), bias, "inflight", gguf_blocks=(kind, blocks))
    assert both.blocks is not None and both.weight.numel() == 0  # no fp32 panels kept
    # A fused matrix packed from its parts where they lie: the packing of their rows joined.
    assert torch.equal(kernels.pack_gguf_blocks([blocks[:10], blocks[10:]], in_features, kind), both.blocks)
    x = torch.randn(300, in_features)
    with torch.inference_mode():
        for rows in (1, 2, 4, 5, 6, 7, 16, 64, 300):
            expected = fp32_only(x[:rows])
            assert torch.equal(both(x[:rows]), expected), rows
            assert torch.equal(shape_only(x[:rows]), expected), rows
        # Each kernel over any number of rows: the register one in passes of 5, the panel one whole.
        for rows in (3, 8, 23):
            expected = kernels.packed_linear(x[:rows], fp32_only.weight, None, out_features)
            assert torch.equal(kernels.gguf_blocks_linear(x[:rows], both.blocks, out_features), expected)
            assert torch.equal(kernels.gguf_blocks_gemm(x[:rows], both.blocks, out_features), expected)
        torch.testing.assert_close(both(x[:1]), F.linear(x[:1], weight, bias), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(both(x[:64]), F.linear(x[:64], weight, bias), atol=1e-4, rtol=1e-5)
    with pytest.raises(ModelLoadError, match="cannot read them"):  # a path without the block kernels
        Linear(weight.to("meta"), bias, "torch", gguf_blocks=(kind, blocks))


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
