"""Weight matmuls `y = x @ W.T (+ b)` with the weight laid out once, at load, for the GEMM library.

On CPU in fp32, `F.linear` goes to MKL's sgemm, which repacks the weight on every call; at the
few rows of a decode step that packing costs as much as the multiply, and on AMD processors MKL
also skips its AVX-512 kernels. oneDNN (bundled with PyTorch as MKL-DNN) takes a weight
reordered ahead of time into its blocked layout and picks a kernel for the machine's ISA:
measured here (2 Zen 5 cores), a 64-row decode step's weight matmuls run 2.3x faster and a
512-row prefill step's 1.9x. INFLIGHT_ONEDNN_LINEAR=0 turns it off (plain `F.linear`); other
devices and dtypes always take `F.linear`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on this device and dtype are prepacked for oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and os.environ.get("INFLIGHT_ONEDNN_LINEAR", "1") != "0"
    )


class Linear:
    """One weight matmul. With `prepack`, the weight is kept only in oneDNN's layout."""

    __slots__ = ("bias", "in_features", "out_features", "weight", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._packed = prepack
        # The reorder's batch-size hint only tunes the layout; any number of rows works.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if prepack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._packed:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
