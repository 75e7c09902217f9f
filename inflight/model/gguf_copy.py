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

# Where each block type keeps its fp16 scales in a block (bytes), for `random_blocks`.
_SCALES_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82], "IQ4_NL": [0], "IQ4_XS": [0],
              "IQ1_S": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
              "TQ1_0": [52], "TQ2_0": [64], "IQ1_M": [], "MXFP4": []}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` random GGUF rows of `cols` weights stored as `kind` (any of `loader.BLOCK_TYPES`), as
    uint8 (rows, bytes a row): random codes under scales that keep the weights near 0.1 (a K-quant's
    sub-block scales multiplied in). For timing a type's matmuls; the weights mean nothing."""
    import gguf

    if kind in ("F16", "BF16"):
        weights = 0.02 * rng.standard_normal((rows, cols), dtype=np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])).view(np.uint8)
    size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    if cols % size:
        raise ValueError(f"{kind} rows hold whole blocks of {size} weights; {cols} is not a multiple")
    blocks = rng.integers(0, 256, size=(rows, cols // size, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002 if size == 256 else 0.01).tobytes(), np.uint8)  # K-quants, IQ4_XS
    for at in _SCALES_AT[kind]:
        blocks[..., at:at + 2] = scale
    if kind == "IQ1_M":  # its d in the top nibbles of the four scale words at 48
        words = blocks[..., 48:56].copy().view(np.uint16)
        for j in range(4):
            words[..., j] = (words[..., j] & 0x0FFF) | (((scale.view(np.uint16)[0] >> (4 * j)) & 0x0F) << 12)
        blocks[..., 48:56] = words.view(np.uint8)
    if kind == "MXFP4":  # E8M0: 2^(e - 128), values up to 12
        blocks[..., 0] = rng.integers(118, 123, size=blocks.shape[:2])
    return blocks.reshape(rows, -1)


def rewrite_gguf(source: Path, path: Path, metadata: Mapping[str, Any],
                 tensors: Callable[[Any], Iterator[tuple[str, Any, Any]]]) -> Path:
    """Writes `path`: `source`'s metadata, the keys of `metadata` (after the architecture's name,
    `block_count`, say) given new values, and the tensors `tensors(reader)` yields as (name, data,
    GGML type or None for numpy's own)."""
    import gguf

    from inflight.model.gguf_reader import read_gguf

    reader = read_gguf(source)
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


def resized_copy(source: Path, factor: float, num_layers: int, folder: Path, seed: int = 0,
                 kind: str | None = None) -> Path:
    """A model of `source`'s architecture, vocabulary and tokenizer, `factor` times as wide (2, or
    0.5: the hidden size, the MLP's and the number of heads, each head as wide as before; a
    ValueError where a width does not divide), `num_layers` layers of seeded random weights, each
    tensor in the type `source` stores it in, or each decoder matrix in `kind` (a
    `GGMLQuantizationType` name); a type gguf-py cannot quantize as random codes
    (`random_blocks`), rows not whole blocks of their type in Q8_0; norms over the hidden size all
    ones: for timing steps of another width or storage, whose outputs mean nothing."""
    import gguf

    from inflight.model.gguf_reader import read_gguf

    reader = read_gguf(source)
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
            qtype = gguf.GGMLQuantizationType[kind] if kind and layer is not None else tensor.tensor_type
            if qtype == gguf.GGMLQuantizationType.F32:
                yield tensor.name, 0.02 * rng.standard_normal(shape, dtype=np.float32), None
                continue
            weights = 0.02 * rng.standard_normal(shape, dtype=np.float32)
            whole = shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
            try:
                data = gguf.quants.quantize(weights, qtype) if whole else None
            except NotImplementedError:  # an importance-quantized type, say
                data = random_blocks(qtype.name, shape[0], shape[1], rng)
            if data is None:  # rows not whole blocks of it
                qtype = gguf.GGMLQuantizationType.Q8_0
                data = gguf.quants.quantize(weights, qtype)
            yield tensor.name, data, qtype

    name = f"{source.stem}-x{factor:g}-{num_layers}-layers{f'-{kind}' if kind else ''}.gguf"
    return rewrite_gguf(source, folder / name, metadata, tensors)
