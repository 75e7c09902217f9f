"""A decoder layer's operations, written down once.

`LLAMA_LAYER` is the order of operations of one Llama-family layer as data: steps that each
read one register and write one, with the layer's own weight where the step has one. Two
interpreters run it, so neither holds a second copy of the order:

- `LlamaModel._layers` in Python, over `TokenOps`, `Linear` and `PagedAttention` (any device,
  any dtype);
- `DecoderStack` in `csrc/cpu_kernels.cpp`, which takes the plan when it is built and runs the
  compiled CPU kernels back to back without Python between them (fp32 on CPU).

Both execute the same kernels in the same order on the same inputs, so their outputs agree bit
for bit (tests/test_decoder_stack.py). A new layer shape (qk-norm, a parallel block, another
architecture's plan) is a new plan here and, for an op neither interpreter knows yet, that op in
each; a plan with an op the compiled stack lacks runs in Python (`compiled_ops`).

The residual stream is not a register: `add_rms_norm` adds its source register to it in place,
then normalizes it into its destination. Registers start empty at each step, and adding an
empty register adds nothing, which is the first layer's input norm. After the last layer,
`OUTPUT` holds that layer's MLP output, which the model adds to the residual stream only on the
rows that sample a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple


class Reg(IntEnum):
    """Where a step's input comes from and its output goes; the values index both interpreters'
    register files."""

    NORMED = 0  # the normalized residual stream, a matmul's input
    QKV = 1     # the fused q/k/v projection (after `rotary_store_kv`: q and k rotated)
    ATTN = 2    # attention's output, [tokens, heads * head_dim]
    DELTA = 3   # what the next `add_rms_norm` adds to the residual stream
    GATE_UP = 4
    ACT = 5     # act(gate) * up
    MLP = 6     # the MLP's output beside attention's, in a parallel block (Phi-2's, Command R's)


class Op:
    """The operations a plan can name, with what each does to its registers."""

    # residual += src (skipped while src is empty); dst = rms_norm(residual) * the layer's `param`
    ADD_RMS_NORM = "add_rms_norm"
    # dst = src @ W.T (+ b), W the layer's `param` matmul
    MATMUL = "matmul"
    # rotary embedding of src's q and k heads at the tokens' positions, and each token's k and v
    # written to its slot of this layer's KV pool
    ROTARY_STORE_KV = "rotary_store_kv"
    # dst = paged attention of src's q over this layer's KV pool
    ATTENTION = "attention"
    # ROTARY_STORE_KV in two: the rotary embedding of src's q and k in place (dst is src), then each
    # token's k and v written to its slot of this layer's KV pool; a step may come between
    # (Hunyuan's q/k norm, after the rotary)
    ROTARY = "rotary"
    STORE_KV = "store_kv"
    # dst = silu(first half of src) * second half
    SILU_AND_MUL = "silu_and_mul"
    # dst = gelu(first half of src), its tanh approximation, * second half (Gemma's GeGLU)
    GELU_TANH_AND_MUL = "gelu_tanh_and_mul"
    # dst = relu(src) ** 2, the whole of src: an MLP without a gate (Arcee's, Nemotron's)
    RELU_SQUARED = "relu_squared"
    # src's q and k RMS-normalized in place (dst is src) by `param`, a (q scale, k scale) pair, in
    # groups of each scale's length: one head (Qwen3) or the whole projection (OLMo 2)
    QK_NORM = "qk_norm"
    # residual += src (skipped while src is empty); dst = the residual stream itself, unnormalized
    ADD_RESIDUAL = "add_residual"
    # dst = rms_norm(src) * `param`
    RMS_NORM = "rms_norm"
    # ADD_RMS_NORM and RMS_NORM with a LayerNorm: (x - mean) / sqrt(var + eps) * `param`, plus its
    # bias where the layer has one (`DecoderLayer.norm_biases`)
    ADD_LAYER_NORM = "add_layer_norm"
    LAYER_NORM = "layer_norm"
    # dst = gelu(src), its tanh approximation, the whole of src: an MLP without a gate (Phi-2's,
    # StarCoder2's)
    GELU_TANH = "gelu_tanh"
    # dst = relu(src), the whole of src: an MLP without a gate (OPT's)
    RELU = "relu"
    # dst = gelu(src), the exact (erf) form, the whole of src: an MLP without a gate (GPT-NeoX's)
    GELU = "gelu"
    # dst += src, in place: the step reads its destination too (a parallel block's two outputs summed)
    ADD = "add"
    # dst = xIELU(src), the whole of src, with the layer's own four numbers (`DecoderLayer.xielu`):
    # Apertus's ungated MLP
    XIELU = "xielu"
    # dst = src * `param`, a number (Granite's residual multiplier)
    SCALE = "scale"
    # dst = the MLP of `param`'s routed experts over src: each token through the few experts its
    # router picks, their outputs weighted (Mixtral, Qwen3-MoE, OLMoE, Granite MoE)
    ROUTED_EXPERTS = "routed_experts"
    # LFM2's short convolution: src holds each token's (b, c, x) thirds; b * x is written to the
    # token's slot of this layer's pool, then dst = c * the depthwise causal convolution of the
    # layer's `conv` taps over the b * x of the token and of those before it, read from their slots
    SHORT_CONV = "short_conv"
    # DeepSeek's multi-head latent attention (MLA): src holds each token's query projection (or
    # its low rank) beside its compressed KV (the latent and the key part every head shares); the
    # latent is normalized and the shared part rotated, both written as one row to the token's slot
    # of this layer's pool, each head's query taken into the latent's space, attention read over the
    # pool's rows, and dst is each head's result projected up to its values (`param`: the layer's
    # `LatentWeights`)
    LATENT_ATTENTION = "latent_attention"


# The ops that read their destination register before writing it.
READS_DST = frozenset({Op.ADD})
# The MLP activations that read a gate/up matmul holding the up projection alone.
UNGATED = frozenset({Op.RELU_SQUARED, Op.GELU_TANH, Op.XIELU, Op.RELU, Op.GELU})
# The norms of the residual stream, RMSNorm's and LayerNorm's.
NORM_OPS = frozenset({Op.ADD_RMS_NORM, Op.RMS_NORM, Op.ADD_LAYER_NORM, Op.LAYER_NORM})


class Mixer:
    """How a layer mixes its tokens, where a model's layers differ in it (LFM2's): a step for one
    kind runs on the layers of that kind only."""

    ATTENTION = "attention"
    CONV = "conv"  # a short convolution (`Op.SHORT_CONV`)


class Step(NamedTuple):
    op: str
    src: Reg
    dst: Reg
    param: str | None = None  # the `DecoderLayer` field this step's weight is
    mixer: str | None = None  # the layers it runs on (`Mixer`); None: every layer


LLAMA_LAYER: tuple[Step, ...] = (
    Step(Op.ADD_RMS_NORM, Reg.DELTA, Reg.NORMED, "input_norm"),
    Step(Op.MATMUL, Reg.NORMED, Reg.QKV, "qkv"),
    Step(Op.ROTARY_STORE_KV, Reg.QKV, Reg.QKV),
    Step(Op.ATTENTION, Reg.QKV, Reg.ATTN),
    Step(Op.MATMUL, Reg.ATTN, Reg.DELTA, "o"),
    Step(Op.ADD_RMS_NORM, Reg.DELTA, Reg.NORMED, "post_norm"),
    Step(Op.MATMUL, Reg.NORMED, Reg.GATE_UP, "gate_up"),
    Step(Op.SILU_AND_MUL, Reg.GATE_UP, Reg.ACT),
    Step(Op.MATMUL, Reg.ACT, Reg.DELTA, "down"),
)

# Qwen3's: q and k normalized per head before the rotary embedding.
QK_NORM_LAYER: tuple[Step, ...] = (
    *LLAMA_LAYER[:2],
    Step(Op.QK_NORM, Reg.QKV, Reg.QKV, "qk_norm"),
    *LLAMA_LAYER[2:],
)

# Hunyuan's (dense): q and k normalized per head after the rotary embedding, before K is stored.
QK_NORM_AFTER_ROTARY_LAYER: tuple[Step, ...] = (
    *LLAMA_LAYER[:2],
    Step(Op.ROTARY, Reg.QKV, Reg.QKV),
    Step(Op.QK_NORM, Reg.QKV, Reg.QKV, "qk_norm"),
    Step(Op.STORE_KV, Reg.QKV, Reg.QKV),
    *LLAMA_LAYER[3:],
)

# OLMo 2's: no norm before attention or the MLP, their outputs normalized instead (and q and k
# over the whole projection) before they join the residual stream.
POST_NORM_LAYER: tuple[Step, ...] = (
    Step(Op.ADD_RESIDUAL, Reg.DELTA, Reg.NORMED),
    Step(Op.MATMUL, Reg.NORMED, Reg.QKV, "qkv"),
    Step(Op.QK_NORM, Reg.QKV, Reg.QKV, "qk_norm"),
    Step(Op.ROTARY_STORE_KV, Reg.QKV, Reg.QKV),
    Step(Op.ATTENTION, Reg.QKV, Reg.ATTN),
    Step(Op.MATMUL, Reg.ATTN, Reg.DELTA, "o"),
    Step(Op.RMS_NORM, Reg.DELTA, Reg.DELTA, "attn_out_norm"),
    Step(Op.ADD_RESIDUAL, Reg.DELTA, Reg.NORMED),
    Step(Op.MATMUL, Reg.NORMED, Reg.GATE_UP, "gate_up"),
    Step(Op.SILU_AND_MUL, Reg.GATE_UP, Reg.ACT),
    Step(Op.MATMUL, Reg.ACT, Reg.DELTA, "down"),
    Step(Op.RMS_NORM, Reg.DELTA, Reg.DELTA, "mlp_out_norm"),
)

# Gemma 2's: norms both before and after attention and the MLP ("sandwich" norms), the MLP a
# GeGLU. Its attention's soft-capping and window are the layer's attention settings, not steps.
SANDWICH_NORM_LAYER: tuple[Step, ...] = (
    *LLAMA_LAYER[:5],
    Step(Op.RMS_NORM, Reg.DELTA, Reg.DELTA, "attn_out_norm"),
    Step(Op.ADD_RMS_NORM, Reg.DELTA, Reg.NORMED, "post_norm"),
    Step(Op.MATMUL, Reg.NORMED, Reg.GATE_UP, "gate_up"),
    Step(Op.GELU_TANH_AND_MUL, Reg.GATE_UP, Reg.ACT),
    Step(Op.MATMUL, Reg.ACT, Reg.DELTA, "down"),
    Step(Op.RMS_NORM, Reg.DELTA, Reg.DELTA, "mlp_out_norm"),
)


def with_activation(plan: Sequence[Step], activation: str) -> tuple[Step, ...]:
    """`plan` with its gated MLP's activation step (SwiGLU's or GeGLU's) replaced by `activation`
    (an ungated one, `RELU_SQUARED`, reads a gate/up matmul that holds the up projection alone)."""
    gated = (Op.SILU_AND_MUL, Op.GELU_TANH_AND_MUL)
    return tuple(Step(activation, step.src, step.dst) if step.op in gated else step for step in plan)


# Gemma's (1): Llama's layer, the MLP a GeGLU.
GEGLU_LAYER = with_activation(LLAMA_LAYER, Op.GELU_TANH_AND_MUL)

# Arcee's (AFM): Llama's layer, the MLP ungated: down(relu(up(x)) ** 2).
RELU_SQUARED_LAYER = with_activation(LLAMA_LAYER, Op.RELU_SQUARED)

# GLM-4's: Gemma 2's sandwich norms around a SwiGLU MLP.
SANDWICH_SWIGLU_LAYER = with_activation(SANDWICH_NORM_LAYER, Op.SILU_AND_MUL)

# Gemma 3's: Gemma 2's with q and k normalized per head before the rotary embedding.
SANDWICH_QK_NORM_LAYER: tuple[Step, ...] = (
    *SANDWICH_NORM_LAYER[:2],
    Step(Op.QK_NORM, Reg.QKV, Reg.QKV, "qk_norm"),
    *SANDWICH_NORM_LAYER[2:],
)


def with_layer_norm(plan: Sequence[Step]) -> tuple[Step, ...]:
    """`plan` with every RMSNorm of the residual stream a LayerNorm (StableLM's, StarCoder2's)."""
    layer_norm = {Op.ADD_RMS_NORM: Op.ADD_LAYER_NORM, Op.RMS_NORM: Op.LAYER_NORM}
    return tuple(step._replace(op=layer_norm.get(step.op, step.op)) for step in plan)


# StableLM's: Llama's layer with LayerNorms.
LAYER_NORM_LAYER = with_layer_norm(LLAMA_LAYER)

# StarCoder2's: LayerNorms, the MLP ungated: down(gelu(up(x))).
LAYER_NORM_GELU_LAYER = with_activation(LAYER_NORM_LAYER, Op.GELU_TANH)

# Nemotron's: LayerNorms, the MLP ungated: down(relu(up(x)) ** 2).
LAYER_NORM_RELU_SQUARED_LAYER = with_activation(LAYER_NORM_LAYER, Op.RELU_SQUARED)

# OPT's: LayerNorms, the MLP ungated: down(relu(up(x))).
LAYER_NORM_RELU_LAYER = with_activation(LAYER_NORM_LAYER, Op.RELU)

# Command R's: attention and the MLP side by side on one LayerNorm of the residual stream, both
# outputs added to it (a "parallel" block: x + attn(ln(x)) + mlp(ln(x))).
PARALLEL_LAYER: tuple[Step, ...] = (
    Step(Op.ADD_LAYER_NORM, Reg.DELTA, Reg.NORMED, "input_norm"),
    *LLAMA_LAYER[1:5],
    Step(Op.MATMUL, Reg.NORMED, Reg.GATE_UP, "gate_up"),
    Step(Op.SILU_AND_MUL, Reg.GATE_UP, Reg.ACT),
    Step(Op.MATMUL, Reg.ACT, Reg.MLP, "down"),
    Step(Op.ADD, Reg.MLP, Reg.DELTA),
)

# Phi-2's: the parallel block with an ungated GELU MLP.
PARALLEL_GELU_LAYER = with_activation(PARALLEL_LAYER, Op.GELU_TANH)


# GPT-NeoX's (Pythia's): attention and an ungated exact-GELU MLP side by side, each on a LayerNorm
# of its own of the residual stream (x + attn(ln1(x)) + mlp(ln2(x))); the `MLP` register holds the
# residual stream itself until the MLP's output replaces it.
PARALLEL_TWO_NORM_GELU_LAYER: tuple[Step, ...] = (
    Step(Op.ADD_RESIDUAL, Reg.DELTA, Reg.MLP),
    Step(Op.LAYER_NORM, Reg.MLP, Reg.NORMED, "input_norm"),
    *LLAMA_LAYER[1:5],
    Step(Op.LAYER_NORM, Reg.MLP, Reg.NORMED, "post_norm"),
    Step(Op.MATMUL, Reg.NORMED, Reg.GATE_UP, "gate_up"),
    Step(Op.GELU, Reg.GATE_UP, Reg.ACT),
    Step(Op.MATMUL, Reg.ACT, Reg.MLP, "down"),
    Step(Op.ADD, Reg.MLP, Reg.DELTA),
)

# Apertus's: Qwen3's q/k norm, the MLP ungated: down(xielu(up(x))).
XIELU_LAYER = with_activation(QK_NORM_LAYER, Op.XIELU)


# LFM2's: Qwen3's layer where it attends; where it convolves, the fused projection (`qkv`: in_proj's
# b, c and x thirds) goes through the short convolution instead, into the same output matmul.
SHORT_CONV_LAYER: tuple[Step, ...] = (
    *LLAMA_LAYER[:2],
    Step(Op.QK_NORM, Reg.QKV, Reg.QKV, "qk_norm", Mixer.ATTENTION),
    LLAMA_LAYER[2]._replace(mixer=Mixer.ATTENTION),
    LLAMA_LAYER[3]._replace(mixer=Mixer.ATTENTION),
    Step(Op.SHORT_CONV, Reg.QKV, Reg.ATTN, "conv", Mixer.CONV),
    *LLAMA_LAYER[4:],
)


# DeepSeek V2/V3's (and GLM-4.7-Flash's): Llama's layer, its attention latent (the fused projection
# `qkv` is the query's, or its low rank's, beside the compressed KV's).
LATENT_LAYER: tuple[Step, ...] = (
    *LLAMA_LAYER[:2],
    Step(Op.LATENT_ATTENTION, Reg.QKV, Reg.ATTN, "latent"),
    *LLAMA_LAYER[4:],
)


def for_mixer(plan: Sequence[Step], mixer: str) -> tuple[Step, ...]:
    """The steps of `plan` a layer of kind `mixer` runs. Each kind's plan is a whole layer that
    reads nothing of the layer before but the residual stream and `OUTPUT`, so the layers of a
    model may alternate kinds."""
    return tuple(step for step in plan if step.mixer in (None, mixer))


def with_routed_experts(plan: Sequence[Step]) -> tuple[Step, ...]:
    """`plan` with its MLP (the steps from the gate/up matmul to the down matmul) replaced by one
    routed-experts step over the same input and into the same output."""
    first = next(j for j, step in enumerate(plan) if step.param == "gate_up")
    last = next(j for j, step in enumerate(plan) if step.param == "down")
    experts = Step(Op.ROUTED_EXPERTS, plan[first].src, plan[last].dst, "experts")
    return (*plan[:first], experts, *plan[last + 1:])


def with_scaled_residual(plan: Sequence[Step]) -> tuple[Step, ...]:
    """`plan` with each contribution to the residual stream multiplied by the layer's
    `residual_scale` as it is complete: after the last step that writes `DELTA` before a step
    adds it to the residual stream (the plan repeating layer after layer, so the layer's last
    contribution is scaled before the model adds it after the last layer)."""
    adds = (Op.ADD_RMS_NORM, Op.ADD_LAYER_NORM, Op.ADD_RESIDUAL)
    n = len(plan)
    scaled: list[Step] = []
    for j, step in enumerate(plan):
        scaled.append(step)
        if step.dst != Reg.DELTA:
            continue
        after = next(plan[(j + k) % n] for k in range(1, n + 1)
                     if Reg.DELTA in (plan[(j + k) % n].src, plan[(j + k) % n].dst))
        if after.op in adds and after.src == Reg.DELTA:
            scaled.append(Step(Op.SCALE, Reg.DELTA, Reg.DELTA, "residual_scale"))
    return tuple(scaled)


OUTPUT = Reg.DELTA


def released_after(plan: Sequence[Step]) -> tuple[tuple[Reg, ...], ...]:
    """For each step, the registers it touched that no later step reads before writing them again
    (the plan repeating layer after layer; `OUTPUT` is read after its last write). Both
    interpreters drop them after the step, so that their memory is reused at once: held through
    the next layer instead, the buffers of a 64-request decode step fell out of cache and
    `peers.py`'s burst ran about 13% slower."""
    n = len(plan)
    last_output_write = max((j for j, step in enumerate(plan) if step.dst == OUTPUT), default=-1)
    released = []
    for j, step in enumerate(plan):
        dead = []
        for reg in sorted({step.src, step.dst}):
            if reg == OUTPUT and j >= last_output_write:
                continue
            for k in range(1, n + 1):
                later = plan[(j + k) % n]
                if later.src == reg or (later.op in READS_DST and later.dst == reg):
                    break
                if later.dst == reg:
                    dead.append(reg)
                    break
            else:
                dead.append(reg)
        released.append(tuple(dead))
    return tuple(released)


def compiled_ops(plan: Sequence[Step], available: Sequence[str]) -> bool:
    """Whether every op of `plan` is among `available` (the compiled stack's `plan_ops()`)."""
    return {step.op for step in plan} <= set(available)
