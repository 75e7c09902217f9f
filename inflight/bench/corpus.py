"""Real text to cut prompts from: the public-domain prose shipped in `inflight/data/`, tokenized
once with the model's tokenizer, so a prompt of N tokens is exactly N tokens of real text."""

from __future__ import annotations

from importlib import resources
from typing import Protocol

import numpy as np


class TextTokenizer(Protocol):
    """The two calls a corpus needs; `inflight.model.tokenizer.Tokenizer` has them."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def corpus_text() -> str:
    """All shipped corpus files (`inflight/data/*.txt`), in name order."""
    folder = resources.files("inflight") / "data"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def _encode_plain(tokenizer: TextTokenizer, text: str) -> list[int]:
    """Token ids without special tokens (no BOS in the middle of a prompt)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return list(hf.backend_tokenizer.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text))  # type: ignore[attr-defined]


class Corpus:
    """A long run of token ids; `take` cuts a span of exact length from a random place."""

    def __init__(self, tokenizer: TextTokenizer, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_ids = np.asarray(_encode_plain(tokenizer, text or corpus_text()), dtype=np.int64)
        if len(self.token_ids) == 0:
            raise ValueError("the corpus is empty")

    def take(self, rng: np.random.Generator, num_tokens: int) -> list[int]:
        """`num_tokens` consecutive tokens from a random offset (wrapping at the end)."""
        start = int(rng.integers(len(self.token_ids)))
        return self.token_ids.take(range(start, start + num_tokens), mode="wrap").tolist()

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens."""
        return _encode_plain(self.tokenizer, text)
