"""bf16 weights times bf16 activations (`--quantization bf16-activations`): a matrix stored in
bf16 packed in the same bytes, each step's activations rounded to bf16, vdpbf16ps where the CPU
has AVX512_BF16 and the fp32 block matmuls elsewhere (`csrc`: gguf_blocks_bf16_linear). The
contract is a tolerance: within fp32 summation error of the rounded activations' exact product,
and a row's result bit for bit the same whoever shares its step. Run on every kernel build that
has the block kernels (tests/test_kernel_builds.py), so both ways are tested."""

from __future__ import annotations

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.errors import InflightError
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import Linear, check_bf16_activations
from tests.test_linear import random_blocks

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.gguf_blocks_available(),
                                reason="the GGUF block kernels are not built here (no compiler, or no AVX2)")

ROWS = [1, 4, 5, 6, 16, 64, 300]
HEADER = 64  # pack_gguf_blocks's header of one segment


@pytest.mark.parametrize(("out_features", "in_features"), [(48, 512), (37, 96)])
def test_bf16_products_are_the_rounded_activations_times_the_weights(out_features: int, in_features: int) -> None:
    raw, weight = random_blocks("BF16", out_features, in_features, seed=in_features)
    packed = kernels.pack_gguf_blocks([raw], ["BF16"], in_features, False, True)
    assert kernels.gguf_blocks_bf16_activations(packed)
    panels = -(-out_features // 16)
    assert packed.numel() - HEADER == panels * 16 * in_features * 2  # the stored bytes, padded to whole panels
    torch.manual_seed(0)
    x = torch.randn(300, in_features) * torch.rand(300, 1) * 4
    x[7] = 0
    with torch.inference_mode():
        together = kernels.gguf_blocks_bf16_linear(x, packed, out_features)
        for rows in ROWS:  # a row's result does not depend on the step's other rows
            assert torch.equal(kernels.gguf_blocks_bf16_linear(x[:rows], packed, out_features), together[:rows]), rows
    assert not together[7].any()
    rounded, w = x.bfloat16().double(), weight.double()
    # Every product is exact in fp32; K sums in fp32 err by at most about K * 2^-24 * sum |products|.
    bound = 2 * in_features * 2.0 ** -24 * (rounded.abs() @ w.abs().T)
    assert ((together.double() - rounded @ w.T).abs() <= bound).all()
    # The activations really are rounded: the fp32 activations' product is farther than that.
    assert ((together.double() - x.double() @ w.T).abs() > bound).any()


def test_the_pair_layout_holds_the_stored_values() -> None:
    """The fp32 paths read the pair layout too (dequantizing, the block matmuls): the stored bf16
    values exactly, so any path that meets such a packing is right."""
    raw, weight = random_blocks("BF16", 40, 256, seed=5)
    pairs = kernels.pack_gguf_blocks([raw], ["BF16"], 256, False, True)
    rows = kernels.pack_gguf_blocks([raw], ["BF16"], 256)
    assert not kernels.gguf_blocks_bf16_activations(rows)
    assert torch.equal(kernels.gguf_blocks_dequantize(pairs)[:40], weight)
    x = torch.randn(9, 256)
    with torch.inference_mode():
        for n in (3, 9):
            for matmul in (kernels.gguf_blocks_linear, kernels.gguf_blocks_gemm):
                assert torch.equal(matmul(x[:n], pairs, 40), matmul(x[:n], rows, 40))


@pytest.mark.parametrize("other", ["F16", "Q8_0"])
def test_a_matrix_with_another_part_keeps_the_fp32_matmuls(other: str) -> None:
    made = [random_blocks(kind, 16, 256, seed=i) for i, kind in enumerate(["BF16", other])]
    weight = torch.cat([w for _, w in made])
    mixed = Linear(weight.to("meta"), None, "inflight", gguf_blocks=(["BF16", other], [b for b, _ in made]),
                   bf16_activations=True)
    assert not kernels.gguf_blocks_bf16_activations(mixed.blocks)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        assert torch.equal(mixed(x), Linear(weight, None, "inflight")(x))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Llama in bf16 safetensors, as checkpoints are published, with the embedded tokenizer."""
    import transformers

    from inflight.model.loader import resolve_model
    from inflight.model.tokenizer import Tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)  # far from flat logits, so that greedy tokens are well separated
    path = tmp_path_factory.mktemp("bf16")
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    Tokenizer.load(resolve_model(None), ()).hf.save_pretrained(path)
    return str(path)


def test_a_bf16_models_logits_and_tokens(bf16_checkpoint: str) -> None:
    """Every matmul of a bf16 checkpoint, the LM head too, on the bf16 path: the prompt's
    logprobs close to the fp32-activation path's on the same weights, and a prompt's greedy
    tokens alone equal to its tokens beside others."""
    exact = LLM(model=bf16_checkpoint, num_kv_blocks=32, max_model_len=256)
    llm = LLM(model=bf16_checkpoint, num_kv_blocks=32, max_model_len=256, quantization="bf16-activations")
    model = llm.engine.model
    assert all(kernels.gguf_blocks_bf16_activations(m.blocks) for m in (model.lm_head, model.layers[0].down))
    prompts = [list(range(5, 45)), list(range(100, 117)), list(range(200, 260)), [7, 8, 9]]
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    want = exact.generate(prompts[0], scored)[0].prompt_logprobs
    got = llm.generate(prompts[0], scored)[0].prompt_logprobs
    assert want is not None and got is not None
    diffs = [abs(g.logprob - w.logprob) for g, w in zip(got, want, strict=True)]
    assert max(diffs) < 0.05 and 0 < sum(diffs)  # bf16 activations: close, not equal
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts[:2]]
    together = llm.generate(prompts, params)
    assert [out.token_ids for out in together[:2]] == alone


def test_the_option_is_refused_in_one_line_where_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    from inflight.cli import main

    with pytest.raises(InflightError, match="this checkpoint stores none"):
        LLM(quantization="bf16-activations", num_kv_blocks=16)  # the embedded model: Q4_1 blocks
    with pytest.raises(InflightError, match="bf16-activations runs on inflight's CPU block kernels in fp32"):
        check_bf16_activations({}, kept=False)
    assert main(["sim", "--workload", "burst", "--quantization", "bf16-activations"]) == 2
    assert "is not modelled by the simulator" in capsys.readouterr().err
