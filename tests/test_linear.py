"""The prepacked weight matmuls give what F.linear gives, at any number of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.errors import ModelLoadError
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import Linear, linear_backend


def available(backend: str) -> bool:
    if backend == "inflight":
        kernels = cpu_kernels()
        return kernels is not None and kernels.gemm_panel_width() >= 16
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


def test_backend_choice(monkeypatch):
    assert linear_backend(torch.device("meta"), torch.float32) == "torch"
    assert linear_backend(torch.device("cpu"), torch.bfloat16) == "torch"
    monkeypatch.setenv("INFLIGHT_LINEAR", "torch")
    assert linear_backend(torch.device("cpu"), torch.float32) == "torch"
    monkeypatch.setenv("INFLIGHT_LINEAR", "fastest")
    with pytest.raises(ModelLoadError, match="INFLIGHT_LINEAR"):
        linear_backend(torch.device("cpu"), torch.float32)
