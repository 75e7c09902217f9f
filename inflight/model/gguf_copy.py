"""A GGUF file written again: its decoder matrices in another storage type (gguf-py's quantizers),
another width, fewer layers. The same model in other blocks, for measuring what a type costs
(`inflight sim calibrate`, benchmarks/quality.py), or of other shapes, for timing them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# The metadata keys (after the architecture's name) that give a layer's widths, scaled together.
_WIDTHS = ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv")


def rewrite_gguf(source: Path, path: Path, metadata: Mapping[str, Any],
                 tensors: Callable[[Any], Iterator[tuple[str, Any, Any]]]) -> Path:
    """Writes `path`: `source`'s metadata, the keys of `metadata` (after the architecture's name,
    `block_count`, say) given new values, and the tensors `tensors(reader)` yields as (name, data,
    GGML type or None for numpy's own)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(path), arch)
    for key, item in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = metadata.get(key.removeprefix(f"{arch}."), item.contents()) if key.startswith(f"{arch}.") else (
            item.contents())
        array = item.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, value, item.types[0], sub_type=item.types[-1] if array else None)
    for name, data, kind in tensors(reader):
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _layer(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def retyped_copy(source: Path, kind: str, folder: Path, num_layers: int | None = None) -> Path:
    """`source` written to `folder` with each decoder matrix (`blk.*`, rows a whole number of
    blocks) dequantized and, unless `kind` is F32, quantized by gguf-py to `kind` (a
    `GGMLQuantizationType` name: BF16, Q8_0, ...); every other tensor and all metadata as stored;
    only its first `num_layers` layers where given (the block count set so)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]

    def tensors(reader: Any) -> Iterator[tuple[str, Any, Any]]:
        for tensor in reader.tensors:
            layer = _layer(tensor.name)
            if num_layers is not None and layer is not None and layer >= num_layers:
                continue
            shape = tuple(reversed(tensor.shape.tolist()))
            if layer is not None and len(shape) == 2 and shape[1] % block == 0:
                weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
                if qtype == gguf.GGMLQuantizationType.F32:
                    yield tensor.name, weights, None
                else:
                    yield tensor.name, gguf.quants.quantize(weights, qtype), qtype
            else:
                yield tensor.name, tensor.data, tensor.tensor_type

    path = folder / f"{source.stem}-{kind}{'' if num_layers is None else f'-{num_layers}-layers'}.gguf"
    return rewrite_gguf(source, path, {} if num_layers is None else {"block_count": num_layers}, tensors)


def resized_copy(source: Path, factor: float, num_layers: int, folder: Path, seed: int = 0) -> Path:
    """A model of `source`'s architecture, vocabulary and tokenizer, `factor` times as wide (2, or
    0.5: the hidden size, the MLP's and the number of heads, each head as wide as before; a
    ValueError where a width does not divide), `num_layers` layers of seeded random weights, each
    tensor in the type `source` stores it in (a type gguf-py cannot write, Q8_0; norms over the
    hidden size all ones): for timing steps of another width, whose outputs mean nothing."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(reader.fields[f"{arch}.embedding_length"].contents())

    def resized(n: int) -> int:
        if (n * factor) % 1:
            raise ValueError(f"{source.name}: a width of {n} times {factor} is not whole")
        return int(n * factor)

    metadata: dict[str, Any] = {"block_count": num_layers}
    for key in _WIDTHS:  # each width checked before anything is written
        if f"{arch}.{key}" in reader.fields:
            width = reader.fields[f"{arch}.{key}"].contents()
            if not isinstance(width, int):
                raise ValueError(f"{source.name}: {key} is not one number ({width!r})")
            metadata[key] = resized(width)
    rng = np.random.default_rng(seed)

    def tensors(reader: Any) -> Iterator[tuple[str, Any, Any]]:
        for tensor in reader.tensors:
            layer = _layer(tensor.name)
            if layer is not None and layer >= num_layers:
                continue
            if len(tensor.shape) == 1:  # a norm over the hidden size grows; one over a head, rope's factors do not
                if tensor.shape[0] == hidden:
                    yield tensor.name, np.ones(resized(hidden), dtype=np.float32), None
                else:
                    yield tensor.name, tensor.data, tensor.tensor_type
                continue
            shape = tuple(n if n == vocab else resized(n) for n in reversed(tensor.shape.tolist()))
            weights = 0.02 * rng.standard_normal(shape, dtype=np.float32)
            qtype = tensor.tensor_type
            try:
                data = weights if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(weights, qtype)
            except (gguf.quants.QuantError, NotImplementedError):
                qtype = gguf.GGMLQuantizationType.Q8_0
                data = gguf.quants.quantize(weights, qtype)
            yield tensor.name, data, qtype

    return rewrite_gguf(source, folder / f"{source.stem}-x{factor:g}-{num_layers}-layers.gguf", metadata, tensors)
