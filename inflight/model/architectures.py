"""The architectures inflight runs, each as data: its decoder layer's plan, the checkpoint names
of the per-layer weights the plan reads beyond Llama's, and how llama.cpp stores its q and k rows.

Adding an architecture is adding a row here (and, for an op no interpreter knows, the op); the
model and the loaders read only these rows, never the architecture's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.errors import ModelLoadError
from inflight.model.layer_plan import LLAMA_LAYER, QK_NORM_LAYER, Step


@dataclass(frozen=True)
class Architecture:
    name: str
    plan: tuple[Step, ...] = LLAMA_LAYER
    # DecoderLayer field -> the Hugging Face names (under `model.layers.N.`) of the per-head
    # weights stacked into it, for the plan's steps beyond Llama's.
    extra_weights: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # llama.cpp's converter interleaves each head's rotary halves in the q and k rows of the
    # Llama-style architectures it rotates as "normal" rope; those in NeoX order are stored as
    # Hugging Face has them.
    gguf_interleaved_qk: bool = True


_QK_NORM: dict[str, tuple[str, ...]] = {"qk_norm": ("self_attn.q_norm.weight", "self_attn.k_norm.weight")}

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    Architecture("llama"),
    Architecture("mistral"),
    Architecture("qwen2", gguf_interleaved_qk=False),
    Architecture("qwen3", plan=QK_NORM_LAYER, extra_weights=_QK_NORM, gguf_interleaved_qk=False),
]}

# llama.cpp's tensor names (`blk.N.` + these) -> Hugging Face's (`model.layers.N.` + these).
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}") from None
