"""OpenAI-compatible request and response bodies (the subset inflight serves).

Requests are validated strictly (a string is not a number; but 16.0 is the integer 16, as
JSON has one number type) and unknown fields are ignored, as OpenAI clients send fields a
server may not know. Fields inflight cannot honour (`n > 1`, `echo` in chat, tools, JSON
mode, guided decoding, ...) are refused rather than silently ignored, unless they
hold their no-op value, which clients often send; the schema lists the values each accepts.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_serializer,
    model_validator,
)

from inflight.request import MAX_LOGPROBS

MAX_N = 16  # samples per prompt


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Constraints live in the types, so the published OpenAPI schema carries them and a fuzzer
# explores the edges the server really has. An integer is JSON Schema's: 16 or 16.0, not 16.5
# (constraints go before the validator, so that the schema shows them).
_AsInt = BeforeValidator(_integral)
Int = Annotated[int, _AsInt]
PositiveInt = Annotated[int, Field(ge=1), _AsInt]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), _AsInt]], Field(min_length=1)]
# A list of prompts: each its own engine request, so that they batch.
MAX_PROMPTS = 256
_Batch = Field(min_length=1, max_length=MAX_PROMPTS)


# Unions are discriminated by the JSON type of the input, so that an error names what is wrong
# with the alternative the client meant, rather than "not a string" for a list.
def _prompt_kind(value: Any) -> str | None:
    """The union member a prompt is meant as, told by its JSON type (and its first item)."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        first = value[0] if value else None
        if isinstance(first, str):
            return "list[str]"
        return "list[list[int]]" if isinstance(first, list) else "list[int]"
    return None


def _stop_kind(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list[str]" if isinstance(value, list) else None


Prompt = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[TokenIds, Tag("list[int]")]
    | Annotated[list[Text], _Batch, Tag("list[str]")]
    | Annotated[list[TokenIds], _Batch, Tag("list[list[int]]")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="must be a string, a list of token ids, or a list of either"),
]
# Every stop string is searched for after every token, in the engine loop: a body full of them
# would slow every request in the batch, so their number is capped (OpenAI allows 4).
MAX_STOP_STRINGS = 16
Stop = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS), Tag("list[str]")],
    Discriminator(_stop_kind, custom_error_type="stop_type",
                  custom_error_message="must be a string or a list of strings"),
]
Penalty = Annotated[float, Field(ge=-2, le=2)]
MAX_STOP_TOKEN_IDS = 64
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0), _AsInt]], Field(max_length=MAX_STOP_TOKEN_IDS)]


def _only(*values: Any) -> Any:
    """A field whose other values are refused (with a clear message, by a validator): the
    schema names the accepted ones."""
    return Field(values[0], json_schema_extra={"enum": list(values)})


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), _AsInt] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Int | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    user: str | None = None
    # Extensions (vLLM's names). top_k -1 and 0 both mean off.
    top_k: Annotated[int, Field(ge=-1), _AsInt] | None = None
    ignore_eos: bool = False
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    stop_token_ids: StopTokenIds | None = None
    # Lower is more urgent; other than 0 only where the server runs --scheduling-policy priority.
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1), _AsInt] = 0
    # Token id (as a string, as OpenAI's clients send it) -> bias added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    min_tokens: Annotated[int, Field(ge=0), _AsInt] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    # Not implemented: accepted only with the value that changes nothing.
    response_format: dict[str, Any] | None = _only(None, {"type": "text"})
    guided_json: Any = _only(None)
    guided_regex: Any = _only(None)
    guided_choice: Any = _only(None)
    guided_grammar: Any = _only(None)

    @model_validator(mode="after")
    def _check_supported(self) -> GenerationRequest:
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError('response_format: only {"type": "text"} is supported (no JSON mode or schema)')
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias: keys must be token ids, got {key!r}")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: guided decoding is not supported")
        return self

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`. `prompt` is text or token ids (a batch of one is accepted)."""

    prompt: Prompt
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before the output
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _AsInt] | None = None
    suffix: str | None = _only(None, "")
    best_of: Int | None = _only(None, 1)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only best_of=1 is supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt, or the batch of prompts, as a list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [cast(list[int], p)]
        return [one for one in cast(list[str] | list[list[int]], p)]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def _content_kind(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list[TextPart]" if isinstance(value, list) else None


# Told apart by JSON type, so that an image part is reported as a part whose type is not "text".
Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TextPart], Tag("list[TextPart]")],
    Discriminator(_content_kind, custom_error_type="content_type",
                  custom_error_message="must be a string or a list of text parts"),
]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None

    def to_template(self) -> dict[str, str]:
        """The message as the chat template wants it: one role (developer is OpenAI's newer
        name for system) and plain text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _AsInt] | None = None
    tools: list[dict[str, object]] | None = _only(None, [])
    tool_choice: str | dict[str, object] | None = _only(None, "none", "auto")
    functions: list[dict[str, object]] | None = _only(None, [])
    echo: bool = _only(False)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.echo:
            raise ValueError("echo: echo is for /v1/completions; chat completions do not take it")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.tools or self.functions:
            raise ValueError(f"{'tools' if self.tools else 'functions'}: tool calls are not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: tool calls are not supported")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives to report per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses ---------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_output_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                   total_tokens=num_prompt_tokens + num_output_tokens)


FinishReasonName = Literal["stop", "length"] | None


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, its log-probability, the top alternatives' and where its
    text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _only_set(self) -> dict[str, str]:
        # OpenAI sends only the fields a delta carries: `{}` on the last chunk.
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class TokenizeRequest(_Strict):
    """`POST /tokenize` (vLLM's): a prompt, or chat messages rendered by the model's template."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only: the chat template holds its own
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    """`POST /detokenize` (vLLM's)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0), _AsInt]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "inflight"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
