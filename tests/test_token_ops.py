"""The compiled CPU token-wise ops give what the plain PyTorch ops give."""

from __future__ import annotations

import pytest
import torch

from inflight.model.kernels import cpu_kernels
from inflight.model.token_ops import CpuKernelTokenOps, KVStore, TorchTokenOps

HEADS, KV_HEADS, DIM, EPS = 6, 2, 32, 1e-5


@pytest.fixture(scope="module")
def ops() -> tuple[TorchTokenOps, CpuKernelTokenOps]:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    return TorchTokenOps(HEADS, KV_HEADS, DIM, EPS), CpuKernelTokenOps(HEADS, KV_HEADS, DIM, EPS, kernels)


@pytest.mark.parametrize("rows", [0, 1, 5, 300])
def test_norms_match(ops, rows):
    reference, compiled = ops
    torch.manual_seed(rows)
    weight = torch.randn(96)
    hidden, delta = torch.randn(rows, 96) * 3, torch.randn(rows, 96)
    torch.testing.assert_close(compiled.rms_norm(hidden, weight), reference.rms_norm(hidden, weight))
    h_ref, h_cpu = hidden.clone(), hidden.clone()
    normed = compiled.add_rms_norm_(h_cpu, delta, weight)
    torch.testing.assert_close(normed, reference.add_rms_norm_(h_ref, delta, weight))
    torch.testing.assert_close(h_cpu, h_ref)  # the residual stream itself was updated in place


@pytest.mark.parametrize("rows", [0, 1, 5, 300])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_layer_norms_match(ops, rows, with_bias):
    """LayerNorm (Phi-2's, StarCoder2's with a bias; Command R's without) against PyTorch's, on rows
    whose mean is far from 0, so a norm that did not subtract it would show."""
    reference, compiled = ops
    torch.manual_seed(rows)
    weight, bias = torch.randn(96), torch.randn(96) if with_bias else None
    hidden, delta = torch.randn(rows, 96) * 3 + 5, torch.randn(rows, 96)
    torch.testing.assert_close(compiled.layer_norm(hidden, weight, bias), reference.layer_norm(hidden, weight, bias))
    h_ref, h_cpu = hidden.clone(), hidden.clone()
    normed = compiled.add_layer_norm_(h_cpu, delta, weight, bias)
    torch.testing.assert_close(normed, reference.add_layer_norm_(h_ref, delta, weight, bias))
    torch.testing.assert_close(h_cpu, h_ref)  # the residual stream itself was updated in place
    if rows:
        with pytest.raises(RuntimeError, match="bias"):
            compiled.layer_norm(hidden, weight, torch.randn(95))


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_rotary_matches(ops, rows):
    reference, compiled = ops
    torch.manual_seed(rows)
    width = (HEADS + 2 * KV_HEADS) * DIM
    qkv = torch.randn(rows, width)
    original = qkv.clone()  # (the compiled rotary turns qkv in place)
    positions = torch.randint(0, 64, (rows,))
    angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(4 * rows)[:rows]
    stores = [KVStore(torch.zeros(4 * rows, KV_HEADS, DIM), torch.zeros(4 * rows, KV_HEADS, DIM), slots)
              for _ in range(2)]
    expected = reference.rotary(qkv.clone(), positions, cos, sin, stores[0])
    got = compiled.rotary(qkv, positions, cos, sin, stores[1])
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e)
    # The fused KV store wrote the rotated keys and the values to their slots, and nothing else.
    torch.testing.assert_close(stores[1].k_cache, stores[0].k_cache)
    torch.testing.assert_close(stores[1].v_cache, stores[0].v_cache)
    torch.testing.assert_close(stores[1].k_cache[slots], got[1])
    with pytest.raises(RuntimeError, match="rotary table"):
        compiled.rotary(qkv, torch.full((rows,), 64), cos, sin)
    # The same in two steps (Hunyuan's q/k norm comes between): the rotary in place, then the store.
    for ops, store in zip((reference, compiled), stores, strict=True):
        store.k_cache.zero_(), store.v_cache.zero_()
        q, k, v = ops.store_kv(ops.rotary_(original.clone(), positions, cos, sin), store)
        for e, g in zip(expected, (q, k, v), strict=True):
            torch.testing.assert_close(g, e)
    torch.testing.assert_close(stores[1].k_cache, stores[0].k_cache)
    torch.testing.assert_close(stores[1].k_cache[slots], expected[1])
    torch.testing.assert_close(stores[1].v_cache[slots], expected[2])


def test_silu_and_mul_matches(ops):
    reference, compiled = ops
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * 80) * 20  # large magnitudes: exp must neither overflow nor lose sign
    torch.testing.assert_close(compiled.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


def test_gelu_tanh_and_mul_matches(ops):
    """Gemma's GeGLU gate against PyTorch's tanh-approximated GELU."""
    reference, compiled = ops
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * 80) * 5
    torch.testing.assert_close(compiled.gelu_tanh_and_mul(gate_up), reference.gelu_tanh_and_mul(gate_up))


def test_ungated_activations_match(ops):
    """An ungated MLP's GELU (tanh; Phi-2's, StarCoder2's) and relu squared (Arcee's) against PyTorch."""
    reference, compiled = ops
    torch.manual_seed(0)
    up = torch.randn(33, 80) * 5
    torch.testing.assert_close(compiled.gelu_tanh(up), reference.gelu_tanh(up))
    torch.testing.assert_close(compiled.relu_squared(up), reference.relu_squared(up))
    numbers = (0.7, 0.9, 0.5, -1e-6)  # Apertus's xIELU after the softplus: both branches, and x near 0
    up[0, :8] = torch.tensor([0.0, -1e-7, 1e-7, -1e-6, -30.0, 30.0, -0.5, 0.5])
    torch.testing.assert_close(compiled.xielu(up, *numbers), reference.xielu(up, *numbers))


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 100, 49152])
def test_argmax_rows_picks_what_torch_argmax_picks(vocab):
    """Greedy sampling's argmax: the first index of the largest value, or of the first NaN."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    torch.manual_seed(vocab)
    rows = [torch.randn(vocab) for _ in range(4)]
    rows.append(torch.zeros(vocab))  # every value tied: the first index
    rows.append(torch.full((vocab,), float("-inf")))
    tied = torch.randint(-3, 4, (vocab,)).float()  # ties between integer values, -0.0 and 0.0
    tied[(tied == 0) & (torch.arange(vocab) % 2 == 0)] = -0.0
    rows.append(tied)
    for spot in (0, vocab // 2, vocab - 1):
        row = torch.randn(vocab)
        row[spot] = float("nan")
        row[-1] = float("inf")
        rows.append(row)
        late = torch.randn(vocab)
        late[spot] = late.max() + 1 if vocab > 1 else 1.0  # the maximum at the start, middle or tail
        rows.append(late)
    logits = torch.stack(rows)
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))
    if vocab > 1:  # a strided view, each row one shorter
        view = logits[:, :-1]
        assert torch.equal(kernels.argmax_rows(view), view.argmax(dim=-1))
