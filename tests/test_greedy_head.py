"""The greedy screen of an LM head kept as GGUF blocks (`GreedyHead`, `csrc`: gguf_blocks_greedy):
each greedy row's token is the fp32 head's argmax bit for bit, first index on ties, for every
quantized block type and at every row count, while it sums only a few columns in fp32; an
engine's tokens, logprobs and prompt logprobs are the same with it and without it, speculation
and mixed batches included. Run on every kernel build that has the block kernels
(tests/test_kernel_builds.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from inflight import SamplingParams
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import GreedyHead, Linear
from tests.test_linear import SCALE_AT, random_blocks

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.gguf_blocks_available(),
                                reason="the GGUF block kernels are not built here (no compiler, or no AVX2)")

COLUMNS, K = 300, 256


def screened_head(kind: str) -> tuple[Linear, GreedyHead, torch.Tensor, int]:
    """A head of random `kind` blocks whose column 250 is a copy of its longest column among the
    first 250 (returned last), its screen and its fp32 weight."""
    blocks, weight = random_blocks(kind, COLUMNS, K, seed=len(kind) * 7)
    longest = int(weight[:250].norm(dim=1).argmax())
    blocks[250], weight[250] = blocks[longest], weight[longest]
    head = Linear(weight.to("meta"), None, "inflight", gguf_blocks=(kind, blocks))
    screen = GreedyHead.of(head)
    assert screen is not None
    return head, screen, weight, longest


@pytest.mark.parametrize("kind", list(SCALE_AT))
def test_the_screen_gives_the_fp32_heads_argmax_bit_for_bit(kind: str) -> None:
    head, screen, weight, longest = screened_head(kind)
    torch.manual_seed(K)
    x = torch.randn(80, K) * torch.rand(80, 1) * 4
    x[3, :32] *= 1000  # one large group: the others keep their own scales, and their bounds
    x[4] = 0  # every logit 0: the first column
    x[5] = weight[longest] * 3  # the longest column the largest (Cauchy-Schwarz), tied with its copy
    x[6, 7] = float("nan")  # every logit NaN: argmax_rows's first NaN
    x[7, 9] = float("inf")
    # Every activation of row 8 rounds the same way as its weight's sign in column 0: the
    # quantization error of that column at its worst, 0.49 of a step times each |w|.
    step = 0.01
    x[8] = (torch.randint(-100, 101, (K,)) + 0.49 * weight[0].sign()) * step
    x[8, ::32] = 127 * step  # each group's largest: the step exactly
    with torch.inference_mode():
        for rows in (1, 5, 9, 16, 17, 80):  # register passes, the gemm past 16, the biased int8 dots past 8
            tokens, computed = kernels.gguf_blocks_greedy(x[:rows], head.blocks, screen.table, COLUMNS)
            assert torch.equal(tokens, kernels.argmax_rows(head(x[:rows]))), rows
        assert torch.equal(screen(x), tokens)
    assert tokens[4] == 0 and tokens[5] == longest and tokens[6] == 0
    # It screens: a few columns summed in fp32 a row, every one only where the bound cannot hold
    # (the tie of all at 0, a NaN or inf input).
    ordinary = torch.cat([computed[:4], computed[8:]])
    assert ordinary.float().median() <= COLUMNS / 10, ordinary
    assert computed[4] == computed[6] == computed[7] == COLUMNS
    assert computed[5] >= 2  # both halves of the tie
    # What that rests on: every fp32 value inside the range the screen gives it, at any row count.
    finite = torch.cat([x[:6], x[8:]])
    with torch.inference_mode():
        y = head(finite)
        for rows in (1, 9, len(finite)):
            lo, hi = kernels.gguf_blocks_screen_range(finite[:rows], head.blocks, screen.table)
            assert bool(((lo <= y[:rows]) & (y[:rows] <= hi)).all()), rows
    assert (hi - lo).median() < y.std(dim=1).median()  # and narrow enough to leave few columns


def test_near_ties_go_to_the_first_column_as_in_fp32() -> None:
    """Columns one quantum apart in a single weight: the screen cannot tell them apart, the fp32
    sums can (or find them equal), and the token is the fp32 head's."""
    blocks, _ = random_blocks("Q8_0", 64, K, seed=3)
    quants = blocks.view(64, K // 32, 34)  # per block: d (fp16), then 32 int8 quants
    for j in range(1, 64):  # every column a copy of column 0, column j's quant j - 1 steps higher at k = j
        quants[j] = quants[0]
        quants[j, j // 32, 2 + j % 32] = (int(quants[0, j // 32, 2 + j % 32]) + j - 1) % 256
    head = Linear(torch.empty(64, K, device="meta"), None, "inflight", gguf_blocks=("Q8_0", blocks))
    screen = GreedyHead.of(head)
    assert screen is not None
    torch.manual_seed(1)
    x = torch.randn(200, K)
    with torch.inference_mode():
        logits = head(x)
        tokens, computed = kernels.gguf_blocks_greedy(x, head.blocks, screen.table, 64)
    assert torch.equal(tokens, kernels.argmax_rows(logits))
    assert computed.float().mean() > 8  # the near-ties were summed in fp32


def test_heads_the_screen_cannot_read_have_none(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, weight = random_blocks("Q8_0", 64, K, seed=5)
    assert GreedyHead.of(Linear(weight.to("meta"), None, "inflight", gguf_blocks=("Q8_0", blocks))) is not None
    # a bias, 16-bit blocks, blocks packed for int8 activations, fp32 panels
    assert GreedyHead.of(Linear(weight.to("meta"), torch.randn(64), "inflight", gguf_blocks=("Q8_0", blocks))) is None
    half, half_weight = random_blocks("F16", 64, K, seed=5)
    assert GreedyHead.of(Linear(half_weight.to("meta"), None, "inflight", gguf_blocks=("F16", half))) is None
    assert GreedyHead.of(Linear(weight.to("meta"), None, "inflight", gguf_blocks=("Q8_0", blocks),
                                int8_activations=True)) is None
    assert GreedyHead.of(Linear(weight, None, "inflight")) is None
    monkeypatch.setenv("INFLIGHT_GREEDY_SCREEN", "0")
    assert GreedyHead.of(Linear(weight.to("meta"), None, "inflight", gguf_blocks=("Q8_0", blocks))) is None


def outputs(llm: object, params: list[SamplingParams]) -> list[tuple[object, ...]]:
    done = llm.generate(PROMPTS[:len(params)], params)  # type: ignore[attr-defined]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in done]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 4}])
def test_an_engines_outputs_are_the_same_with_the_screen_and_without(make_llm: object, speculative: object) -> None:
    llm = make_llm(speculative_config=speculative)  # type: ignore[operator]
    model = llm.engine.runner.model
    screen = model.greedy_head
    assert screen is not None  # the embedded model's head: Q8_0 blocks
    rows: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        rows.append(len(x))
        return screen(x)

    # Greedy rows beside rows that need the logits: logprobs, prompt logprobs, sampling, a bias.
    params = [SamplingParams(max_tokens=24, temperature=0),
              SamplingParams(max_tokens=24, temperature=0, logprobs=2),
              SamplingParams(max_tokens=24, temperature=0.8, seed=7),
              SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=1),
              SamplingParams(max_tokens=24, temperature=0, logit_bias={11: 5.0})]
    try:
        model.greedy_head = counted
        with_screen = outputs(llm, params)
        model.greedy_head = None
        without = outputs(llm, params)
    finally:
        model.greedy_head = screen
    assert with_screen == without
    assert rows and max(rows) > 1  # the greedy requests went through it, several rows at a time
