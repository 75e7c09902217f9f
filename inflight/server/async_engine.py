"""The engine loop in a background thread, serving requests to asyncio code.

The `LLMEngine` is not thread-safe, so exactly one thread touches it: the loop started by
`AsyncEngine.start()`. HTTP handlers run on the asyncio event loop; they submit add and abort
commands through a lock-guarded queue that the loop drains between steps, and they read
outputs from an asyncio queue per request that the loop feeds with `call_soon_threadsafe`.
Everything that crosses the thread boundary is plain immutable data (`Delta`, `EngineStats`).

The loop steps while any request is unfinished or a command is pending, and sleeps on a
condition variable otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from inflight.engine.engine import LLMEngine, StepObserver
from inflight.engine.output import RequestOutput
from inflight.engine.stats import EngineStats
from inflight.errors import EngineOverloadedError, InflightError, InvalidRequestError
from inflight.model.tokenizer import ChatMessage, Tokenizer
from inflight.request import FinishReason, Grammar, SamplingParams, StructuredOutputs, sample_request_id
from inflight.server.stream import ADMITTED, Delta, RequestStream

logger = logging.getLogger(__name__)


class EngineUnavailableError(InflightError):
    """The engine is shutting down (or its loop has stopped) and takes no new requests."""


class EngineFailedError(InflightError):
    """The engine ended the request because something inside it failed."""


class EngineShutdownError(EngineFailedError):
    """The engine ended the request because the server is shutting down."""


class _Add(NamedTuple):
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    samples: list[RequestStream]  # with n > 1: the other samples' streams, fed once they fork
    grammar: Grammar | None  # the params' structured output, compiled


class _Abort(NamedTuple):
    request_id: str


class _AbortAll(NamedTuple):
    message: str


class _CachedHashes(NamedTuple):
    result: concurrent.futures.Future[list[int]]


_Command = _Add | _Abort | _AbortAll | _CachedHashes


class AsyncEngine:
    """Runs an `LLMEngine` in one background thread and serves requests to asyncio code."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.scheduler_config.max_model_len
        self.max_waiting_requests = engine.scheduler_config.max_waiting_requests
        self.max_batch_size = engine.scheduler_config.max_batch_size
        # The per-request targets the server counts goodput against (seconds; None: not set).
        cfg = engine.scheduler_config
        self.ttft_target_s = cfg.ttft_slo_ms / 1e3 if cfg.ttft_slo_ms is not None else None
        self.tpot_target_s = cfg.tbt_slo_ms / 1e3 if cfg.tbt_slo_ms is not None else None
        self.vocab_size = engine.model_config.vocab_size
        self.cache_config_info = engine.cache_config_info()
        # Every token stands for at most `longest` characters, so a text longer than
        # max_model_len * longest characters cannot fit, whatever its tokens: it can be refused
        # before any tokenizing, which bounds the tokenizer's work per request.
        longest = max((len(t) for t in engine.tokenizer.hf.get_vocab()), default=1)
        self.max_prompt_chars = self.max_model_len * max(longest, 1)
        self._lock = threading.Condition()
        self._commands: list[_Command] = []
        self._streams: dict[str, RequestStream] = {}  # guarded by _lock
        self._num_pending_adds = 0  # submitted, not yet in the engine's waiting queue
        self._num_waiting = 0  # the engine's waiting queue, as last published
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.stats: EngineStats = engine.stats()  # published by the loop thread after each step

    # --- read-only facts, safe from any thread --------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int] | None = None,
                 messages: Sequence[ChatMessage] | None = None) -> list[int]:
        """Prompt token ids (chat template applied to `messages`). The tokenizer is only read,
        so handlers may call this while the loop thread detokenizes."""
        return self._engine.tokenize(prompt, messages)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, which handlers may read while the loop thread detokenizes."""
        return self._engine.tokenizer

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The model's sampling defaults (its generation config), fixed at the engine's start."""
        return self._engine.default_sampling

    def sampling_params(self, **given: Any) -> SamplingParams:
        """A request's SamplingParams, the model's defaults for what it leaves unset (None)."""
        return self._engine.sampling_params(**given)

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises InvalidRequestError for a request the engine could never serve."""
        self._engine.scheduler.check_admissible(num_prompt_tokens, max_tokens)

    def check_params(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError (naming the field) for params beyond the engine's limits."""
        self._engine.check_params(params)

    def check_priority(self, priority: int) -> None:
        """Raises InvalidRequestError for a priority the engine's policy would ignore."""
        self._engine.check_priority(priority)

    def compile_grammar(self, spec: StructuredOutputs) -> Grammar:
        """A request's grammar (compiled in the caller's thread, not the loop's); raises
        InvalidRequestError with the compiler's message if `spec` does not compile."""
        return self._engine.compile_grammar(spec)

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._streams)

    def add_step_observer(self, observer: StepObserver) -> None:
        """Registers a per-step callback; it runs in the loop thread. Call before `start()`."""
        if self._thread is not None:
            raise RuntimeError("add step observers before the engine loop starts")
        self._engine.step_observers.append(observer)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends every unfinished request with an error and joins the loop thread."""
        with self._lock:
            self._accepting = False
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    async def drain(self, timeout_s: float, give_up: Callable[[], bool] = lambda: False) -> int:
        """Refuses new requests, waits up to `timeout_s` (or until `give_up()`) for the
        active ones to finish, then ends the rest with an error. Returns how many it ended."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + timeout_s
        if self.num_active:
            logger.info("draining: waiting up to %.0f s for %d requests", timeout_s, self.num_active)
        while self.num_active and time.monotonic() < deadline and self.is_alive and not give_up():
            await asyncio.sleep(0.05)
        remaining = self.num_active
        if remaining:
            logger.warning("shutdown timeout: ending %d unfinished requests", remaining)
            self._send(_AbortAll("the server is shutting down; the request was ended early"))
        return remaining

    # --- requests (event loop side) -------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
               prefix: str = "req", priority: int = 0, grammar: Grammar | None = None) -> list[RequestStream]:
        """Queues a request for the engine; returns its stream, then (with n > 1) those of its
        other samples. `grammar`: the params' structured output from `compile_grammar`. Raises
        EngineOverloadedError at once when the waiting queue (plus adds not yet applied) is full,
        EngineUnavailableError when draining."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(f"{prefix}-{uuid.uuid4().hex}", loop)
        samples = [RequestStream(sample_request_id(stream.request_id, j), loop) for j in range(1, params.n)]
        with self._lock:
            if not self._accepting or not self.is_alive:
                raise EngineUnavailableError("the server is shutting down")
            limit = self.max_waiting_requests
            if limit is not None and self._num_waiting + self._num_pending_adds >= limit:
                raise EngineOverloadedError(f"the waiting queue is full ({limit} requests); retry later")
            self._num_pending_adds += 1
            for one in (stream, *samples):
                self._streams[one.request_id] = one
            self._commands.append(_Add(stream, prompt_token_ids, params, arrival_time, priority, samples, grammar))
            self._lock.notify()
        return [stream, *samples]

    def abort(self, request_id: str) -> None:
        """Ends a request at the next step boundary (its client went away). Idempotent."""
        self._send(_Abort(request_id))

    async def cached_block_hashes(self) -> list[int]:
        """The keys of the blocks in the engine's prefix cache, read by the loop thread between
        two steps (a prefix-aware router's view of this engine)."""
        result: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        with self._lock:
            if self._stopping or not self.is_alive:
                raise EngineUnavailableError("the engine loop has stopped")
            self._commands.append(_CachedHashes(result))
            self._lock.notify()
        return await asyncio.wrap_future(result)

    def _send(self, command: _Command) -> None:
        with self._lock:
            self._commands.append(command)
            self._lock.notify()

    # --- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("engine loop started")
        while (commands := self._next_commands()) is not None:
            for command in commands:
                self._apply(command)
            if self._engine.has_unfinished():
                self._step()
            self._publish()
        self._fail_all(EngineShutdownError("the server is shutting down; the request was ended early"))
        self._publish()
        with self._lock:  # questions the loop will never answer now
            for command in self._commands:
                if isinstance(command, _CachedHashes):
                    command.result.set_exception(EngineUnavailableError("the engine loop has stopped"))
        logger.info("engine loop stopped")

    def _next_commands(self) -> list[_Command] | None:
        """Takes the pending commands, sleeping while there is nothing to do; None to stop."""
        with self._lock:
            while not (self._commands or self._stopping or self._engine.has_unfinished()):
                self._lock.wait()
            if self._stopping:
                return None
            commands, self._commands = self._commands, []
            return commands

    def _apply(self, command: _Command) -> None:
        try:
            if isinstance(command, _Add):
                self._apply_add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            elif isinstance(command, _CachedHashes):
                command.result.set_result(self._engine.scheduler.block_manager.cached_block_hashes())
            else:
                self._fail_all(EngineShutdownError(command.message))
        except Exception:  # a bad command must never stop the loop
            logger.exception("engine loop: command %s failed", type(command).__name__)

    def _apply_add(self, command: _Add) -> None:
        stream = command.stream
        try:
            self._engine.add_request(command.prompt_token_ids, command.params,
                                     request_id=stream.request_id, arrival_time=command.arrival_time,
                                     priority=command.priority, grammar=command.grammar)
        except (InvalidRequestError, EngineOverloadedError) as exc:
            for one in (stream, *command.samples):
                self._close(one, exc)
        except Exception:
            logger.exception("engine loop: add_request failed for %s", stream.request_id)
            for one in (stream, *command.samples):
                self._close(one, EngineFailedError("internal error while queueing the request"))
        else:
            for one in (stream, *command.samples):
                one.in_engine = True
            stream.put(ADMITTED)
        finally:
            with self._lock:
                self._num_pending_adds -= 1
                self._num_waiting = self._engine.num_waiting

    def _abort(self, request_id: str) -> None:
        self._engine.abort(request_id)
        with self._lock:
            self._streams.pop(request_id, None)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception:
            # The engine already turns a failed model step into per-request errors; reaching
            # here means its own bookkeeping raised, so no request's state can be trusted.
            logger.exception("engine loop: step raised; failing every request in the engine")
            self._fail_all(EngineFailedError("internal error in the engine; the request was ended"),
                           in_engine_only=True)
            return
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
        request = out.request
        if out.finished and request.awaits_fork:  # ended (failed) before its other samples began
            for j in range(1, request.sampling_params.n):
                with self._lock:
                    sample = self._streams.pop(sample_request_id(request.request_id, j), None)
                if sample is not None:
                    sample.put(Delta("", 0, FinishReason.ERROR, request.num_prompt_tokens, 0,
                                     out.error or "the request ended before this sample began"))
        if stream is None:  # aborted meanwhile
            return
        stream.put(Delta(out.text, len(out.new_token_ids), out.finish_reason,
                         request.num_prompt_tokens, request.num_output_tokens, out.error, out.logprobs,
                         out.prompt_logprobs, out.error_from_request))

    def _fail_all(self, error: Exception, in_engine_only: bool = False) -> None:
        """Ends every request with `error`; with `in_engine_only`, spares those whose add
        command is still queued (they arrived during the step and are not affected)."""
        with self._lock:
            streams = {rid: st for rid, st in self._streams.items() if st.in_engine or not in_engine_only}
            for request_id in streams:
                del self._streams[request_id]
        for request_id, stream in streams.items():
            try:
                self._engine.abort(request_id)
            except Exception:
                logger.exception("engine loop: abort of %s failed", request_id)
            stream.put(error)

    def _close(self, stream: RequestStream, error: Exception) -> None:
        with self._lock:
            self._streams.pop(stream.request_id, None)
        stream.put(error)

    def _publish(self) -> None:
        self.stats = stats = self._engine.stats()
        with self._lock:
            self._num_waiting = stats.num_waiting
