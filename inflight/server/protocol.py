"""OpenAI-compatible request and response bodies (the subset inflight serves).

Requests are validated strictly (a string is not a number; but 16.0 is the integer 16, as
JSON has one number type) and unknown fields are ignored, as OpenAI clients send fields a
server may not know. Fields inflight cannot honour (`echo` in chat, `suffix`, `best_of`, ...)
are refused rather than silently ignored, unless they hold their no-op value, which clients
often send; the schema lists the values each accepts.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    model_serializer,
    model_validator,
)

from inflight.errors import InvalidRequestError
from inflight.request import MAX_LOGPROBS, StructuredOutputs

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
MAX_STOP_TOKEN_IDS = 64
StopTokenIds = Annotated[list[Annotated[int, _AsInt]], Field(max_length=MAX_STOP_TOKEN_IDS)]


def _only(*values: Any) -> Any:
    """A field whose other values are refused (with a clear message, by a validator): the
    schema names the accepted ones."""
    return Field(values[0], json_schema_extra={"enum": list(values)})


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far (guidellm asks it).
    continuous_usage_stats: bool = False


# --- structured output -------------------------------------------------------------------------

JsonSchemaBody = dict[str, Any] | Text  # an object, or its JSON text


class JsonSchemaFormat(_Strict):
    name: str | None = None  # OpenAI requires one; it changes nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that matches a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise InvalidRequestError('type "json_schema" needs json_schema.schema', "response_format")
        return self


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: JsonSchemaBody | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


def _structured(field: str, json_schema: Any = None, json_object: bool = False, regex: str | None = None,
                choice: list[str] | None = None, grammar: str | None = None) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=json_schema, json_object=json_object, regex=regex,
                                 choice=tuple(choice) if choice is not None else None, grammar=grammar)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), field) from None


# vLLM's request fields whose other values than the default inflight does not compute, and what
# a request that sets one is told.
_UNSUPPORTED = {
    "use_beam_search": "beam search is not supported; sample n outputs instead",
    "allowed_token_ids": "allowed_token_ids is not supported; send a structured output constraint (guided_choice, "
                         "guided_regex) or logit_bias",
    "bad_words": "bad_words is not supported; send logit_bias against their tokens",
    "spaces_between_special_tokens": "only true is supported",
    "chat_template": "a request's own chat template is not accepted; start the server with --chat-template",
    "documents": "documents are not supported",
}
# apply_chat_template's own arguments, which chat_template_kwargs may not set.
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                 "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                 "truncation", "max_length", "return_tensors", "return_dict",
                                 "return_assistant_tokens_mask", "tokenizer_kwargs"})


class GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # absent or empty: the served model (vLLM's and llama.cpp's servers alike)
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(le=MAX_N), _AsInt] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    # Extensions (vLLM's names). top_k -1 and 0 both mean off.
    top_k: Int | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: StopTokenIds | None = None
    # Lower is more urgent; other than 0 only where the server runs --scheduling-policy priority.
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1), _AsInt] = 0
    # Token id (as a string, as OpenAI's clients send it) -> bias added to its logit.
    logit_bias: dict[str, float] | None = None
    min_tokens: Int = 0
    min_p: float | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older
    # guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: JsonSchemaBody | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    # vLLM's output options: the stop string that ended the output kept at its end; the special
    # tokens' text kept in the output.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: only the prompt's last k tokens (-1: as many as max_model_len holds).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), _AsInt] | None = None
    # vLLM's fields inflight does not compute: refused unless at their no-op value (_UNSUPPORTED).
    # vLLM's: each prompt token's log-probability, rank and this many alternatives (completions:
    # per choice; chat: the response's), the first token's None. Not with stream, as in vLLM.
    prompt_logprobs: Int | None = None
    use_beam_search: bool = _only(False)
    allowed_token_ids: list[int] | None = _only(None)
    bad_words: list[str] | None = _only(None)
    spaces_between_special_tokens: bool = _only(True)
    _constraint: StructuredOutputs | None = PrivateAttr(None)
    _constraint_field: str | None = PrivateAttr(None)

    def truncated(self, token_ids: list[int], max_model_len: int | None) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: `max_model_len`'s worth, or the
        whole prompt where that is not known), as vLLM cuts it; the whole prompt where the request
        does not ask."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            keep = max_model_len
        return token_ids[-keep:] if keep is not None and len(token_ids) > keep else token_ids

    @model_validator(mode="after")
    def _check_supported(self) -> GenerationRequest:
        for name, message in _UNSUPPORTED.items():
            if name in type(self).model_fields and getattr(self, name) != type(self).model_fields[name].default:
                raise InvalidRequestError(message, name)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"must be an integer in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs are not available with stream: true (as in vLLM); send "
                                      "echo: true with logprobs for a streamed completion", "prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequestError("must be >= 1, or -1 for as many as max_model_len holds",
                                      "truncate_prompt_tokens")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(f"keys must be token ids, got {key!r}", "logit_bias")
        given = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise InvalidRequestError(f"give one structured output constraint, not {' and '.join(given)}", given[1])
        self._constraint = self._parse_constraint()
        self._constraint_field = given[0] if given else None
        return self

    def _parse_constraint(self) -> StructuredOutputs | None:
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return _structured("response_format", json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            assert fmt.json_schema is not None
            return _structured("response_format", json_schema=fmt.json_schema.schema_)
        so = self.structured_outputs
        if so is not None:
            return _structured("structured_outputs", so.json_, bool(so.json_object), so.regex, so.choice, so.grammar)
        if self.guided_json is not None:
            return _structured("guided_json", json_schema=self.guided_json)
        if self.guided_regex is not None or self.guided_choice is not None or self.guided_grammar is not None:
            field = "guided_regex" if self.guided_regex is not None else "guided_choice" if self.guided_choice \
                is not None else "guided_grammar"
            return _structured(field, regex=self.guided_regex, choice=self.guided_choice, grammar=self.guided_grammar)
        return None

    @property
    def constraint(self) -> StructuredOutputs | None:
        """The structured output asked for, whichever field asked."""
        return self._constraint

    @property
    def constraint_field(self) -> str:
        """The field that asked for `constraint` (to name in an error)."""
        return self._constraint_field or "response_format"

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`. `prompt` is text or token ids (a batch of one is accepted)."""

    prompt: Prompt
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before the output
    logprobs: Int | None = None
    suffix: str | None = _only(None, "")
    best_of: Int | None = _only(None, 1)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", "best_of")
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn, sent back by the client."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_template(self) -> dict[str, Any]:
        # Chat templates read arguments as a mapping (transformers' convention); OpenAI sends JSON text.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call they answer

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template wants it: one role (developer is OpenAI's newer
        name for system), plain text, and the tool calls or the call answered, if any."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionDefinition(_Strict):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None

    @property
    def parameter_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates take them (OpenAI's shape), or None."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class FunctionName(_Strict):
    name: ToolName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `"required"`'s output: an array of calls, each to one of `tools`."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": t.function.parameter_schema},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    # Default: "auto" when there are tools, else "none" (OpenAI's).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, object]] | None = _only(None, [])  # OpenAI's deprecated form of tools
    echo: bool = _only(False)
    # vLLM's: the template's reply opening (default), or the last (assistant) message continued;
    # extra variables for the template (Qwen3's enable_thinking).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = _only(None)
    documents: list[dict[str, Any]] | None = _only(None)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.echo:
            raise InvalidRequestError("echo is for /v1/completions; chat completions do not take it", "echo")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("needs logprobs: true", "top_logprobs")
        if self.functions:
            raise InvalidRequestError("the deprecated functions field is not supported; send tools", "functions")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message; send it with "
                                      "add_generation_prompt: false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError("continue_final_message needs the last message to be the assistant's",
                                      "continue_final_message")
        reserved = sorted(_TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise InvalidRequestError(f"{', '.join(reserved)} cannot be set through chat_template_kwargs; "
                                      "send the request's own field", "chat_template_kwargs")
        tools = self.tools or []
        names = [t.function.name for t in tools]
        if len(set(names)) < len(names):
            raise InvalidRequestError("function names must be distinct", "tools")
        mode = self.tool_mode
        if mode in ("required", "named") and not tools:
            raise InvalidRequestError("a required or named tool choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise InvalidRequestError(f"no tool is named {self.tool_choice.function.name!r}", "tool_choice")
        if mode in ("required", "named"):
            if self._constraint is not None:
                raise InvalidRequestError(f"a structured output constraint cannot go with tool_choice {mode!r}, "
                                          "which constrains the output itself", self.constraint_field)
            self._constraint = _structured("tool_choice", json_schema=self._tool_schema())
            self._constraint_field = "tool_choice"
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tools are used: not at all, as the model decides, at least one call, or one call
        to the named function."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    @property
    def named_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def _tool_schema(self) -> dict[str, Any]:
        tools = self.tools or []
        if self.named_function is not None:
            return next(t.function.parameter_schema for t in tools if t.function.name == self.named_function)
        return required_schema(tools, self.parallel_tool_calls)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)

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


FinishReasonName = Literal["stop", "length", "tool_calls"] | None


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, its log-probability, the top alternatives' and where its
    text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one token of a prompt position's entry (keyed by the token's id)."""

    logprob: float
    rank: int | None
    decoded_token: str


# Per prompt token, its id and the alternatives' (as strings) to their PromptLogprob; None first.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With --reasoning-parser: the model's thinking (vLLM's `reasoning`; `reasoning_content` is its
    # older name, llama.cpp's and SGLang's). Sent only where a parser runs.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _without_unparsed_reasoning(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if "reasoning" not in self.model_fields_set:
            out.pop("reasoning", None)
            out.pop("reasoning_content", None)
        return out


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
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: its first carries `id`, `type` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser, also sent as reasoning_content
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        # OpenAI sends only the fields a delta carries: `{}` on the last chunk.
        out: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        return out


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
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None  # messages only, for the template
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
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
