"""A request's sampling parameters, its lifecycle state, and its timings."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from inflight.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance

MAX_LOGPROBS = 20


class TokenLogprobs(NamedTuple):
    """A generated token's log-probability under the model's own distribution (the log-softmax
    of its logits, before logit_bias, penalties and temperature, as vLLM reports by default), and
    the `logprobs` most likely tokens' (id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    # 1 + the number of tokens more likely than this one (vLLM's rank); None where not computed.
    rank: int | None = None


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output, exactly one of (vLLM's `StructuredOutputsParams`): a JSON
    schema, any JSON object, a regular expression, one of several strings, or a grammar (Lark, or
    llama.cpp's GBNF). A schema given as a dict is kept as its JSON text."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured output takes exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {', '.join(given) or 'none'}")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


class Limit(NamedTuple):
    """The values a numeric request field admits: a lower bound (inclusive `ge` or exclusive
    `gt`) and an upper one (`le`); `integer`: whole numbers only."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    integer: bool = False

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        if low is not None and self.le is not None:
            return f"must be {kind} in {low}, {self.le:g}]"
        if low is not None:
            return f"must be {kind} {'>=' if self.ge is not None else '>'} {low[1:]}"
        return f"must be {kind}" + (f" <= {self.le:g}" if self.le is not None else "")


# A request's limits, in one place: `SamplingParams` checks them, and the server's OpenAPI schema
# states them (`inflight.server.openapi`). `logit_bias`: each bias value.
LIMITS: dict[str, Limit] = {
    "max_tokens": Limit(ge=1, integer=True),
    "temperature": Limit(ge=0),
    "top_p": Limit(gt=0, le=1),
    "top_k": Limit(ge=-1, integer=True),  # 0 and -1 (vLLM's "off") disable it
    "min_p": Limit(ge=0, le=1),
    "repetition_penalty": Limit(gt=0),
    "presence_penalty": Limit(ge=-2, le=2),
    "frequency_penalty": Limit(ge=-2, le=2),
    "min_tokens": Limit(ge=0, integer=True),
    "logit_bias": Limit(ge=-100, le=100),
    "n": Limit(ge=1, integer=True),
    "logprobs": Limit(ge=0, le=MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Limit(ge=0, le=MAX_LOGPROBS, integer=True),
}
# None: not asked for (logprobs), or up to the context's end (max_tokens, as vLLM takes it).
_OPTIONAL = {"logprobs", "prompt_logprobs", "max_tokens"}
_GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Checked on construction (`InvalidRequestError`)."""

    # None: up to the context's end, set by the engine that queues the request (`Request.max_tokens`).
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # No EOS, stop token or stop string ends the output before this many tokens.
    min_tokens: int = 0
    # Sampled rows: drop tokens less likely than min_p times the most likely one (after
    # temperature, top-k and top-p).
    min_p: float = 0.0
    # (token id, bias) pairs added to the logits before anything else, greedy rows included.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report each generated token's log-probability and this many alternatives (None: nothing).
    logprobs: int | None = None
    # The same for each prompt token after the first (lm-eval's loglikelihood; `echo` over HTTP).
    prompt_logprobs: int | None = None
    # Samples of the prompt: after its prefill, n - 1 more requests share its KV blocks.
    n: int = 1
    # Constrains every output token to those the grammar allows; the output ends when it is complete.
    structured_outputs: StructuredOutputs | None = None
    # The stop string that ended the output stays at its end (vLLM's option).
    include_stop_str_in_output: bool = False
    # The output's text leaves out special tokens (chat markers, tool-call tags that are special
    # in a vocabulary); False keeps them (vLLM's option). The token that ends it is never shown.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        """Every limit of a request's own values is checked here and nowhere else (`LIMITS`);
        each failure names its field (`InvalidRequestError.param`), which the HTTP layer reports
        as OpenAI's."""
        # None for none, and top_k -1 for off, as vLLM's SamplingParams takes them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = dict(self.logit_bias or ())  # pairs, or a {token id: bias} mapping
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))
        for name, limit in LIMITS.items():
            values = bias.values() if name == "logit_bias" else [getattr(self, name)]
            for value in values:
                if not (value is None and name in _OPTIONAL or limit.admits(value)):
                    raise InvalidRequestError(f"{name} {limit.describe()}, got {value!r}", name)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{param} {message}", param)

        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "strings must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be token ids >= 0")
        check(all(isinstance(t, int) and t >= 0 for t in bias), "logit_bias", "keys must be token ids >= 0")

    def check_limits(self, *, vocab_size: int, max_batch_size: int) -> None:
        """The limits that depend on the engine: biased token ids within its vocabulary, and `n`
        samples within one step's batch. Raises InvalidRequestError naming the field."""
        if self.n > max_batch_size:
            raise InvalidRequestError(f"n ({self.n}) exceeds max_batch_size ({max_batch_size}), the most requests "
                                      "in one step", "n")
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:  # sorted by token id
            raise InvalidRequestError(f"logit_bias: token id {self.logit_bias[-1][0]} is outside the vocabulary "
                                      f"[0, {vocab_size})", "logit_bias")

    @property
    def is_greedy(self) -> bool:
        # Below _GREEDY_TEMPERATURE the logits divided by it overflow fp32 (vLLM draws the same line).
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (bias, penalties,
        or blocking the end while min_tokens is unmet)."""
        return bool(self.logit_bias) or self.has_penalties or self.min_tokens > 0


class ThinkMarkers(NamedTuple):
    """A reasoning model's thought markers, as one token each, for a grammar that waits while the
    model thinks (structured output beside a reasoning parser, as vLLM applies it): the grammar
    constrains only what follows `end`. `opens`: the output thinks only if its first token is
    `start` (Qwen3's hybrid models; any other first token is the answer, constrained from there),
    else it thinks from its start (the DeepSeek-R1 distills, whose template opens the thought)."""

    start: int
    end: int
    opens: bool


class Grammar:
    """One request's position in its grammar; with `think`, after the model's thought."""

    __slots__ = ("matcher", "think", "_seen", "_free")

    def __init__(self, matcher: llguidance.LLMatcher, think: ThinkMarkers | None = None) -> None:
        self.matcher = matcher
        self.think = think
        self._seen = 0  # output tokens accepted
        # How many of the first output tokens the grammar left free (the thought and its markers);
        # None while the model may still be thinking.
        self._free: int | None = 0 if think is None else None

    def fresh(self) -> Grammar:
        """The same grammar from its start (for another request, or another of n samples)."""
        matcher = self.matcher.deep_copy()
        matcher.reset()
        return Grammar(matcher, self.think)

    def after_thinking(self, think: ThinkMarkers) -> Grammar:
        """The same grammar from its start, constraining only the output after a thought."""
        return Grammar(self.fresh().matcher, think)

    @property
    def constrains(self) -> bool:
        """Whether the next token is constrained at all (not inside a thought)."""
        return self._free is not None or self._undecided

    @property
    def _undecided(self) -> bool:
        return self._seen == 0 and self.think is not None and self.think.opens

    @property
    def also_allowed(self) -> int | None:
        """A token allowed beside the grammar's own: the thought's opening, as the first token."""
        return self.think.start if self._undecided and self.think is not None else None

    def accept(self, token_id: int) -> bool:
        """Advances by an output token; False if the grammar does not allow it."""
        undecided = self._undecided
        self._seen += 1
        if self._free is not None:
            return self.matcher.consume_token(token_id)
        assert self.think is not None
        if undecided and token_id != self.think.start:  # no thought: all of it is the answer
            self._free = 0
            return self.matcher.consume_token(token_id)
        if not undecided and token_id == self.think.end:
            self._free = self._seen
        return True

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order from here, the grammar allows (nothing advances)."""
        if self._free is not None:
            return int(self.matcher.validate_tokens(token_ids))
        assert self.think is not None
        for i, token in enumerate(token_ids):
            if self._seen + i == 0 and self.think.opens:
                if token != self.think.start:
                    return int(self.matcher.validate_tokens(token_ids))
            elif token == self.think.end:
                return i + 1 + int(self.matcher.validate_tokens(token_ids[i + 1:]))
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` tokens accepted."""
        if not num_tokens:
            return
        if self._free is not None:
            taken = min(num_tokens, self._seen - self._free)
            if taken:
                self.matcher.rollback(taken)
            if self._seen - num_tokens < self._free or (self._seen - num_tokens == 0 and self.think is not None):
                self._free = None if self.think is not None else 0  # back inside the thought (or before it)
        self._seen -= num_tokens

    @property
    def is_complete(self) -> bool:
        """The output matches the whole grammar and nothing may follow (but EOS)."""
        return self._free is not None and self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class RequestTimings:
    """Wall-clock times (time.perf_counter seconds) of a request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    def add_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_times.append(now)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival


@dataclass(eq=False, slots=True)
class Request:
    """One generation request. Its tokens are the prompt followed by the outputs so far; the
    engine computes KV for `num_computed_tokens` of them, and a request needs a new token once
    `num_computed_tokens == num_tokens`. Hashable by identity."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, if asked
    # With prompt_logprobs: one per prompt token after the first, in order, filled as the prompt's
    # chunks are computed (a recompute after preemption adds none twice).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Parallel sampling: which of its prompt's n samples this request is (0: the one that ran
    # the prefill), and, on sample 0, the others once forked.
    sample_index: int = 0
    samples: list[Request] = field(default_factory=list)
    # With structured_outputs: the grammar's state, advanced by each output token (kept through
    # preemption, as the outputs are).
    grammar: Grammar | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    timings: RequestTimings = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        self.timings = RequestTimings(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def awaits_fork(self) -> bool:
        """Sample 0 of n > 1 whose siblings do not exist yet (they fork after its prefill)."""
        return self.sampling_params.n > 1 and self.sample_index == 0 and not self.samples

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions still need their logits computed (so prefix-cache hits,
        which skip computing them, must not be taken)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """The most output this request may produce: its params' max_tokens, which the engine
        that queues it sets where they leave it None (`LLMEngine.enqueue_request`)."""
        limit = self.sampling_params.max_tokens
        if limit is None:
            raise InvalidRequestError("max_tokens is unset until an engine queues the request", "max_tokens")
        return limit

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most output this request may produce."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


def sample_request_id(request_id: str, index: int) -> str:
    """The id of sample `index` (>= 1) of request `request_id`, which asked for n > 1."""
    return f"{request_id}#{index}"
