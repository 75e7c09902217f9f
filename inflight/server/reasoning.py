"""A reasoning model's thinking, told apart from its answer (vLLM's `--reasoning-parser`): the text
a chat completion generates inside <think> ... </think> goes to the message's `reasoning` (and
`reasoning_content`, its older name, which llama.cpp's and SGLang's servers use), the rest to its
`content`. Two parsers, by vLLM's names:

- `qwen3`: an output that starts with <think> thinks until </think>; one that does not (Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an empty thought in
  the prompt) is all answer;
- `deepseek_r1`: the output thinks until </think> whether or not it opens with <think> (the
  DeepSeek-R1 distills and Qwen3's thinking-only models open the thought in the prompt).

A thought cut short by `max_tokens` is all reasoning. Streamed and whole outputs are split by the
same code (`ReasoningSplitter`), so their parts are equal; a marker may arrive split over deltas.

Structured output (a JSON schema, a regex, a tool call's arguments) constrains the answer only, as
vLLM applies it beside a reasoning parser: the thought runs free and the grammar starts after
</think> (`think_markers`; the engine's `Grammar.after_thinking`). That needs the markers as
tokens of the vocabulary, as Qwen3's and the R1 distills' are; without them a qwen3 output cannot
open a thought and is constrained whole, and deepseek_r1's structured requests are refused (its
answer would begin after a </think> the model cannot write as one token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.request import ThinkMarkers
from inflight.server.tools import partial_suffix

if TYPE_CHECKING:
    from inflight.model.tokenizer import Tokenizer

REASONING_PARSERS = ("qwen3", "deepseek_r1")
_START, _END = "<think>", "</think>"


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

    @classmethod
    def split(cls, parser: str, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning and content, each None where there is none."""
        splitter = cls(parser)
        (r1, c1), (r2, c2) = splitter.feed(text), splitter.end()
        return (r1 + r2) or None, (c1 + c2) or None


def think_markers(parser: str, tokenizer: Tokenizer) -> ThinkMarkers | None:
    """The parser's thought markers as the vocabulary's tokens, or None where <think> or </think>
    is not one token of it."""
    ids = []
    for marker in (_START, _END):
        token = tokenizer.hf.convert_tokens_to_ids(marker)
        if not isinstance(token, int) or tokenizer.encode(marker, add_special_tokens=False) != [token]:
            return None
        ids.append(token)
    return ThinkMarkers(ids[0], ids[1], opens=parser == "qwen3")
