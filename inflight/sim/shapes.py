"""Model shapes for the simulator, by name: the built-in table of published configurations
(`inflight.perf.shapes`), a Hugging Face `config.json`, or a local model (GGUF or HF directory).

Shapes are `inflight.config.ModelConfig`, the record the engine itself reads models into.
"""

from __future__ import annotations

from pathlib import Path

from inflight.config import MatmulStorage, ModelConfig
from inflight.errors import ConfigError, ModelLoadError
from inflight.model.hf_config import read_hf_config
from inflight.perf.shapes import BUILTIN_MODELS, DEFAULT_MODEL


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


def checkpoint_storage(model: str | None) -> MatmulStorage | None:
    """The matmul weights' bytes as inflight's CPU kernels read a local checkpoint's matrices,
    kept as stored (`loader.matmul_storage`: a GGUF file's blocks, a checkpoint's 16-bit matrices):
    those of the engine's default model (None: the embedded GGUF), of a GGUF file or of a model
    directory; None for a built-in name or a bare config.json, whose weights are priced in the
    compute type."""
    from inflight.model.loader import matmul_storage, resolve_model

    if model is None:
        return matmul_storage(resolve_model(None))
    path = Path(model).expanduser()
    local = (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix.lower() == ".gguf")
    if _normalize(model) in BUILTIN_MODELS or not local:
        return None
    try:
        return matmul_storage(resolve_model(path))
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
