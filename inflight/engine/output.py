"""What a step gives back: per-request deltas (tokens, text, finish) and a per-step record.

`OutputProcessor` owns each request's incremental detokenizer and applies the stop rules:
EOS (unless ignore_eos), stop token ids, a structured output's grammar complete, stop strings
and max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.model.tokenizer import IncrementalDetokenizer, Tokenizer
from inflight.perf.cost_model import SeqWork
from inflight.request import FinishReason, Request, TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. `text` is new text since the last output."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    request: Request
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # of the new token, if the request asks
    # With the first token of a request that asks: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # The error lies with the request's own input (a grammar its output cannot follow), not
    # with the engine: a server answers it as the client's error (400), not its own (500).
    error_from_request: bool = False


@dataclass(slots=True)
class StepRecord:
    """The composition and cost of one engine step."""

    step_id: int
    start_s: float
    duration_s: float
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int  # one per decoding request (one verifying proposed tokens included)
    num_wasted_tokens: int
    num_kv_blocks_used: int
    num_running: int
    num_waiting: int
    num_preempted: int
    request_ids: tuple[str, ...] = field(default=())
    work: tuple[SeqWork, ...] = ()  # per request, as `SchedulerOutput.work()` gives
    # Where the step's time went: scheduling, building tensors, the forward pass, sampling,
    # and output processing (detokenization, stop rules, bookkeeping).
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    process_s: float = 0.0
    # Allocated KV slots holding a token of an unfinished request, after the step.
    num_kv_live_tokens: int = 0
    # Speculative decoding: proposed tokens the step verified, and of those the ones kept.
    num_spec_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_s: float = 0.0  # a draft model's share of schedule_s: proposing the verified tokens


@dataclass(slots=True)
class _TextState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, request: Request) -> None:
        self._states[request.request_id] = _TextState(IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params.skip_special_tokens))

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process_token(self, request: Request, token: int) -> tuple[str, FinishReason | None]:
        """Accounts for a token just appended to the request; returns (text to emit, finish)."""
        state = self._states[request.request_id]
        params = request.sampling_params
        finish: FinishReason | None = None
        may_stop = request.num_output_tokens > params.min_tokens  # this token is past min_tokens
        if may_stop and _is_stop_token(request, token):
            finish = FinishReason.STOP
        else:
            state.text += state.detokenizer.add(token)
        if finish is None and request.grammar is not None and request.grammar.is_complete:
            state.text += state.detokenizer.flush()
            finish = FinishReason.STOP
        if finish is None and request.num_output_tokens >= request.max_tokens:
            state.text += state.detokenizer.flush()
            finish = FinishReason.LENGTH
        stops = params.stop if request.num_output_tokens >= params.min_tokens else ()
        if stops and finish is not FinishReason.STOP:
            found = _find_stop(state.text, stops, state.num_emitted_chars)
            if found is not None:
                start, stop = found
                state.text = state.text[:start + len(stop) if params.include_stop_str_in_output else start]
                finish = FinishReason.STOP
        # While running, hold back a tail that could be the start of a stop string.
        hold = 0 if finish is not None or not stops else max(len(s) for s in stops) - 1
        end = max(state.num_emitted_chars, len(state.text) - hold)
        delta = state.text[state.num_emitted_chars:end]
        state.num_emitted_chars = end
        return delta, finish


class LengthOutputProcessor:
    """`OutputProcessor` for an engine without a tokenizer (the simulator, scheduler tests): no
    text; a request ends at a stop token, at EOS unless ignored, or at `max_tokens`."""

    def add(self, request: Request) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass

    def process_token(self, request: Request, token: int) -> tuple[str, FinishReason | None]:
        params = request.sampling_params
        if request.num_output_tokens > params.min_tokens and _is_stop_token(request, token):
            return "", FinishReason.STOP
        return "", FinishReason.LENGTH if request.num_output_tokens >= request.max_tokens else None


def _is_stop_token(request: Request, token: int) -> bool:
    params = request.sampling_params
    return token in params.stop_token_ids or (token in request.eos_token_ids and not params.ignore_eos)


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> tuple[int, str] | None:
    """The earliest place a stop string starts that ends in text not yet emitted (text emitted
    before `min_tokens` was reached may hold one that no longer counts), and that string (of
    those starting there, the longest)."""
    found = [(i, s) for s in stops if (i := text.find(s, max(0, emitted - len(s) + 1))) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None
