"""int8 weight matmuls (W8A8, `--quantization int8`): the kernel's integer dot products of each
group of 64 k equal a torch integer matmul of the same quantized values (exact: equality), its
outputs are those dots combined as the contract orders them (each times its group's sx, summed
in group order, times sw: equality again), the quantizers round-trip within half a step, and an
int8 engine's greedy tokens do not depend on who shares the step. Run on every kernel build
(tests/test_kernel_builds.py): VNNI, AVX2 and generic branches."""

from __future__ import annotations

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.errors import InflightError
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import Linear, linear_backend, quantize_int8
from inflight.perf.cost_model import CostModel

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler for the CPU kernels")

ROWS = [1, 5, 16, 64, 300]
SHAPES = [(70, 130), (64, 576), (33, 3)]  # (N, K): panel widths, a short last group, k groups of 4 not filled
GROUP = 64  # k per activation scale


def combined(dots: torch.Tensor, sx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The contract's output: (((d_0 * sx_0) + d_1 * sx_1) + ...) * sw, each step rounded in fp32."""
    y = dots[:, :, 0].float() * sx[:, 0, None]
    for g in range(1, dots.shape[2]):
        y = y + dots[:, :, g].float() * sx[:, g, None]
    return y * scale[None, :]


def grouped(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.split(GROUP, dim=-1))


def packed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, scale = quantize_int8(weight)
    return q, scale, kernels.pack_int8_weight(q, scale)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_integer_dots_and_outputs_are_exact(rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k)
    weight[3] = 0  # a zero column of the output: scale 0
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 10
    x[-1] = 0 if rows > 1 else x[-1]  # an all-zero row
    q, scale, pack = packed(weight)
    dots, qx, sx = kernels.int8_dots(x, pack)
    assert dots.dtype == torch.int32 and qx.dtype == torch.int8 and dots.shape == (rows, n, -(-k // GROUP))
    reference = torch.stack([a.long() @ b.long().T for a, b in zip(grouped(qx), grouped(q), strict=True)], dim=-1)
    assert torch.equal(dots.long(), reference)  # integer accumulation: exact
    y = kernels.int8_linear(x, pack, n)
    assert torch.equal(y, combined(dots, sx, scale))  # the contract's roundings, in its order
    # And close to the fp32 product it stands for (a loose bound: quantization error).
    exact = x @ weight.T
    assert (y - exact).abs().max() <= 0.05 * exact.abs().max() + 1e-6


def test_the_quantizers_round_trip_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 96) * torch.logspace(-3, 2, 40)[:, None]
    weight[7] = 0
    q, scale = quantize_int8(weight)
    # The load's one-pass quantizer packs exactly these values.
    assert torch.equal(kernels.row_absmax(weight), weight.abs().amax(dim=1))
    assert torch.equal(Linear(weight, None, "inflight", int8=True).blocks, kernels.pack_int8_weight(q, scale))
    nonzero = torch.arange(40) != 7
    assert q.abs().max() <= 127 and (q[nonzero].abs().amax(dim=1) == 127).all()  # each row's largest is +-127
    assert scale[7] == 0 and not q[7].any()
    assert ((weight - q.float() * scale[:, None]).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()
    x = torch.randn(9, 96) * torch.logspace(-4, 3, 9)[:, None]
    x[:, 64:] *= 1e-3  # the last group's scale is its own, not the row's
    _, qx, sx = kernels.int8_dots(x, kernels.pack_int8_weight(q, scale))
    # max|x_g| / 127, within an ulp (the kernels are built with -ffast-math: maybe max|x| * (1 / 127)).
    amax = torch.stack([part.abs().amax(dim=1) for part in grouped(x)], dim=1)
    torch.testing.assert_close(sx, amax / 127, rtol=2.5e-7, atol=0)
    for part, q_part, s in zip(grouped(x), grouped(qx), sx.unbind(1), strict=True):
        assert ((part - q_part.float() * s[:, None]).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()
        assert (q_part.abs().amax(dim=1) == 127).all()


def test_the_int8_peak_is_timed_where_the_branch_has_instructions_of_its_own() -> None:
    """benchmarks/peers.py's int8 roofline: the multiply-adds per second of the int8 matmul's
    inner instructions, zero for the portable loops."""
    rate = kernels.int8_peak_macs(2000)
    assert rate == 0 if kernels.int8_isa() == "generic" else rate > 1e8


def test_linear_reads_the_int8_weight_and_adds_the_bias_after() -> None:
    if linear_backend(torch.device("cpu"), torch.float32) != "inflight":
        pytest.skip("int8 runs on inflight's own linear backend")
    torch.manual_seed(1)
    weight, bias, x = torch.randn(48, 160), torch.randn(48), torch.randn(7, 160)
    layer = Linear(weight, bias, "inflight", int8=True)
    assert layer.blocks is not None and layer.blocks.dtype == torch.int8 and layer.weight.numel() == 0
    dots, _, sx = kernels.int8_dots(x, layer.blocks)
    _, scale = quantize_int8(weight)
    assert torch.equal(layer(x), combined(dots, sx, scale) + bias)
    with pytest.raises(InflightError, match="int8 runs on inflight's CPU kernels"):
        Linear(weight, bias, "torch", int8=True)


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K", "BF16", "IQ3_XXS"])
def test_a_matrix_kept_as_stored_is_quantized_as_its_fp32_form(kind: str) -> None:
    """An int8 load never widens the whole model: a matrix the loader leaves in its blocks (only
    its shape given) is widened alone, from the blocks, and quantized to exactly the int8 weight
    its fp32 form gives. A fused matrix of parts of two types alike."""
    from test_linear import random_blocks

    from inflight.model.linear import blocks_usable

    if not blocks_usable():
        pytest.skip("these kernels read no GGUF blocks (built without AVX2)")
    blocks, weight = random_blocks(kind, 48, 512, seed=7)
    from_blocks = Linear(weight.to("meta"), None, "inflight", gguf_blocks=(kind, blocks), int8=True)
    assert torch.equal(from_blocks.blocks, Linear(weight, None, "inflight", int8=True).blocks)
    other, other_weight = random_blocks("Q8_0", 16, 512, seed=8)
    fused = Linear(torch.empty(64, 512, device="meta"), None, "inflight",
                   gguf_blocks=([kind, "Q8_0"], [blocks, other]), int8=True)
    assert torch.equal(fused.blocks, Linear(torch.cat([weight, other_weight]), None, "inflight", int8=True).blocks)


def test_an_int8_engines_tokens_do_not_depend_on_the_batch() -> None:
    """Activations are quantized per row (a scale per group of 64 k) and dot products are exact:
    a request's greedy tokens are the same alone and beside others, in a decode step of 1 or of 4
    rows."""
    if linear_backend(torch.device("cpu"), torch.float32) != "inflight":
        pytest.skip("int8 runs on inflight's own linear backend")
    llm = LLM(quantization="int8", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The capital of France is", "def add(a, b):", "Three colours are", "Once upon a time"]
    alone = llm.generate(prompts[0], params)[0].token_ids
    together = llm.generate(prompts, params)
    assert together[0].token_ids == alone
    assert all(len(out.token_ids) == 12 for out in together)
    assert llm.engine.model.layers[0].down.blocks.dtype == torch.int8  # type: ignore[union-attr]
    assert llm.engine.model.lm_head.blocks.dtype == torch.int8  # type: ignore[union-attr]  # the tied head too


def test_where_int8_cannot_run_it_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from inflight.cli import main

    assert main(["sim", "--workload", "burst", "--quantization", "int8"]) == 2  # built-in cpu-local: none
    assert "cpu-local has no int8 calibration: `inflight sim calibrate --quantization int8" in capsys.readouterr().err
    assert main(["sim", "--workload", "burst", "--hardware", "h100", "--quantization", "int8"]) == 2
    assert "is a GPU (its 8-bit weights: --weight-dtype int8)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's own line for a choice it does not have
        main(["generate", "--quantization", "int4", "x"])
    assert exit_info.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


def test_an_int8_calibration_fits_the_int8_engine_and_the_simulator_prices_it(tmp_path) -> None:
    """`inflight sim calibrate --quantization int8` times an int8 engine and fits a whole engine
    profile to it (the int8 peak nominal by the kernels' branch), kept beside a machine's fp32
    factors; the simulator prices `--quantization int8` with those and the rest with its own."""
    import dataclasses
    from pathlib import Path

    from inflight.perf.profiles import load_profiles, save_profile
    from inflight.sim.calibrate import INT8_PEAK_FACTOR, StepCase, calibrate_int8
    from inflight.sim.runs import SimTarget
    from inflight.sim.shapes import resolve_shapes

    if linear_backend(torch.device("cpu"), torch.float32) != "inflight":
        pytest.skip("int8 runs on inflight's own linear backend")
    fitted = Path(__file__).resolve().parents[1] / "benchmarks" / "sim" / "results" / "cpu-2threads.json"
    hardware, base = load_profiles(str(fitted))
    cases = [StepCase(b, 64, 2) for b in (1, 2, 4, 8, 16)] + [StepCase(0, 0, 1, n) for n in (32, 96)]
    cases += [StepCase(8, 32, 2, 48)]
    result, profile, samples = calibrate_int8(None, hardware, base, cases=cases, repeats=1, num_kv_blocks=128,
                                              max_num_tokens=128)
    hw = result.hardware
    assert hw.peak_flops_int8 == INT8_PEAK_FACTOR[kernels.int8_isa()] * hardware.peak_flops
    assert dataclasses.replace(profile, int8={}, calibration={}) == dataclasses.replace(base, calibration={})
    assert profile.int8["eight_bit_flops_efficiency"] == result.profile.flops_efficiency > 0
    measured = torch.tensor([s.duration_s for s in samples])
    assert (torch.from_numpy(result.predicted_s) / measured).median().item() == pytest.approx(1, abs=0.2)
    save_profile(tmp_path / "machine.json", hw, profile)
    hw2, profile2 = load_profiles(str(tmp_path / "machine.json"))
    assert profile2.int8 == profile.int8 and profile2.calibration["int8"]["int8_isa"] == kernels.int8_isa()
    target = SimTarget(*resolve_shapes(None), hw2, engine=profile2)
    fp32, int8 = target.cost_model("float32"), target.cost_model("float32", "int8")
    assert fp32.engine == base and fp32.weight_dtype == "float32"
    assert int8.weight_dtype == "int8" and int8.linear_flops_efficiency == result.profile.flops_efficiency
    for batch in ([(1, 64, 1)], [(1, 64, 1)] * 8, [(96, 96, 1)]):  # the fit's own steps, priced alike
        assert int8.step_time(batch) == pytest.approx(
            CostModel(target.shapes, hw, 1, "float32", result.profile, "int8").step_time(batch))
    # The SLO policy of an int8 engine predicts its steps from the int8 factors too.
    llm = LLM(quantization="int8", num_kv_blocks=32, scheduling_policy="slo", tbt_slo_ms=200,
              slo_cost_profile=str(tmp_path / "machine.json"))
    predictor = llm.engine.scheduler.predictor  # type: ignore[attr-defined]
    assert predictor.cost_model.weight_dtype == "int8" and predictor.cost_model.engine == int8.engine
