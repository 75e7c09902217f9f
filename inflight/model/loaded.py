"""A model ready to run: weights on the device plus its tokenizer. Loaded once, it can back
several engines (benchmark sweeps and tests build many engines over one model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.model.linear import blocks_usable
from inflight.model.llama import LlamaModel
from inflight.model.loader import load_blocks, load_checkpoint, load_embedding, release_file_pages, resolve_model
from inflight.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: LlamaModel
    tokenizer: Tokenizer

    @classmethod
    def load(cls, model: str | None, dtype: torch.dtype, device: torch.device) -> LoadedModel:
        source = resolve_model(model)
        keep_blocks = dtype == torch.float32 and device.type == "cpu" and blocks_usable()
        config, weights = load_checkpoint(source, dtype, keep_blocks=keep_blocks)
        blocks = load_blocks(source, config) if keep_blocks else {}
        embedding = load_embedding(source, config) if keep_blocks else None
        llama = LlamaModel(config, weights, device, gguf_blocks=blocks, embedding=embedding)
        del weights, blocks  # the model holds what it reads; the rest goes before the tokenizer loads
        release_file_pages(source)
        return cls(source.name, llama, Tokenizer.load(source, config.eos_token_ids))
