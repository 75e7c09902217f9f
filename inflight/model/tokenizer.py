"""The model's tokenizer and chat template (via transformers/tokenizers), and an incremental
detokenizer for streaming."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from inflight.errors import InvalidRequestError, ModelLoadError
from inflight.model.loader import ModelSource

ChatMessage = dict[str, Any]


class Tokenizer:
    """Encodes prompts, applies the chat template, decodes ids; wraps a transformers tokenizer."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        eos = {int(t) for t in eos_token_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def load(cls, source: ModelSource, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Reads tokenizer.json/tokenizer_config.json, or rebuilds the tokenizer from GGUF metadata."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            if source.kind == "gguf":
                hf = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
            else:
                hf = AutoTokenizer.from_pretrained(source.path)
        except Exception as exc:  # transformers raises many kinds; all mean "cannot load"
            raise ModelLoadError(f"cannot load the tokenizer of {source.path}: {exc}") from None
        if not getattr(hf, "is_fast", False):
            raise ModelLoadError(f"the tokenizer of {source.path} has no fast (tokenizers) backend")
        return cls(hf, eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt, with the BOS token if the model's tokenizer adds one."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ready for the reply."""
        if self.hf.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        try:
            text = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors on malformed messages
            raise InvalidRequestError(f"cannot apply the chat template: {exc}") from None
        # The rendered template already holds any BOS it wants.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    A token may end inside a multi-byte character, and how a token renders can depend on the
    one before it, so each delta is the difference of two decodes over a short sliding window;
    a window that ends in an incomplete character (U+FFFD) waits for the next token.
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Returns the text that `token_id` completes (possibly empty)."""
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Returns whatever is still held back (an incomplete character at the very end)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
