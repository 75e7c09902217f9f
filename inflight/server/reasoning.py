"""A reasoning model's thinking, told apart from its answer (vLLM's `--reasoning-parser`): the text
a chat completion generates inside <think> ... </think> goes to the message's `reasoning` (and
`reasoning_content`, its older name, which llama.cpp's and SGLang's servers use), the rest to its
`content`. Three parsers, by vLLM's names:

- `qwen3`: an output that starts with <think> thinks until </think>; one that does not (Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an empty thought in
  the prompt) is all answer;
- `deepseek_r1`: the output thinks until </think> whether or not it opens with <think> (the
  DeepSeek-R1 distills and Qwen3's thinking-only models open the thought in the prompt);
- `openai_gptoss`: gpt-oss's harmony format, messages of `<|channel|>NAME<|message|>TEXT<|end|>`
  (a later one opened by `<|start|>assistant`): the `analysis` channel's text is the reasoning,
  the others' (`final`, `commentary`) the content, the markup neither. Its markers are special
  tokens, so its chats are detokenized with them (`HARMONY_PARSERS`). A message to a recipient
  (`to=functions.NAME`: a tool call) becomes, where the request has tools, the Hermes tags
  `<tool_call>{"name": NAME, "arguments": TEXT}</tool_call>` in the content, which the tool reader
  makes an OpenAI tool call of; without tools its text is content.

A thought cut short by `max_tokens` is all reasoning. Streamed and whole outputs are split by the
same code (`ReasoningSplitter`, `HarmonySplitter`), so their parts are equal; a marker may arrive
split over deltas.

Structured output (a JSON schema, a regex, a tool call's arguments) constrains the answer only, as
vLLM applies it beside a reasoning parser: the thought runs free and the grammar starts after
</think> (`think_markers`; the engine's `Grammar.after_thinking`). That needs the markers as
tokens of the vocabulary, as Qwen3's and the R1 distills' are; without them a qwen3 output cannot
open a thought and is constrained whole, and deepseek_r1's structured requests are refused (its
answer would begin after a </think> the model cannot write as one token).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from inflight.request import ThinkMarkers
from inflight.server.tools import HERMES_CLOSE, HERMES_OPEN, partial_suffix

if TYPE_CHECKING:
    from inflight.model.tokenizer import Tokenizer

REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
# The parsers whose markers are special tokens: their chats' text keeps them (skip_special_tokens off).
HARMONY_PARSERS = ("openai_gptoss",)
_START, _END = "<think>", "</think>"
_HARMONY_MESSAGE, _HARMONY_HEADS = "<|message|>", ("<|start|>", "<|channel|>")
_HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")  # in a header: the message's addressee, a tool


def _opens_header(text: str) -> bool:
    """Whether `text` begins a harmony message's header (or may, as far as it goes)."""
    return any(text.startswith(head) or head.startswith(text) for head in _HARMONY_HEADS)


def reasoning_splitter(parser: str, tool_calls: bool = False) -> ReasoningSplitter | HarmonySplitter:
    """The splitter of a `--reasoning-parser`; `tool_calls`: harmony's calls as Hermes tags."""
    return HarmonySplitter(tool_calls) if parser in HARMONY_PARSERS else ReasoningSplitter(parser)


def split_reasoning(parser: str, text: str, tool_calls: bool = False) -> tuple[str | None, str | None]:
    """A whole output's reasoning and content, each None where there is none."""
    splitter = reasoning_splitter(parser, tool_calls)
    (r1, c1), (r2, c2) = splitter.feed(text), splitter.end()
    return (r1 + r2) or None, (c1 + c2) or None


class ReasoningSplitter:
    """Splits one choice's text, delta by delta, into (reasoning, content) pieces."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self._thinks_unopened = parser == "deepseek_r1"
        self._state = "opening"  # then "thinking" or "answering"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content `text` completes; a tail that may be the start of a
        marker is held until the next piece shows what it is."""
        self._held += text
        reasoning = content = ""
        while self._held:
            if self._state == "opening":
                if self._held.startswith(_START):
                    self._held = self._held[len(_START):]
                    self._state = "thinking"
                elif _START.startswith(self._held):
                    break  # may still become <think>
                else:
                    self._state = "thinking" if self._thinks_unopened else "answering"
            elif self._state == "thinking":
                end = self._held.find(_END)
                if end >= 0:
                    reasoning += self._held[:end]
                    self._held = self._held[end + len(_END):]
                    self._state = "answering"
                    continue
                keep = partial_suffix(self._held, _END)
                reasoning += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                break
            else:
                content += self._held
                self._held = ""
        return reasoning, content

    def end(self) -> tuple[str, str]:
        """What is still held, once the output has ended: no marker will complete it."""
        held, self._held = self._held, ""
        if self._state == "opening":
            self._state = "thinking" if self._thinks_unopened else "answering"
        return (held, "") if self._state == "thinking" else ("", held)


class HarmonySplitter:
    """Splits one choice's harmony text (gpt-oss), delta by delta, into (reasoning, content)
    pieces: each message's header (`<|start|>assistant<|channel|>NAME ...`) is read up to
    `<|message|>` and dropped, its text goes where its channel says up to the marker that ends it
    (`<|end|>`; `<|return|>` and `<|call|>` too, where a request keeps its stop tokens). An
    output that does not open with markup is all content. With `tool_calls`, a message to a
    recipient (`to=functions.NAME`) is written into the content as a Hermes tool call."""

    def __init__(self, tool_calls: bool = False) -> None:
        self._state = "header"  # then "reasoning", "content" (a message's text), or "plain"
        self._held = ""
        self._tool_calls = tool_calls
        self._closing = ""  # what closes the current message's text in the content (a call's tags)

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        out = {"reasoning": "", "content": ""}
        while self._held:
            if self._state == "plain":
                out["content"] += self._held
                self._held = ""
            elif self._state == "header":
                if not _opens_header(self._held):
                    self._state = "plain"  # text without markup
                    continue
                at = self._held.find(_HARMONY_MESSAGE)
                if at < 0:
                    break  # the header goes on
                header = self._held[:at]
                channel = header.partition("<|channel|>")[2].split(" ", 1)[0].split("<|", 1)[0]
                self._state = "reasoning" if channel == "analysis" else "content"
                recipient = _HARMONY_RECIPIENT.search(header)
                if self._tool_calls and recipient is not None and channel != "analysis":
                    name = recipient.group(1).removeprefix("functions.")
                    out["content"] += f'{HERMES_OPEN}{{"name": {json.dumps(name)}, "arguments": '
                    self._closing = f"}}{HERMES_CLOSE}"
                self._held = self._held[at + len(_HARMONY_MESSAGE):]
            else:
                ends = [(at, marker) for marker in _HARMONY_ENDS if (at := self._held.find(marker)) >= 0]
                if ends:
                    at, marker = min(ends)
                    out[self._state] += self._held[:at] + (self._closing if self._state == "content" else "")
                    self._held, self._closing = self._held[at + len(marker):], ""
                    self._state = "header"
                    continue
                keep = max(partial_suffix(self._held, marker) for marker in _HARMONY_ENDS)
                out[self._state] += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                break
        return out["reasoning"], out["content"]

    def end(self) -> tuple[str, str]:
        """What is still held once the output has ended: a message's text cut short goes where
        its channel says; a header cut short is markup, dropped."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "content":  # a call's text ends with the output (its <|call|> a stop token)
            held, self._closing = held + self._closing, ""
        return ("", "") if self._state == "header" and _opens_header(held) else ("", held)


def think_markers(parser: str, tokenizer: Tokenizer) -> ThinkMarkers | None:
    """The parser's thought markers as the vocabulary's tokens, or None where <think> or </think>
    is not one token of it (harmony's: none, its answer opening with several tokens)."""
    if parser in HARMONY_PARSERS:
        return None
    ids = []
    for marker in (_START, _END):
        token = tokenizer.hf.convert_tokens_to_ids(marker)
        if not isinstance(token, int) or tokenizer.encode(marker, add_special_tokens=False) != [token]:
            return None
        ids.append(token)
    return ThinkMarkers(ids[0], ids[1], opens=parser == "qwen3")
