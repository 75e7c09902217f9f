"""The model's tokenizer and chat template (via transformers/tokenizers), and an incremental
detokenizer for streaming."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inflight.errors import InvalidRequestError, ModelLoadError
from inflight.model.gguf_splits import splits_for
from inflight.model.loader import ModelSource, cache_dir

ChatMessage = dict[str, Any]


def tokenizer_cache_dir() -> Path:
    return cache_dir() / "tokenizers"


# The `tokenizer.ggml.pre` types whose tokenizers take a word the vocabulary holds whole as one
# token before any merge (the BPE model's `ignore_merges`, as Llama 3's tokenizer.json sets it;
# llama.cpp's list, `llama-vocab.cpp`).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                            "jina-v5-nano", "minicpm5", "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m"})
# The pre-tokenizer types whose files, when they do not say, add a BOS (llama.cpp's defaults,
# `llama-vocab.cpp`: Llama 3's family; files of older converters carry no `add_bos_token`).
_ADDS_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                       "jina-v5-nano", "tekken", "chameleon"})
# llama.cpp adds no BOS to GLM's, whatever their files say.
_NO_BOS = frozenset({"glm4", "glm5", "chatglm-bpe"})
_INDEX_VERSION = 5  # of the cached conversion: 2, inflight's own rebuild (`gguf_tokenizer`); 3, _ADDS_BOS; 4, GLM's;
# 5, llama.cpp's splits and plain-text user tokens


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer a GGUF file's metadata describes, rebuilt with transformers' converters from
    the vocabulary, merges and special tokens llama.cpp's converter wrote, whatever the model's
    architecture (transformers' `AutoTokenizer` reads only the architectures whose configs it
    knows), with what those converters leave out:

    - a SentencePiece vocabulary (`tokenizer.ggml.model` llama) that adds a space prefix is split
      as Llama 2's and Mistral's tokenizer.json split it: the prefix and every space become "▁"
      before the model sees the text, so leading and repeated spaces keep their own tokens;
    - a byte-level BPE of a pre-tokenizer in `_IGNORE_MERGES` (Llama 3's) takes a word it holds
      whole as one token;
    - one of a pre-tokenizer in `_ADDS_BOS` adds a BOS unless the file says otherwise, one in
      `_NO_BOS` none;
    - one of a pre-tokenizer transformers has no split for splits text as llama.cpp splits it
      (`gguf_splits`), and one llama.cpp cannot split either is refused;
    - a byte-level vocabulary's user-defined tokens stored as plain text (GPT-NeoX's runs of
      spaces, DeepSeek-Coder's infilling marks) are matched whole, as llama.cpp and the model's
      own tokenizer match them."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        GGUF_SENTENCEPIECE_BUILDERS,
    )

    architecture, vocabulary, config = get_gguf_tokenizer(str(path))
    kind = vocabulary.get("tokenizer_type")
    pre = vocabulary.get("pre_tokenizer_type")
    splits = splits_for(pre, GGUF_PRE_TOKENIZER_SPLITS) if kind == "gpt2" else None  # (refused before converting)
    backend, _ = convert_gguf_tokenizer(architecture, vocabulary)
    if kind == "llama" and vocabulary.get("add_prefix_space", True) and architecture not in GGUF_SENTENCEPIECE_BUILDERS:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer = None
    if kind == "gpt2" and pre in _IGNORE_MERGES:
        backend.model.ignore_merges = True
    if splits is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(expression), behavior="isolated") for expression in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if kind == "gpt2":
        backend = _with_plain_text_tokens(backend, vocabulary)
    if kind == "gpt2" and config.get("add_bos_token") is None and pre in _ADDS_BOS:
        config["add_bos_token"] = True
    if kind == "gpt2" and pre in _NO_BOS:
        config["add_bos_token"] = False
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in config.items() if v is not None})


def _with_plain_text_tokens(backend: Any, vocabulary: dict[str, Any]) -> Any:
    """`backend` matching whole the user-defined tokens (type 4) a byte-level file stores as plain
    text: transformers' reader spells them in the byte alphabet ("  " as "ĠĠ", "<｜fim▁hole｜>" as
    "<ï½ľfimâĸģholeï½ľ>") under their ids and so does not find them to add. One no merge makes or
    uses becomes an added token under its id (its vocabulary entry renamed to its text); one the
    merges build (GPT-NeoX's runs of spaces) is cut out of the text first, and BPE makes it."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = backend.get_vocab()
    tokens = zip(vocabulary["tokens"], vocabulary.get("token_type") or (), strict=False)
    plain = {token: i for i, (token, kind) in enumerate(tokens) if kind == 4 and token not in vocab}
    if not plain:
        return backend
    spec = json.loads(backend.to_str())
    merged: set[str] = set()
    for merge in spec["model"]["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        merged.update((left, right, left + right))
    cut = []
    for token, i in plain.items():
        spelling = backend.id_to_token(i)
        if spelling is None:  # (an id past the converted vocabulary: nothing to name)
            continue
        if spelling in merged:
            cut.append(token)
            continue
        del spec["model"]["vocab"][spelling]
        spec["model"]["vocab"][token] = i
        spec["added_tokens"].append({"id": i, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
    backend = Backend.from_str(json.dumps(spec))
    if cut:
        cut.sort(key=len, reverse=True)  # the longest that matches
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex("|".join(map(re.escape, cut))), behavior="isolated"),
            *([backend.pre_tokenizer] if backend.pre_tokenizer is not None else [])])
    return backend


def _load_gguf_tokenizer(path: Path) -> Any:
    """`gguf_tokenizer(path)` (several seconds: the vocabulary and merges are converted in
    Python), saved once in transformers' format under `tokenizer_cache_dir()`, keyed by the file
    and the transformers version, and read from there afterwards (a fraction of a second). An
    unwritable cache only costs the rebuild."""
    import transformers
    from transformers import AutoTokenizer

    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}:{_INDEX_VERSION}"
    cached = tokenizer_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    hf = gguf_tokenizer(path)
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent)
        hf.save_pretrained(tmp)
        os.replace(tmp, cached)  # all or nothing: a reader never sees half a directory
    except OSError as exc:
        logging.getLogger(__name__).info("tokenizer cache not written (%s)", exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return hf


def warm_default_cache() -> None:
    """Converts the default model's tokenizer once (`scripts/setup.sh` runs this), so that the
    first `inflight serve` does not wait for it."""
    from inflight.model.loader import load_model_config, resolve_model

    source = resolve_model(None)
    Tokenizer.load(source, load_model_config(source).eos_token_ids)
    print(f"inflight tokenizer cache: {tokenizer_cache_dir()}")


# The files a Hugging Face tokenizer is read from (any one of them).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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

    @staticmethod
    def check_files(source: ModelSource) -> None:
        """ModelLoadError, before anything is read, for a checkpoint directory without a tokenizer."""
        if source.kind == "hf" and not any((source.path / name).is_file() for name in _TOKENIZER_FILES):
            raise ModelLoadError(f"{source.path} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}): copy the "
                                 "model's tokenizer files beside its weights")

    @classmethod
    def load(cls, source: ModelSource, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Reads tokenizer.json/tokenizer_config.json, or rebuilds the tokenizer from GGUF metadata."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        cls.check_files(source)
        try:
            if source.kind == "gguf":
                hf = _load_gguf_tokenizer(source.path)
            else:
                hf = AutoTokenizer.from_pretrained(source.path)
        except Exception as exc:  # transformers raises many kinds; all mean "cannot load"
            reason = " ".join(str(exc).split())  # one line: transformers' messages span several
            raise ModelLoadError(f"cannot load the tokenizer of {source.path}: {reason}") from None
        if not getattr(hf, "is_fast", False):
            raise ModelLoadError(f"the tokenizer of {source.path} has no fast (tokenizers) backend")
        return cls(hf, eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a raw prompt, with the BOS token if the model's tokenizer adds one (and
        `add_special_tokens`)."""
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (or `chat_template`,
        a Jinja template in its stead), ready for the reply (unless not `add_generation_prompt`),
        or open at the end of its last message (`continue_final_message`); `tools` (OpenAI's
        shape) are the template's to render, or to ignore if it does not know them;
        `template_kwargs` are variables of the template's own (Qwen3's enable_thinking)."""
        if (chat_template or self.hf.chat_template) is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        try:
            text = self.hf.apply_chat_template(list(messages), tokenize=False, tools=list(tools) if tools else None,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               chat_template=chat_template, **(template_kwargs or {}))
        except Exception as exc:  # jinja errors on malformed messages
            raise InvalidRequestError(f"cannot apply the chat template: {exc}") from None
        # The rendered template already holds any BOS it wants.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level BPE's `Ġ` for a space, ...)."""
        return [self._backend.id_to_token(t) or "" for t in token_ids]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    A token may end inside a multi-byte character, and how a token renders can depend on the
    one before it, so each delta is the difference of two decodes over a short sliding window;
    a window that ends in an incomplete character (U+FFFD) waits for the next token.
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
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
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip)
        new_text = decode(self._ids[self._prefix_offset:], skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
