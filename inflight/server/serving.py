"""Completions and chat completions: validate, submit to the engine, stream or collect.

A request is fully checked before it reaches the engine (tokenized, its sampling parameters
built, its size checked against the context and the KV pool), so a bad request costs the
engine nothing and never disturbs others. Tokenizing runs in a worker thread: a prompt near
the body limit takes a noticeable fraction of a second, which would stall every stream if it
ran on the event loop. The tokenizer is only read, so this is safe beside the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from inflight.engine.slo import LateRequestError
from inflight.errors import EngineOverloadedError, InvalidRequestError
from inflight.model.tokenizer import Tokenizer
from inflight.request import FinishReason, Grammar, SamplingParams, ThinkMarkers, TokenLogprobs
from inflight.server.async_engine import (
    AsyncEngine,
    EngineFailedError,
    EngineShutdownError,
    EngineUnavailableError,
)
from inflight.server.config import ServerConfig
from inflight.server.errors import APIError, error_event, invalid
from inflight.server.metrics import ServerMetrics
from inflight.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FinishReasonName,
    GenerationRequest,
    PromptLogprob,
    PromptLogprobs,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    TopLogprob,
    UsageInfo,
    template_tools,
)
from inflight.server.reasoning import (
    HARMONY_PARSERS,
    HarmonySplitter,
    ReasoningSplitter,
    reasoning_splitter,
    split_reasoning,
    think_markers,
)
from inflight.server.stream import Delta, RequestStream
from inflight.server.tools import (
    SPECIAL_TOKEN_MODES,
    StringArgs,
    ToolCallReader,
    ToolMode,
    string_args,
    tool_call_format,
)

Logprobs = list[TokenLogprobs]


class _Format(Protocol):
    """How one endpoint shapes its chunks and its whole response from a choice's deltas;
    `index` is the choice's."""

    def opening(self, num_choices: int) -> list[BaseModel]: ...
    def chunk(self, index: int, delta: Delta) -> BaseModel | None: ...
    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...
    def usage_so_far(self, delta: Delta) -> UsageInfo: ...
    def response(self, choices: list[list[Delta]], usage: UsageInfo) -> BaseModel: ...


# JSON has no -inf: a log-probability that underflows is reported as this, as vLLM does.
_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _prompt_logprobs(tokenizer: Tokenizer, deltas: list[Delta], k: int) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per token its
    id and its `k` most likely alternatives', each to its log-probability, rank and text."""
    found = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    if found is None:
        return None

    def one(token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=_lp(logprob), rank=rank,
                             decoded_token=tokenizer.decode([token_id], skip_special_tokens=False))

    entries: PromptLogprobs = [None]
    for lp in found:
        entry = {str(t): one(t, v, i + 1) for i, (t, v) in enumerate(lp.top[:k])}
        entry.setdefault(str(lp.token_id), one(lp.token_id, lp.logprob, lp.rank))
        entries.append(entry)
    return entries


def _token_logprobs(deltas: list[Delta]) -> Logprobs | None:
    found = [d.logprobs for d in deltas if d.logprobs is not None]
    return found or None


class _CompletionFormat:
    """With `echo`, each choice starts with its prompt (text as sent, or decoded from ids) and,
    where logprobs are asked for, the prompt tokens' logprobs, the first one null. `prompt_only`
    (echo with max_tokens 0): the prompt alone, what the engine generated left out."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer,
                 echo: list[tuple[str, list[int]]] | None = None, prompt_only: bool = False,
                 num_top: int = 0, prompt_top: int | None = None) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.tokenizer = tokenizer
        self.echo = echo
        self.prompt_only = prompt_only
        self.num_top = num_top  # the alternatives `logprobs` asks for (echoed prompt tokens included)
        self.prompt_top = prompt_top  # vLLM's prompt_logprobs, if asked
        self._offsets: dict[int, int] = {}  # per choice, where the next token's text starts

    def opening(self, num_choices: int) -> list[BaseModel]:
        return []

    def _logprobs(self, index: int, entries: list[tuple[int, TokenLogprobs | None]]) -> CompletionLogprobs:
        """entries: (token id, its logprobs, or None for the prompt's first token)."""
        tok = self.tokenizer
        tokens = [tok.decode([t], skip_special_tokens=False) for t, _ in entries]
        offsets, at = [], self._offsets.get(index, 0)
        for text in tokens:
            offsets.append(at)
            at += len(text)
        self._offsets[index] = at
        return CompletionLogprobs(
            tokens=tokens, text_offset=offsets,
            token_logprobs=[None if lp is None else _lp(lp.logprob) for _, lp in entries],
            top_logprobs=[None if lp is None else {tok.decode([t], skip_special_tokens=False): _lp(v)
                                                   for t, v in lp.top[:self.num_top]} for _, lp in entries])

    def _piece(self, index: int, deltas: list[Delta], first: bool) -> CompletionChoice:
        text = "" if self.prompt_only else "".join(d.text for d in deltas)
        logprobs = _token_logprobs(deltas)
        entries: list[tuple[int, TokenLogprobs | None]] = [] if self.prompt_only else [
            (lp.token_id, lp) for lp in logprobs or []]
        if first and self.echo is not None:
            prompt_text, prompt_ids = self.echo[index]
            text = prompt_text + text
            prompt_lps = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
            if prompt_lps is not None:
                entries = [(prompt_ids[0], None), *((lp.token_id, lp) for lp in prompt_lps), *entries]
                logprobs = logprobs or []
        finish = _finish_name(deltas[-1].finish_reason) if deltas else None
        if self.prompt_only and finish is not None:
            finish = "length"  # its max_tokens (0) reached
        prompt_logprobs = None
        if first and self.prompt_top is not None:
            prompt_logprobs = _prompt_logprobs(self.tokenizer, deltas, self.prompt_top)
        return CompletionChoice(index=index, text=text, finish_reason=finish, prompt_logprobs=prompt_logprobs,
                                logprobs=self._logprobs(index, entries) if logprobs is not None else None)

    def chunk(self, index: int, delta: Delta) -> BaseModel | None:
        first = delta.num_output_tokens <= delta.num_new_tokens  # the choice's first delta
        if not (delta.text or delta.finished or delta.logprobs is not None or (first and self.echo)):
            return None
        return CompletionResponse(id=self.id, model=self.model, created=self.created,
                                  choices=[self._piece(index, [delta], first)])

    def _usage(self, usage: UsageInfo) -> UsageInfo:
        return UsageInfo.of(usage.prompt_tokens, 0) if self.prompt_only else usage

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.id, model=self.model, created=self.created, choices=[],
                                  usage=self._usage(usage))

    def usage_so_far(self, delta: Delta) -> UsageInfo:
        return self._usage(UsageInfo.of(delta.num_prompt_tokens, delta.num_output_tokens))

    def response(self, choices: list[list[Delta]], usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.id, model=self.model, created=self.created, usage=self._usage(usage),
                                  choices=[self._piece(i, deltas, True) for i, deltas in enumerate(choices)])


class _ChatFormat:
    """With tools in use (`tools`: the reader's mode, the named function and the tools' string
    parameters), each choice's text
    goes through its own `ToolCallReader`, which makes tool calls of it. With a `reasoning_parser`,
    each choice's text is first split into its thinking and its answer (`ReasoningSplitter`); the
    answer alone goes on to the tool reader."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer,
                 tools: tuple[ToolMode, str | None, StringArgs] | None = None, reasoning_parser: str | None = None,
                 prompt_top: int | None = None) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.tokenizer = tokenizer
        self.tools = tools
        self.reasoning_parser = reasoning_parser
        self.prompt_top = prompt_top  # vLLM's prompt_logprobs, if asked: the response's, not a choice's
        self._readers: dict[int, ToolCallReader] = {}
        self._splitters: dict[int, ReasoningSplitter | HarmonySplitter] = {}

    def _split(self, index: int, text: str, finished: bool) -> tuple[str | None, str]:
        """A streamed piece's thinking (None without a parser) and answer."""
        if self.reasoning_parser is None:
            return None, text
        if index not in self._splitters:
            self._splitters[index] = reasoning_splitter(self.reasoning_parser, self.tools is not None)
        splitter = self._splitters[index]
        reasoning, content = splitter.feed(text)
        if finished:
            more_reasoning, more_content = splitter.end()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _reader(self, index: int) -> ToolCallReader | None:
        if self.tools is None:
            return None
        if index not in self._readers:
            self._readers[index] = ToolCallReader(*self.tools)
        return self._readers[index]

    def opening(self, num_choices: int) -> list[BaseModel]:
        # OpenAI sends each choice's role alone first, with empty content.
        role = DeltaMessage(role="assistant", content="")
        return [ChatCompletionChunk(id=self.id, model=self.model, created=self.created,
                                    choices=[ChatChunkChoice(index=i, delta=role)]) for i in range(num_choices)]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return TopLogprob(token=text, logprob=_lp(logprob), bytes=list(text.encode("utf-8", errors="replace")))

    def _logprobs(self, logprobs: Logprobs | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            chosen = self._top(lp.token_id, lp.logprob)
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[self._top(t, v) for t, v in lp.top]))
        return ChatLogprobs(content=content)

    @staticmethod
    def _finish(reason: FinishReason | None, reader: ToolCallReader | None) -> FinishReasonName:
        # OpenAI: "tool_calls" when the model chose to call (auto, required); a named call stops.
        if reader is not None and reader.mode != "named" and reader.num_calls and reason is FinishReason.STOP:
            return "tool_calls"
        return _finish_name(reason)

    def chunk(self, index: int, delta: Delta) -> BaseModel | None:
        reader = self._reader(index)
        reasoning, content = self._split(index, delta.text, delta.finished)
        calls = list[DeltaToolCall]()
        if reader is not None:
            content, calls = reader.feed(content)
            if delta.finished:
                tail, more = reader.end()
                content, calls = content + tail, calls + more
        if not (content or reasoning or calls or delta.finished or delta.logprobs is not None):
            return None
        message = DeltaMessage(content=content or None, reasoning=reasoning or None, tool_calls=calls or None)
        logprobs = self._logprobs([delta.logprobs] if delta.logprobs is not None else None)
        return ChatCompletionChunk(id=self.id, model=self.model, created=self.created, choices=[
            ChatChunkChoice(index=index, delta=message, finish_reason=self._finish(delta.finish_reason, reader),
                            logprobs=logprobs)])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionChunk(id=self.id, model=self.model, created=self.created, choices=[], usage=usage)

    def usage_so_far(self, delta: Delta) -> UsageInfo:
        return UsageInfo.of(delta.num_prompt_tokens, delta.num_output_tokens)

    def _choice(self, index: int, deltas: list[Delta]) -> ChatChoice:
        text = "".join(d.text for d in deltas)
        reader = self._reader(index)
        content: str | None = text
        calls: list[ToolCall] = []
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, content = split_reasoning(self.reasoning_parser, text, self.tools is not None)
        if reader is not None:
            content, calls = reader.whole(content or "")
            reader.num_calls = len(calls)
        message = ChatMessageOut(content=content, tool_calls=calls)
        if self.reasoning_parser is not None:  # the fields are sent only where a parser runs
            message.reasoning = message.reasoning_content = reasoning
        return ChatChoice(index=index, message=message,
                          finish_reason=self._finish(deltas[-1].finish_reason, reader),
                          logprobs=self._logprobs(_token_logprobs(deltas)))

    def response(self, choices: list[list[Delta]], usage: UsageInfo) -> BaseModel:
        prompt_logprobs = None
        if self.prompt_top is not None and choices:  # the n samples share one prompt
            prompt_logprobs = _prompt_logprobs(self.tokenizer, choices[0], self.prompt_top)
        return ChatCompletionResponse(id=self.id, model=self.model, created=self.created, usage=usage,
                                      choices=[self._choice(i, deltas) for i, deltas in enumerate(choices)],
                                      prompt_logprobs=prompt_logprobs)


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that calls `on_close` once, however it ends. When the client
    disconnects, Starlette cancels the sending task, and the body generator may be left
    suspended at a `yield` where its own `finally` would not run until garbage collection."""

    def __init__(self, content: AsyncIterator[Any], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(model: BaseModel, exclude_usage: bool = False) -> str:
    return f"data: {model.model_dump_json(exclude={'usage'} if exclude_usage else None)}\n\n"


_DONE = "data: [DONE]\n\n"


def _finish_name(reason: FinishReason | None) -> FinishReasonName:
    if reason is FinishReason.STOP:
        return "stop"
    return "length" if reason is FinishReason.LENGTH else None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, config: ServerConfig) -> None:
        self.engine = engine
        self.metrics = metrics
        self.config = config
        self.model_name = config.served_model_name or engine.model_name
        self._think_markers: ThinkMarkers | None = None  # the tokenizer's, once found (`_after_thinking`)

    async def completion(self, req: CompletionRequest, http: Request) -> Response:
        """One engine request per prompt of the batch (so that they batch), choices in order."""
        arrival = time.perf_counter()
        self._check_model(req.model)
        prompts = req.prompts
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_num_chars(len(prompt), "prompt")
        try:
            token_ids = await asyncio.to_thread(lambda: [self.engine.tokenize(p) for p in prompts])
        except InvalidRequestError as exc:
            raise invalid(str(exc), "prompt") from None
        if not all(token_ids):
            raise invalid("the prompt is empty", "prompt")
        whole = token_ids
        token_ids = [req.truncated(ids, self.engine.max_model_len) for ids in token_ids]
        # The prompt's logprobs for echo (its `logprobs` alternatives) and for vLLM's prompt_logprobs
        # (its own count): one computation, of the larger count; each reports its own.
        asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        prompt_logprobs = max(asked) if asked else None
        # Echo with max_tokens 0, OpenAI's form for scoring a prompt (as vLLM takes it): the prompt
        # and its logprobs, nothing generated. The engine samples one token, which is left out.
        prompt_only = req.echo and req.max_tokens == 0
        max_tokens = 1 if prompt_only else req.max_tokens
        work = [(ids, self._sampling_params(req, max_tokens, len(ids), "prompt", req.logprobs, prompt_logprobs))
                for ids in token_ids]
        streams = await self._submit(work, arrival, "cmpl", req.priority, await self._grammar(req))
        tokenizer = self.engine.tokenizer
        echo = None
        if req.echo:  # the prompt as sent, or decoded from its (kept) ids; the same for each of its n choices
            echo = [(p if isinstance(p, str) and ids is all_ids else tokenizer.decode(ids), ids)
                    for p, ids, all_ids in zip(prompts, token_ids, whole, strict=True) for _ in range(req.n)]
        fmt = _CompletionFormat(streams[0].request_id, self.model_name, tokenizer, echo, prompt_only,
                                req.logprobs or 0, req.prompt_logprobs)
        return await self._respond(streams, fmt, req, http)

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        arrival = time.perf_counter()
        self._check_model(req.model)
        messages = [m.to_template() for m in req.messages]
        # The template only adds text around the contents (roles, markers), so the contents
        # alone bound the rendered prompt from below.
        self._check_num_chars(sum(len(m["content"]) for m in messages), "messages")
        tokenizer = self.engine.tokenizer
        tools = self._tool_reading(req, self.config.chat_template or tokenizer.hf.chat_template,
                                   self.config.reasoning_parser)
        try:
            token_ids = await asyncio.to_thread(
                tokenizer.apply_chat_template, messages, req.add_generation_prompt, req.template_tools(),
                self.config.chat_template, req.continue_final_message, req.chat_template_kwargs)
        except InvalidRequestError as exc:
            raise invalid(str(exc), "messages") from None
        token_ids = req.truncated(token_ids, self.engine.max_model_len)
        params = self._sampling_params(req, req.requested_max_tokens, len(token_ids), "messages", req.num_logprobs,
                                       req.prompt_logprobs)
        if self.config.reasoning_parser in HARMONY_PARSERS or (tools is not None and tools[0] in SPECIAL_TOKEN_MODES):
            # its markers are special tokens: the parser reads them
            params = dataclasses.replace(params, skip_special_tokens=False)
        grammar = await self._grammar(req)
        if grammar is not None and self.config.reasoning_parser is not None:
            grammar = self._after_thinking(grammar, req)
        streams = await self._submit([(token_ids, params)], arrival, "chatcmpl", req.priority, grammar)
        fmt = _ChatFormat(streams[0].request_id, self.model_name, tokenizer, tools, self.config.reasoning_parser,
                          req.prompt_logprobs)
        return await self._respond(streams, fmt, req, http)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self._check_model(req.model)
        tokenizer = self.engine.tokenizer
        try:
            if req.messages is not None:
                messages = [m.to_template() for m in req.messages]
                self._check_num_chars(sum(len(m["content"]) for m in messages), "messages")
                ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, req.add_generation_prompt,
                                              template_tools(req.tools), self.config.chat_template)
            else:
                assert req.prompt is not None
                self._check_num_chars(len(req.prompt), "prompt")
                ids = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens)
        except InvalidRequestError as exc:
            raise invalid(str(exc), "messages" if req.messages is not None else "prompt") from None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                token_strs=tokenizer.token_strings(ids) if req.return_token_strs else None)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(req.model)
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise invalid(f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.engine.tokenizer.decode, req.tokens))

    # --- validation -----------------------------------------------------------------------------

    @staticmethod
    def _tool_reading(req: ChatCompletionRequest, chat_template: str | None,
                      reasoning_parser: str | None = None) -> tuple[ToolMode, str | None, StringArgs] | None:
        """How the chat's output becomes tool calls (None: it does not): the reader's mode, the
        named function, the tools' string parameters; a 400 for "auto" where the model's chat
        template does not teach a tool-call format inflight reads. Under a harmony parser the
        calls are harmony's, which its splitter writes as Hermes tags."""
        mode = req.tool_mode
        if mode == "none":
            return None
        strings = string_args(req.tools)
        if mode == "auto" and reasoning_parser in HARMONY_PARSERS:
            return "hermes", None, strings
        if mode == "auto":
            found = tool_call_format(chat_template)
            if found is None:
                raise invalid('tool_choice "auto" (the default with tools): this model\'s chat template does not '
                              "render tools in a tool-call format inflight reads (Hermes' <tool_call>, Llama 3's "
                              "JSON, LFM2's <|tool_call_start|>, GLM's <arg_key>, DeepSeek's <｜tool▁calls▁begin｜>); "
                              'send tool_choice "required", a named function, or "none"', "tool_choice")
            return found, None, strings
        return mode, req.named_function, strings

    def _check_model(self, model: str | None) -> None:
        """A request names the served model, or none (vLLM's servers take a missing or empty one)."""
        if model and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def _check_num_chars(self, num_chars: int, param: str) -> None:
        """Refuses, without tokenizing, a text too long to fit the context whatever its tokens."""
        limit = self.engine.max_prompt_chars
        if num_chars > limit:
            raise invalid(f"the prompt is too long: {num_chars} characters cannot fit in max_model_len "
                          f"({self.engine.max_model_len}) tokens (the limit is {limit} characters)", param)

    def _sampling_params(self, req: GenerationRequest, max_tokens: int | None, num_prompt_tokens: int,
                         prompt_param: str, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        room = self.engine.max_model_len - num_prompt_tokens
        # Blame the prompt unless the client's own max_tokens is what does not fit.
        blamed = "max_tokens" if max_tokens is not None and room >= 1 else prompt_param
        if max_tokens is None:
            if room < 1:
                raise invalid(f"the prompt ({num_prompt_tokens} tokens) leaves no room for output within "
                              f"max_model_len ({self.engine.max_model_len})", prompt_param)
            max_tokens = min(self.config.default_max_tokens, room,
                             self.engine.default_sampling.get("max_tokens", room))
        # OpenAI's fields onto SamplingParams; for those not sent the model's own defaults (its
        # generation config), then SamplingParams' own. It checks every value (each error names
        # its field).
        try:
            params = self.engine.sampling_params(
                max_tokens=max_tokens,
                stop=req.stop_strings,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                logit_bias=tuple(req.logit_bias_ids.items()),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                n=req.n,
                structured_outputs=req.constraint,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                top_k=req.top_k,
                repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, min_p=req.min_p,
            )
            self.engine.check_params(params)
        except InvalidRequestError as exc:
            field, message = self._field_of(req, exc.param), str(exc)
            if exc.param and field and field != exc.param and message.startswith(exc.param + " "):
                message = field + message[len(exc.param):]  # the client's name for it
            raise invalid(message, field) from None
        try:
            self.engine.check_admissible(num_prompt_tokens, max_tokens)
        except InvalidRequestError as exc:
            raise invalid(str(exc), blamed) from None
        return params

    @staticmethod
    def _field_of(req: GenerationRequest, param: str | None) -> str | None:
        """The request's field for a SamplingParams field: the same name, but for the structured
        output (whichever field carried it), the prompt's logprobs (`echo` with `logprobs`) and
        chat's own names."""
        if param == "structured_outputs":
            return req.constraint_field
        if param == "prompt_logprobs":
            return "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"
        if isinstance(req, ChatCompletionRequest):
            if param == "logprobs":
                return "top_logprobs"
            if param == "max_tokens" and req.max_completion_tokens is not None:
                return "max_completion_tokens"
        return param

    async def _grammar(self, req: GenerationRequest) -> Grammar | None:
        """The request's structured output compiled (off the event loop), or a 400 with the
        compiler's message."""
        if req.constraint is None:
            return None
        try:
            return await asyncio.to_thread(self.engine.compile_grammar, req.constraint)
        except InvalidRequestError as exc:
            raise invalid(str(exc), req.constraint_field) from None

    def _after_thinking(self, grammar: Grammar, req: ChatCompletionRequest) -> Grammar:
        """A chat's grammar beside the reasoning parser: the answer constrained, the thought free."""
        parser = self.config.reasoning_parser
        assert parser is not None
        markers = self._think_markers = self._think_markers or think_markers(parser, self.engine.tokenizer)
        if markers is not None:
            return grammar.after_thinking(markers)
        if parser == "qwen3":  # no thought can open: the output is all answer
            return grammar
        if parser in HARMONY_PARSERS:
            raise invalid(f"structured output beside --reasoning-parser {parser} is not supported: harmony's answer "
                          "opens with several tokens (<|channel|>final<|message|>), which no grammar waits for yet",
                          req.constraint_field)
        raise invalid(f"structured output beside --reasoning-parser {parser} needs <think> and </think> as tokens "
                      "of the model's vocabulary, and this model has none: its answer cannot be told from "
                      "its thought", req.constraint_field)

    async def _submit(self, work: list[tuple[list[int], SamplingParams]], arrival: float, prefix: str,
                      priority: int, grammar: Grammar | None = None) -> list[RequestStream]:
        """Queues one engine request per (prompt ids, params) and waits until the engine has them
        all; if it refuses one, or the client leaves meanwhile, the others are aborted. Returns
        the choices' streams: each prompt's n samples in turn, as OpenAI numbers the choices.
        `grammar`: the params' structured output, compiled; each prompt gets its own copy."""
        try:
            self.engine.check_priority(priority)
        except InvalidRequestError as exc:
            raise invalid(str(exc), "priority") from None
        streams: list[RequestStream] = []
        try:
            firsts = []
            for i, (token_ids, params) in enumerate(work):
                own = grammar.fresh() if grammar is not None and i > 0 else grammar
                samples = self.engine.submit(token_ids, params, arrival, prefix, priority, own)
                firsts.append(samples[0])
                streams.extend(samples)
            for stream in firsts:  # the others join the engine when their prompt's prefill is done
                await stream.wait_admitted()
        except BaseException as exc:
            for stream in streams:
                self._abort_if_running(stream, count=False)
            if isinstance(exc, LateRequestError):
                self.metrics.count_rejected_late()
                raise APIError(429, str(exc), code="late",
                               headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}) from None
            if isinstance(exc, EngineOverloadedError):
                raise APIError(429, str(exc), code="overloaded") from None
            if isinstance(exc, EngineUnavailableError | EngineShutdownError):
                raise APIError(503, str(exc)) from None
            if isinstance(exc, EngineFailedError):
                raise APIError(500, str(exc)) from None
            if isinstance(exc, InvalidRequestError):
                raise invalid(str(exc)) from None
            raise
        return streams

    # --- responses ------------------------------------------------------------------------------

    async def _respond(self, streams: list[RequestStream], fmt: _Format, req: GenerationRequest,
                       http: Request) -> Response:
        if req.stream:
            return ClosingStreamingResponse(self._stream(streams, fmt, req.include_usage, req.n, req.continuous_usage),
                                            on_close=lambda: self._abort_all(streams),
                                            media_type="text/event-stream", headers=_SSE_HEADERS)
        return await self._collect_or_abort(streams, fmt, http, req.n)

    def _ended_by_engine(self, exc: EngineFailedError) -> APIError:
        shutdown = isinstance(exc, EngineShutdownError)
        self.metrics.count_failure("shutdown" if shutdown else "error")
        return APIError(503 if shutdown else 500, str(exc))

    def _abort_if_running(self, stream: RequestStream, count: bool = True) -> None:
        if not stream.finished:
            stream.finished = True
            self.engine.abort(stream.request_id)
            if count:
                self.metrics.count_failure("aborted")

    def _abort_all(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self._abort_if_running(stream)

    async def _stream(self, streams: list[RequestStream], fmt: _Format, include_usage: bool,
                      n: int, continuous_usage: bool = False) -> AsyncIterator[str]:
        """SSE events: each choice's chunks as its deltas come, then with `include_usage` the
        request's usage alone; with `continuous_usage` (vLLM's continuous_usage_stats) each chunk
        also carries its choice's usage so far."""
        last: dict[int, Delta] = {}
        try:
            for opening in fmt.opening(len(streams)):
                yield _sse(opening, exclude_usage=not include_usage)
            async for index, delta in _merged(streams):
                last[index] = delta
                if delta.error is not None or delta.finish_reason is FinishReason.ERROR:
                    self.metrics.count_failure(_failure_reason(delta))
                    self._abort_all(streams)
                    yield error_event(APIError(delta.error_status, delta.error or "internal error"))
                    yield _DONE
                    return
                piece = fmt.chunk(index, delta)
                if piece is not None and continuous_usage:
                    piece = piece.model_copy(update={"usage": fmt.usage_so_far(delta)})
                if piece is not None:
                    yield _sse(piece, exclude_usage=not include_usage)
        except EngineFailedError as exc:
            self._abort_all(streams)
            yield error_event(self._ended_by_engine(exc))
            yield _DONE
            return
        ends = list(last.values())
        finishes = [d.finish_reason for d in ends if d.finish_reason is not None]
        if len(finishes) == len(streams):
            for finish_reason in finishes:
                self.metrics.count_success(finish_reason)
            if include_usage:
                yield _sse(fmt.usage_chunk(_usage(ends, n)))
        yield _DONE

    async def _collect(self, streams: list[RequestStream], fmt: _Format, n: int) -> Response:
        async def one(stream: RequestStream) -> list[Delta]:
            return [delta async for delta in stream.deltas()]

        try:
            outs = await asyncio.gather(*(one(s) for s in streams))
        except EngineFailedError as exc:
            self._abort_all(streams)
            return self._ended_by_engine(exc).response()
        ends: list[Delta] = []
        for deltas in outs:
            last = deltas[-1] if deltas else None
            if last is None or last.error is not None or last.finish_reason not in (FinishReason.STOP,
                                                                                     FinishReason.LENGTH):
                self.metrics.count_failure(_failure_reason(last))
                self._abort_all(streams)
                status = last.error_status if last is not None else 500
                return APIError(status, (last and last.error) or "internal error").response()
            self.metrics.count_success(last.finish_reason)
            ends.append(last)
        return JSONResponse(fmt.response(outs, _usage(ends, n)).model_dump())

    async def _collect_or_abort(self, streams: list[RequestStream], fmt: _Format, http: Request,
                                n: int) -> Response:
        """Collects the whole output, unless the client leaves first: then its requests are
        aborted so that they stop holding batch slots and KV blocks."""
        collect = asyncio.ensure_future(self._collect(streams, fmt, n))
        watch = asyncio.ensure_future(wait_disconnect(http.receive))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():
                collect.cancel()  # only asked: the task is not done until it runs again
                self._abort_all(streams)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody will read it
        return collect.result()


def _failure_reason(delta: Delta | None) -> str:
    """How a request that failed in the engine is counted: "invalid" where its own input failed it
    (a grammar its output cannot follow: a 400, as a request refused at the door is counted),
    else "error" (the server's fault, which the pre-launch gate reads)."""
    return "invalid" if delta is not None and delta.error_from_request else "error"


def _usage(ends: list[Delta], n: int) -> UsageInfo:
    """Output summed over the choices; each prompt counted once, not once per sample."""
    return UsageInfo.of(sum(d.num_prompt_tokens for d in ends) // n, sum(d.num_output_tokens for d in ends))


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of all `streams` as they come, each with its stream's index; raises the first
    error a stream raises. One stream is read directly, without a task."""
    if len(streams) == 1:
        async for delta in streams[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream.deltas():
                await queue.put((index, delta))
        except EngineFailedError as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (its body already read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
