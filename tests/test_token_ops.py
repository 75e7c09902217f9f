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


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_short_conv_matches_and_reads_the_rows_its_step_wrote(ops, pool_dtype):
    """LFM2's short convolution, compiled, against PyTorch's arithmetic over the same pool: three
    requests' rows (a prompt from position 0, whose first taps read nothing; a chunk after a
    context the pool holds; a decode), each row's b * x written to its slot, rounded as the pool
    holds it, before any row reads: a row reads the rows before it in the same step. Each output is
    c times the taps' sum over b * x at the positions up to the row's own, computed here from the
    definition."""
    reference, compiled = ops
    torch.manual_seed(0)
    hidden, k, block = 48, 3, 4
    table = [[2, 5], [1, 7, 3], [0, 6]]  # each request's blocks
    pieces = [(0, 6), (5, 4), (7, 1)]  # (first position, rows) of each request this step
    bcx = torch.randn(sum(n for _, n in pieces), 3 * hidden)
    taps = torch.randn(hidden, k)
    before = torch.randn(8 * block, hidden).to(pool_dtype)  # the context already in the pool
    slot = [[t[p // block] * block + p % block for p in range(len(t) * block)] for t in table]
    own = torch.tensor([slot[r][p] for r, (start, n) in enumerate(pieces) for p in range(start, start + n)])
    reads = torch.tensor([[slot[r][p + j] if p + j >= 0 else -1 for j in range(1 - k, 1)]
                          for r, (start, n) in enumerate(pieces) for p in range(start, start + n)])
    pools = [before.clone(), before.clone()]
    got = compiled.short_conv_(bcx, taps, pools[0], own, reads)
    want = reference.short_conv_(bcx, taps, pools[1], own, reads)
    assert torch.equal(pools[0], pools[1])  # the same values stored, rounded alike
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    b, c, x = bcx.chunk(3, dim=-1)
    stored = before.clone()
    stored[own] = (b * x).to(pool_dtype)
    for row, read in enumerate(reads.tolist()):
        conv = sum(taps[:, j] * stored[s].float() for j, s in enumerate(read) if s >= 0)
        torch.testing.assert_close(got[row], c[row] * conv, atol=1e-5, rtol=1e-5)
    assert reads[0].tolist()[:2] == [-1, -1] and reads[6].tolist() == [slot[1][3], slot[1][4], slot[1][5]]


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
