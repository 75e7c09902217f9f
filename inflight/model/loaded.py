"""A model ready to run: weights on the device plus its tokenizer. Loaded once, it can back
several engines (benchmark sweeps and tests build many engines over one model)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from inflight.config import EngineConfig, MatmulStorage
from inflight.model import packed_cache
from inflight.model.grid_quants import GRID_TYPES
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import (
    INTEGER_BLOCK_TYPES,
    check_bf16_activations,
    check_int8_activations,
    keeps_blocks,
)
from inflight.model.llama import LlamaModel
from inflight.model.loader import (
    load_blocks,
    load_checkpoint,
    load_embedding,
    matmul_storage,
    release_file_pages,
    resolve_model,
)
from inflight.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: LlamaModel
    tokenizer: Tokenizer
    quantization: str = "none"
    hf_overrides: str | None = None
    # The matmul weights' bytes as a step reads them where the checkpoint's matrices are kept as
    # stored (`keeps_blocks`), for the step-time model; None: the compute type's.
    matmul_storage: MatmulStorage | None = None

    def serves(self, config: EngineConfig) -> bool:
        """Whether an engine of `config` can run on this model as loaded (the same weights and settings)."""
        return (self.quantization, self.hf_overrides) == (config.quantization, config.model_overrides)

    @classmethod
    def load(cls, model: str | None, dtype: torch.dtype, device: torch.device,
             quantization: str = "none", hf_overrides: str | None = None) -> LoadedModel:
        """The tokenizer loads in a thread of its own while the weights are read and repacked:
        most of its time is Python (importing transformers, building the vocabulary), most of the
        weights' is the C++ repacking, which runs without the GIL (a 1B Q4_K_M GGUF on 2 Ice Lake
        cores: 3.3-3.8 s, against 3.8-4.2 s one after the other, alternated). With `quantization`
        int8, each matrix is quantized from its fp32 form (`Linear`), whatever the checkpoint
        stores: a matrix kept as stored is widened a block panel of rows at a time, so no matrix
        is ever held in fp32 whole. With `int8-activations`, the matrices kept as quantized GGUF blocks
        multiply int8 activations (`Linear`); refused where there are none; with `bf16-activations`
        the matrices kept in bf16 multiply bf16 activations. A large GGUF file's packed matrices
        are kept on disk for the next load, which maps them instead (`packed_cache`; written while
        this load's model serves)."""
        source = resolve_model(model, hf_overrides)
        Tokenizer.check_files(source)
        keep_blocks = keeps_blocks(dtype, device)
        cache = packed_cache.locate(source, quantization, cpu_kernels()) if keep_blocks else None
        kept = packed_cache.read(cache) if cache is not None else None
        config, weights = load_checkpoint(source, dtype, keep_blocks=keep_blocks)
        with ThreadPoolExecutor(1, thread_name_prefix="inflight-tokenizer") as pool:
            tokenizer = pool.submit(Tokenizer.load, source, config.eos_token_ids)
            blocks = load_blocks(source, config) if keep_blocks else {}
            embedding = load_embedding(source, config) if keep_blocks else None
            if quantization == "int8-activations":
                check_int8_activations(blocks, keep_blocks)
            if quantization == "bf16-activations":
                check_bf16_activations(blocks, keep_blocks)
            _say_arithmetic(blocks, quantization)
            llama = LlamaModel(config, weights, device, gguf_blocks=blocks, embedding=embedding,
                               int8=quantization == "int8", int8_activations=quantization == "int8-activations",
                               bf16_activations=quantization == "bf16-activations", packed=kept)
            del weights, blocks  # the model holds what it reads
            if cache is not None and (kept is None or kept.keys() != llama.packed.keys()):
                packed_cache.keep(cache, llama.packed)
            release_file_pages(source)
            return cls(source.name, llama, tokenizer.result(), quantization, hf_overrides,
                       matmul_storage(source) if keep_blocks else None)


def _say_arithmetic(blocks: Mapping[str, tuple[str, object]], quantization: str) -> None:
    """One log line on how the matrices kept as quantized blocks are multiplied, and, where they
    compute as the dequantized model (the default), the option that computes as llama.cpp does."""
    stored = {id(raw): kind for kind, raw in blocks.values()}  # a tied LM head is the embedding's matrix
    kinds = Counter(kind for kind in stored.values() if kind in INTEGER_BLOCK_TYPES)
    if not kinds:
        return
    counts = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
    if any(kind in GRID_TYPES for kind in kinds):
        counts += "; the grid and ternary types as int8 values decoded from their blocks"
    if quantization == "int8-activations":
        logger.info("matrices kept as stored (%s) multiply int8 activations, as llama.cpp does", counts)
    elif quantization == "none":
        logger.info("matrices kept as stored (%s) multiply fp32 activations, bit for bit the dequantized model; "
                    "--quantization int8-activations multiplies them by int8 activations as llama.cpp does, faster on "
                    "CPU (docs/models.md)", counts)
