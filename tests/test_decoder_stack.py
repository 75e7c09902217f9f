"""The compiled interpreter of the layer plan (`DecoderStack`) against the model's Python one:
the same kernels in the same order, so the same logits bit for bit, at every kind of step, for
the Llama plan and for another plan."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import PROMPTS

from inflight import SamplingParams
from inflight.model.layer_plan import LLAMA_LAYER, NORM_OPS, PARALLEL_LAYER, Op, Reg, Step
from inflight.model.llama import MATMULS, NORMS, DecoderLayer


@pytest.fixture
def model(loaded) -> Iterator[object]:
    model = loaded.model
    if model.decoder_stack is None:
        pytest.skip("no compiled CPU kernels here (or INFLIGHT_LINEAR picked another backend)")
    yield model


def step_logits(make_llm, model, compiled: bool, prompts: list | None = None,
                **options) -> tuple[list[torch.Tensor], list]:
    """Every step's LM head input (the final norm's rows, of which the logits and the greedy
    screen's tokens are functions) for the prompts below, through the compiled layers or the
    Python loop, and the engine's step records."""
    stack = model.decoder_stack
    final_hidden = model.final_hidden
    logits: list[torch.Tensor] = []

    def record(*args, **kwargs):
        out = final_hidden(*args, **kwargs)
        logits.append(out.clone())
        return out

    model.final_hidden = record
    if not compiled:
        model.decoder_stack = None
    try:
        llm = make_llm(**options)
        prompts = prompts or PROMPTS + [list(range(100, 400))]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 5, 12, 4, 7, 6, 10)]
        params = params[:len(prompts)]
        llm.generate(prompts, params)
    finally:
        model.final_hidden = final_hidden
        model.decoder_stack = stack
    return logits, list(llm.engine.step_records)


@pytest.mark.parametrize("options", [
    # Chunked prefill: prompts cut into pieces with cached context, beside decodes in one step,
    # then decode steps shrinking to a single request (the GGUF-block matmuls at <= 5 rows).
    {"max_num_tokens": 64, "enable_chunked_prefill": True},
    # Whole prompts in one step, prefill-only, then decode-only steps.
    {"max_num_tokens": 2048},
], ids=["chunked", "whole-prompts"])
def test_compiled_layers_equal_python_loop(make_llm, model, options):
    compiled, steps = step_logits(make_llm, model, True, **options)
    python, _ = step_logits(make_llm, model, False, **options)
    assert len(compiled) == len(python) == len(steps)
    for a, b in zip(compiled, python, strict=True):
        assert torch.equal(a, b)
    kinds = {(s.num_decode_tokens > 0, s.num_prefill_tokens > 0) for s in steps}
    assert kinds >= {(True, False), (False, True) if options["max_num_tokens"] > 64 else (True, True)}
    assert min(s.num_requests for s in steps) == 1


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3_text", "glm4", "ernie4_5", "olmo2", "olmo3", "granite",
                                  "smollm3", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe",
                                  "gpt_oss", "arcee", "glm4_moe", "phi", "stablelm", "starcoder2", "cohere2",
                                  "nemotron", "ernie4_5_moe", "apertus", "hunyuan_v1_dense", "lfm2",
                                  "lfm2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "gpt2", "gpt_bigcode",
                                  "opt", "gpt_neox", "gptj", "falcon", "olmo", "bloom", "mpt", "phimoe"])
def test_every_architecture_runs_compiled_as_the_python_loop(tmp_path, arch):
    """Each architecture's plan (sandwich and post norms, q/k norm, GeGLU, scaled residuals,
    NoPE layers, sliding windows with their own rotary base, soft-capping, routed experts with a
    dense layer among them, renormalized or not, beside a shared expert; attention sinks and
    experts with a clamped SwiGLU; an ungated MLP of relu squared; experts chosen by sigmoids plus a
    bias beside an ungated shared one, or by softmax scores plus a bias; LayerNorms with and without
    biases, an ungated GELU, attention and the MLP side by side; xIELU with each layer's numbers; a q/k
    norm between the rotary and the KV store; short convolutions between attending layers; latent
    attention, its query unranked or through a rank; learned positions with a ReLU or GELU MLP; a
    parallel block on two LayerNorms; ALiBi; Phi-3.5-MoE's sparse mixer) through the compiled
    stack: the Python loop's logits bit for bit, in chunked steps mixing prefills past the window
    with decodes."""
    from test_loading import save_word_tokenizer, tiny_hf_model

    from inflight import LLM
    from inflight.model.kernels import cpu_kernels
    from inflight.model.loaded import LoadedModel

    if cpu_kernels() is None:
        pytest.skip("no compiled CPU kernels here")
    tiny_hf_model(arch).save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path, 320)
    loaded = LoadedModel.load(str(tmp_path), torch.float32, torch.device("cpu"))
    model = loaded.model
    assert model.decoder_stack is not None
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 77, 9)]

    def make(**options: Any):
        return LLM(loaded=loaded, num_kv_blocks=64, **options)

    options = {"max_num_tokens": 32, "enable_chunked_prefill": True}
    compiled, steps = step_logits(make, model, True, prompts, **options)
    python, _ = step_logits(make, model, False, prompts, **options)
    assert len(compiled) == len(python) == len(steps)
    for a, b in zip(compiled, python, strict=True):
        assert torch.equal(a, b)
    assert {(s.num_decode_tokens > 0, s.num_prefill_tokens > 0) for s in steps} >= {(True, True), (True, False)}
    assert any(s.num_decode_tokens == 1 and not s.num_prefill_tokens for s in steps)  # a token alone


@pytest.mark.parametrize("plan", [LLAMA_LAYER, PARALLEL_LAYER], ids=["llama", "parallel"])
def test_the_plan_names_the_layers_weights(plan):
    for step in plan:
        assert step.param is None or step.param in DecoderLayer._fields
        assert (step.op == Op.MATMUL) == (step.param in MATMULS)
        assert (step.op in NORM_OPS) == (step.param in NORMS)


def _with_plan(model, plan: tuple[Step, ...]):
    """The model's layers running `plan` (both interpreters) until the returned undo is called."""
    old = model.plan, model.decoder_stack
    model.plan = plan
    model.decoder_stack = model._decoder_stack(model.attention.kernels)

    def undo() -> None:
        model.plan, model.decoder_stack = old

    return undo


# Attention-only layers: the MLP's steps left out, so each layer adds its attention's projection
# to the residual stream through the next layer's input norm.
ATTENTION_ONLY = LLAMA_LAYER[:5]


def test_another_plan_runs_the_same_in_both_interpreters(make_llm, model):
    """Neither interpreter has the order built in: a plan with the MLP left out gives the same
    logits through both, and not the Llama plan's."""
    assert ATTENTION_ONLY[-1].dst == Reg.DELTA and all(s.op != Op.SILU_AND_MUL for s in ATTENTION_ONLY)
    options = {"max_num_tokens": 64, "enable_chunked_prefill": True}
    undo = _with_plan(model, ATTENTION_ONLY)
    try:
        assert model.decoder_stack is not None
        compiled, _ = step_logits(make_llm, model, True, **options)
        python, _ = step_logits(make_llm, model, False, **options)
    finally:
        undo()
    full, _ = step_logits(make_llm, model, True, **options)
    assert len(compiled) == len(python)
    for a, b in zip(compiled, python, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(compiled[0], full[0])


def test_a_plan_with_an_op_the_kernels_lack_runs_in_python(model):
    unknown = (Step("soft_cap", Reg.QKV, Reg.QKV), *LLAMA_LAYER)  # an op no interpreter has
    undo = _with_plan(model, unknown)
    try:
        assert model.decoder_stack is None
        hidden = torch.zeros(1, model.config.hidden_size)
        with pytest.raises(ValueError, match="soft_cap"):
            model._layers(hidden, torch.zeros(1, dtype=torch.long), [(None, None)] * len(model.layers), None)
    finally:
        undo()
    kernels = model.attention.kernels
    with pytest.raises(RuntimeError, match="no kernel for the plan's op soft_cap"):
        kernels.DecoderStack([[("soft_cap", 1, 1, -1, [])]], [0], int(Reg.DELTA), 1, [], [], [], [], [], [], [],
                             [0], [0], [1.0], 4, 4, 16, 1e-5, 0.25, 0.0)


class _Watched:
    """A decoder stack that notes when its last `forward` started and ended."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.window = stack, (0.0, 0.0)

    def forward(self, *args: object) -> object:
        start = time.perf_counter()
        try:
            return self.stack.forward(*args)
        finally:
            self.window = (start, time.perf_counter())


def test_compiled_layers_release_the_gil(loaded, model, monkeypatch):
    """The server's event loop runs while a step computes: the compiled call holds no GIL, so
    this thread keeps running Python through it. A call that held the GIL would stop this thread
    for nearly the whole call, on any machine; the operating system may also pause it now and
    then on a loaded one, which is why the bound is half the call and one clean run of three
    suffices."""
    from inflight.engine.block_manager import BlockManager
    from inflight.engine.runner import ModelRunner
    from inflight.engine.sampler import Sampler
    from inflight.engine.scheduler import ScheduledRequest
    from inflight.request import Request

    runner = ModelRunner(model, 64, 16, Sampler(torch.device("cpu")))
    bm = BlockManager(64, 16)
    req = Request("r", list(range(100, 612)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(req, 512)
    inputs = runner.prepare([ScheduledRequest(req, 0, 512, bm.block_table(req.request_id))])
    watched = _Watched(model.decoder_stack)
    monkeypatch.setattr(model, "decoder_stack", watched)

    def stall_and_call_s() -> tuple[float, float]:
        """The longest stretch of the compiled call in which this thread did not run, and the
        call's duration."""
        done = threading.Event()

        def run() -> None:
            model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_meta,
                          inputs.logits_indices)
            done.set()

        thread = threading.Thread(target=run)
        gaps, last = [], time.perf_counter()
        thread.start()
        while not done.is_set():
            now = time.perf_counter()
            if now - last > 1e-3:
                gaps.append((last, now))
            last = now
        thread.join()
        start, end = watched.window
        return max([min(b, end) - max(a, start) for a, b in gaps] + [0.0]), end - start

    runs = [stall_and_call_s() for _ in range(3)]
    assert any(stall < call / 2 for stall, call in runs), runs
