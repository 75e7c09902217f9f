"""The prepacked oneDNN weight matmul gives what F.linear gives, at any number of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.model.linear import Linear, onednn_linear_available


@pytest.mark.skipif(not onednn_linear_available(torch.device("cpu"), torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("rows", [0, 1, 3, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_linear_matches_f_linear(rows, with_bias):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80)
    bias = torch.randn(96) if with_bias else None
    packed = Linear(weight, bias, prepack=True)
    x = torch.randn(rows, 160)[:, ::2]  # a strided view, as a split of a fused output can be
    with torch.inference_mode():
        out = packed(x)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_linear_is_off_for_other_devices_and_dtypes(monkeypatch):
    assert not onednn_linear_available(torch.device("meta"), torch.float32)
    assert not onednn_linear_available(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("INFLIGHT_ONEDNN_LINEAR", "0")
    assert not onednn_linear_available(torch.device("cpu"), torch.float32)
