"""The one reader of a Hugging Face `config.json`: the decoder's shapes and rotary settings as a
`ModelConfig`, for the loader (which then checks that it can run the architecture) and for the
simulator (which needs only the shapes of any Llama-like decoder)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inflight.config import ModelConfig
from inflight.errors import ModelLoadError

# Architectures whose attention always has q, k and v biases, whatever the config says.
_QKV_BIAS_ARCHITECTURES = ("qwen2",)


def read_hf_config(path: Path, architectures: Sequence[str] | None = None) -> ModelConfig:
    """`path` is a config.json; raises ModelLoadError if it cannot be read, lacks a field, or
    (given `architectures`) names another `model_type`."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not a model config")
    arch = (raw.get("text_config") or raw).get("model_type", "llama")
    if architectures is not None and arch not in architectures:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {', '.join(architectures)}")
    if architectures is not None:
        refuse_unsupported(raw.get("text_config") or raw, path)
    try:
        return parse_hf_config(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"incomplete or invalid {path}: {type(exc).__name__}: {exc}") from None


# Config keys that change the arithmetic, and the values under which it is what inflight computes.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"),
    "hidden_activation": (None, "silu", "swish"),
    "partial_rotary_factor": (None, 1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
}


def refuse_unsupported(raw: dict[str, Any], path: Path) -> None:
    """Raises ModelLoadError naming the first config key whose value changes the arithmetic in a
    way inflight does not compute: silence would serve a different model."""
    for key, neutral in _NEUTRAL.items():
        if key in raw and raw[key] not in neutral:
            raise ModelLoadError(f"{path}: {key} = {raw[key]!r} changes the model's arithmetic in a way "
                                 "inflight does not compute yet")
    layer_types = set(raw.get("layer_types") or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        raise ModelLoadError(f"{path}: layer_types {sorted(layer_types)}: inflight computes full and "
                             "sliding-window attention layers only")


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    """A config.json's contents as a `ModelConfig`. Multimodal configs nest the decoder's under
    `text_config`; rotary settings sit in `rope_scaling` or, in newer configs, `rope_parameters`
    (which also carries `rope_theta`). Raises KeyError, TypeError or ValueError on a bad field."""
    raw = raw.get("text_config") or raw
    arch = str(raw.get("model_type", "llama"))
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    rope_theta = raw.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch in _QKV_BIAS_ARCHITECTURES or bool(raw.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=int(window) if window is not None else None,
        sliding_window_layers=_window_layers(raw) if window is not None else None,
        attention_scale=float(raw["attention_multiplier"]) if raw.get("attention_multiplier") is not None else None,
        embedding_scale=float(raw.get("embedding_multiplier") or 1.0),
        residual_scale=float(raw.get("residual_multiplier") or 1.0),
        logit_scale=float(raw.get("logits_scaling") or 1.0),
        rope_layers=_rope_layers(raw),
    )


def _window_layers(raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """Which layers slide, from `layer_types` (Qwen2's from its `max_window_layers`); None:
    every layer does (Mistral)."""
    types = raw.get("layer_types")
    if types is None and raw.get("max_window_layers") is not None:
        types = ["sliding_attention" if i >= int(raw["max_window_layers"]) else "full_attention"
                 for i in range(int(raw["num_hidden_layers"]))]
    if types is None or all(t == "sliding_attention" for t in types):
        return None
    return tuple(t == "sliding_attention" for t in types)


def _rope_layers(raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers` (1: the layer uses rotary, 0: it does not), or its default of a
    NoPE layer every `no_rope_layer_interval` layers; None for a model whose layers all rotate."""
    layers = int(raw["num_hidden_layers"])
    if raw.get("no_rope_layers") is not None:
        return tuple(bool(x) for x in raw["no_rope_layers"][:layers])
    if raw.get("model_type") == "smollm3":
        return nope_every(int(raw.get("no_rope_layer_interval", 4)), layers)
    return None


def nope_every(interval: int, num_layers: int) -> tuple[bool, ...]:
    """Every `interval`-th layer without rotary, the others with it."""
    return tuple((i + 1) % interval != 0 for i in range(num_layers))
