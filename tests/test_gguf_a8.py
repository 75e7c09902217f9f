"""GGUF blocks times int8 activations (`--quantization int8-activations`, llama.cpp's arithmetic):
each sub-block's integer dot product exact, the outputs those dots combined in the order and
roundings the contract states (`csrc`: gguf_blocks_a8_linear), bit for bit, at every row count and
for every quantized block type; the activations' quantizer within half a step; a model's greedy
tokens independent of who shares the step. Run on every kernel build that has the block kernels
(tests/test_kernel_builds.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.errors import InflightError
from inflight.model.grid_quants import GRID_TYPES
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import Linear, check_int8_activations
from inflight.model.loaded import LoadedModel
from tests.test_linear import SCALE_AT, random_blocks

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.gguf_blocks_available(),
                                reason="the GGUF block kernels are not built here (no compiler, or no AVX2)")

ROWS = [1, 3, 4, 5, 6, 7, 8, 9, 12, 16, 64, 300]
GROUP = 32  # k per activation scale
# weights a sub-block (a scale each); 32 for the others (the grid and ternary types: their int8 form's 16)
SUB = {"Q6_K": 16, "Q3_K": 16, "Q2_K": 16, **dict.fromkeys(GRID_TYPES, 16)}
MINIMA = {"Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K"}  # layouts with w = d * q + m (Q4_0: m = -8 d)


def contract(x: torch.Tensor, packed: torch.Tensor, kind: str) -> torch.Tensor:
    """The contract's output from the packing's integers and x's quantized rows: per sub-block
    of S weights, in k order, t = dot * d; t = t + sum(qx) * m (layouts with minima);
    y = y + t * sx, each product and sum rounded in fp32."""
    q, d, m = kernels.gguf_blocks_integers(packed)
    qx, sx, sums = kernels.gguf_a8_quantize(x)
    size = SUB.get(kind, 32)
    y = torch.zeros(x.shape[0], q.shape[0])
    for s in range(q.shape[1] // size):
        ks = slice(s * size, (s + 1) * size)
        t = (qx[:, ks].long() @ q[:, ks].long().T).float() * d[None, :, s]
        if kind in MINIMA:
            total = sums[:, s * size // 16:(s + 1) * size // 16].sum(dim=1)
            assert torch.equal(total, qx[:, ks].long().sum(dim=1).int())
            t = t + total.float()[:, None] * m[None, :, s]
        p = t * sx[:, s * size // GROUP, None]
        y = p if s == 0 else y + p
    return y


@pytest.mark.parametrize("kind", list(SCALE_AT))
@pytest.mark.parametrize("out_features,in_features", [(37, 256), (64, 512)])
def test_block_matmul_with_int8_activations_is_the_contract_bit_for_bit(kind: str, out_features: int,
                                                                        in_features: int) -> None:
    blocks, weight = random_blocks(kind, out_features, in_features, seed=out_features + len(kind))
    bias = torch.randn(out_features)
    a8 = Linear(weight.to("meta"), bias, "inflight", gguf_blocks=(kind, blocks), int8_activations=True)
    assert kernels.gguf_blocks_int8_activations(a8.blocks)
    q, d, m = kernels.gguf_blocks_integers(a8.blocks)
    size = SUB.get(kind, 32)
    # The integers stand for the loader's values exactly: w = d * q + m.
    assert torch.equal(d.repeat_interleave(size, 1) * q.float() + m.repeat_interleave(size, 1), weight)
    torch.manual_seed(in_features)
    x = torch.randn(300, in_features) * torch.rand(300, 1) * 4
    x[7] = 0  # an all-zero row: scale 0, output the bias
    x[8, :GROUP] *= 1000  # one large group: the others keep their own scales
    with torch.inference_mode():
        together = a8(x)
        for rows in ROWS:
            y = a8(x[:rows])
            assert torch.equal(y, contract(x[:rows], a8.blocks, kind) + bias), rows
            assert torch.equal(y, together[:rows]), rows  # the same alone as in a step of 300
    assert torch.equal(together[7], bias.expand(out_features))
    # Close to the fp32 product it stands for (activation quantization error only).
    exact = x @ weight.T + bias
    err = (together - exact).abs().amax(dim=1)
    assert (err <= 0.02 * (x.abs().amax(dim=1) * weight.abs().sum(dim=1).max()) + 1e-5).all()


def test_the_activations_are_quantized_per_group_of_32_within_half_a_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 128) * torch.logspace(-4, 3, 9)[:, None]
    x[:, 96:] *= 1e-3
    x[4] = 0
    qx, sx, sums = kernels.gguf_a8_quantize(x)
    assert qx.dtype == torch.int8 and sx.shape == (9, 4) and sums.shape == (9, 8)
    for g in range(4):
        part, q_part, s = x[:, g * GROUP:(g + 1) * GROUP], qx[:, g * GROUP:(g + 1) * GROUP].float(), sx[:, g]
        torch.testing.assert_close(s, part.abs().amax(dim=1) / 127, rtol=2.5e-7, atol=0)
        assert ((part - q_part * s[:, None]).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()
        assert (q_part.abs().amax(dim=1)[torch.arange(9) != 4] == 127).all()
    assert not qx[4].any() and not sx[4].any()
    assert torch.equal(sums, qx.view(9, 8, 16).long().sum(dim=2).int())


@pytest.mark.parametrize("kind", ["Q6_K", "Q3_K"])
def test_six_bit_quants_are_packed_in_six_bits_for_int8_activations(kind: str) -> None:
    """Q6_K's and Q3_K's quants take 6 bits a weight in an int8-activation packing (0.8203 bytes a
    weight with the scales, as the file's Q6_K), 8 in the fp32 path's (1.07): the same integers,
    and the fp32 matmul on the 6-bit packing still the dequantized weights' product."""
    blocks, weight = random_blocks(kind, 48, 512, seed=3)
    a8 = kernels.pack_gguf_blocks([blocks], [kind], 512, True)
    fp32 = kernels.pack_gguf_blocks([blocks], [kind], 512, False)
    header = 64
    assert (a8.numel() - header) / weight.numel() == pytest.approx(0.8203125)
    assert (fp32.numel() - header) / weight.numel() == pytest.approx(1.0703125)
    for got, want in zip(kernels.gguf_blocks_integers(a8), kernels.gguf_blocks_integers(fp32), strict=True):
        assert torch.equal(got, want)
    x = torch.randn(3, 512)
    with torch.inference_mode():
        assert torch.equal(kernels.gguf_blocks_linear(x, a8, 48), kernels.gguf_blocks_linear(x, fp32, 48))


def test_a_matrix_with_a_16_bit_part_keeps_the_fp32_matmuls() -> None:
    """Only the quantized layouts have integers: a matrix with an F16 or BF16 part is packed
    unmarked and computes as without the option, bit for bit the fp32 result."""
    made = [random_blocks(kind, 16, 256, seed=i) for i, kind in enumerate(["Q4_K", "BF16"])]
    weight = torch.cat([w for _, w in made])
    mixed = Linear(weight.to("meta"), None, "inflight", gguf_blocks=(["Q4_K", "BF16"], [b for b, _ in made]),
                   int8_activations=True)
    assert not kernels.gguf_blocks_int8_activations(mixed.blocks)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        assert torch.equal(mixed(x), Linear(weight, None, "inflight")(x))


def test_a_models_tokens_do_not_depend_on_the_batch() -> None:
    """The embedded model (Q4_1 blocks) with int8 activations: a prompt's greedy tokens alone equal
    its tokens beside others (prefill steps of many rows, decode steps of 1 and of 4), every
    matmul, the LM head too, on the integer path."""
    llm = LLM(quantization="int8-activations", num_kv_blocks=64)
    model = llm.engine.model
    assert all(kernels.gguf_blocks_int8_activations(m.blocks) for m in (model.lm_head, model.layers[0].down))
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The capital of France is", "def add(a, b):", "Three colours are", "Once upon a time"]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts[:2]]
    together = llm.generate(prompts, params)
    assert [out.token_ids for out in together[:2]] == alone
    assert all(len(out.token_ids) == 12 for out in together)


@pytest.mark.parametrize("quantization", ["none", "int8-activations"])
def test_a_load_says_how_its_stored_blocks_are_multiplied(caplog: pytest.LogCaptureFixture, quantization: str) -> None:
    """The embedded GGUF keeps its 30 layers' 7 matrices in Q4_1 and its tied LM head (the
    embedding, one matrix) in Q8_0 as stored: the load says so, and by default names the option
    that multiplies them as llama.cpp does."""
    with caplog.at_level(logging.INFO, logger="inflight.model.loaded"):
        LoadedModel.load(None, torch.float32, torch.device("cpu"), quantization=quantization)
    said = [r.getMessage() for r in caplog.records if r.name == "inflight.model.loaded"]
    assert len(said) == 1 and "(210 Q4_1, 1 Q8_0)" in said[0]
    assert ("--quantization int8-activations" in said[0]) == (quantization == "none")
    assert ("multiply int8 activations" in said[0]) == (quantization == "int8-activations")


def test_the_option_is_refused_in_one_line_where_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    from inflight.cli import main

    with pytest.raises(InflightError, match="int8-activations runs on inflight's CPU block kernels in fp32"):
        LLM(quantization="int8-activations", dtype="bfloat16", num_kv_blocks=16)
    sixteen_bit = {"lm_head.weight": ("BF16", torch.zeros(1, dtype=torch.uint8))}
    with pytest.raises(InflightError, match="this checkpoint stores none"):
        check_int8_activations(sixteen_bit, kept=True)
    assert main(["sim", "--workload", "burst", "--quantization", "int8-activations"]) == 2
    assert "is not modelled by the simulator" in capsys.readouterr().err
