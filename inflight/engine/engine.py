"""The step loop: schedule, run the model, process outputs; again after every step."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from inflight.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SchedulingPolicy
from inflight.engine.block_manager import BlockManager
from inflight.engine.draft import DraftModel, check_draft
from inflight.engine.memory import available_memory_bytes, check_memory, select_kv_dtype
from inflight.engine.output import LengthOutputProcessor, OutputProcessor, RequestOutput, StepRecord
from inflight.engine.priority import PriorityScheduler
from inflight.engine.runner import ModelRunner, RunnerTimings
from inflight.engine.sampler import Sampler
from inflight.engine.scheduler import Scheduler, SchedulerOutput
from inflight.engine.slo import SLOScheduler, StepTimePredictor
from inflight.engine.speculative import Speculator
from inflight.engine.static import StaticScheduler
from inflight.engine.stats import EngineStats, scheduler_stats
from inflight.engine.structured import GrammarCompiler
from inflight.errors import ConfigError, EngineOverloadedError, InvalidRequestError
from inflight.model.linear import linear_backend
from inflight.model.llama import LlamaModel
from inflight.model.loaded import LoadedModel
from inflight.model.loader import resolve_model
from inflight.model.tokenizer import ChatMessage, Tokenizer
from inflight.perf.cost_model import CostModel, StepTimeModel
from inflight.perf.profiles import load_profiles
from inflight.request import (
    FinishReason,
    Grammar,
    Request,
    SamplingParams,
    StructuredOutputs,
    TokenLogprobs,
    sample_request_id,
)

logger = logging.getLogger(__name__)

StepObserver = Callable[[StepRecord, list[RequestOutput]], None]


class ModelStepResult(NamedTuple):
    """What running the model on a step gave: request id -> new tokens for the requests that
    reached their last known token, or the error that failed the step (and only its requests)."""

    sampled: dict[str, list[int]]
    error: Exception | None = None


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but CUDA is not available")
    return device


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPUs without bf16 units run bf16 matmuls two orders of magnitude slower than fp32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator raises a plain RuntimeError."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def check_engine_fits(config: EngineConfig, copies: int = 1) -> None:
    """Refuses, with one line and before anything is allocated, an engine of `config` (or
    `copies` of it, each in its own process) that would not fit in this machine's memory
    (`engine.memory.check_memory`)."""
    device = select_device(config.device)
    dtype = select_dtype(config.dtype, device)
    check_memory(config, resolve_model(config.model, config.model_overrides), dtype, device,
                 packed=linear_backend(device, dtype) != "torch", copies=copies)


def load_model_for(config: EngineConfig) -> LoadedModel:
    """The model an engine of `config` runs: on its device, in its dtype, quantization and
    `hf_overrides` (an engine given it reuses it: `LoadedModel.serves`)."""
    device = select_device(config.device)
    return LoadedModel.load(config.model, select_dtype(config.dtype, device), device, config.quantization,
                            config.model_overrides)


def _blocks_for_budget(cache: CacheConfig, model: LlamaModel, kv_dtype: torch.dtype, device: torch.device) -> int:
    total: float
    if cache.kv_cache_memory_bytes is not None:
        total, asked = cache.kv_cache_memory_bytes, f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    else:
        fraction = cache.kv_cache_memory_fraction
        total, asked = fraction * available_memory_bytes(device), f"kv_cache_memory_fraction={fraction}"
    num_blocks = int(total // ModelRunner.kv_bytes_per_block(model, cache.block_size, kv_dtype))
    if num_blocks < 1:
        raise ConfigError(f"{asked} leaves no room for a single KV block")
    return num_blocks


def kv_pool_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """The KV blocks an engine of `config` over `loaded` allocates if built now: its
    `num_kv_blocks`, or what its memory budget holds of the memory available."""
    cache = config.cache
    if cache.num_kv_blocks:
        return cache.num_kv_blocks
    kv_dtype = select_kv_dtype(cache.kv_cache_dtype, loaded.model.dtype)
    return _blocks_for_budget(cache, loaded.model, kv_dtype, select_device(config.device))


_POLICIES: dict[SchedulingPolicy, type[Scheduler]] = {
    SchedulingPolicy.CONTINUOUS: Scheduler,
    SchedulingPolicy.PRIORITY: PriorityScheduler,
    SchedulingPolicy.STATIC: StaticScheduler,
}


def _slo_cost_model(config: SchedulerConfig, model: ModelConfig, parts: EngineParts,
                    kv_cache_dtype: str = "auto") -> CostModel:
    """The SLO policy's step-time model: its profile, or by default the built-in one for the
    device (its efficiencies then follow the machine through the online correction); an int8
    engine's from the profile's int8 factors where it has them (`inflight sim calibrate
    --quantization int8`). A checkpoint stored otherwise than the profile's calibrated model is
    priced by its `as_stored` factors (`LoadedModel.matmul_storage`, `EngineProfile.for_storage`)."""
    name = config.slo_cost_profile
    if name == "auto":
        name = "h100" if parts.device is not None and parts.device.type == "cuda" else "cpu-local"
    dtype = None if parts.loaded is None else str(parts.loaded.model.dtype).removeprefix("torch.")
    hardware, engine = load_profiles(name)
    if parts.loaded is not None and parts.loaded.quantization == "int8" and engine.int8 and hardware.peak_flops_int8:
        return CostModel(model, hardware, dtype=dtype, engine=engine.for_int8(), weight_dtype="int8",
                         kv_cache_dtype=kv_cache_dtype)
    return CostModel(model, hardware, dtype=dtype, engine=engine, kv_cache_dtype=kv_cache_dtype,
                     matmul_storage=None if parts.loaded is None else parts.loaded.matmul_storage)


def _draft_model(config: EngineConfig, sched_cfg: SchedulerConfig, parts: EngineParts, num_blocks: int) -> DraftModel:
    """Speculative decoding's draft model, loaded beside the target (`parts.loaded`) on the same
    device, dtype and quantization, with a KV pool of as many blocks as the target's; refused
    first, with one line, if it would not fit in the memory left."""
    spec, target = sched_cfg.speculative, parts.loaded
    assert spec is not None and spec.model is not None and target is not None
    cache = dataclasses.replace(config.cache, num_kv_blocks=num_blocks)
    draft_config = dataclasses.replace(config, model=spec.model, cache=cache)
    check_engine_fits(draft_config)
    draft = LoadedModel.load(spec.model, target.model.dtype, target.model.device, config.quantization)
    check_draft(draft, target)
    cost_model = _slo_cost_model(sched_cfg, draft.model.config, parts,
                                 cache.kv_cache_dtype).for_draft(draft.model.config, draft.matmul_storage)
    return DraftModel(draft, num_blocks, cache.block_size, parts.model_config.vocab_size, cost_model,
                      select_kv_dtype(cache.kv_cache_dtype, draft.model.dtype))


class Clock(Protocol):
    """Where the engine reads the time (seconds), and how a driver waits for a later one."""

    def __call__(self) -> float: ...

    def wait_until(self, t: float) -> None: ...


class WallClock:
    """`time.perf_counter`, waited on by sleeping."""

    def __call__(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - time.perf_counter()))


class Runner(Protocol):
    """Runs the model (or stands in for it) on one step's plain data."""

    last_timings: RunnerTimings
    last_logprobs: dict[str, list[TokenLogprobs]]  # of the last step's tokens, for the requests that ask
    last_prompt_logprobs: dict[str, list[TokenLogprobs]]  # of the prompt tokens the last step computed

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Request id -> new tokens, for each request that reached its last known token: its next
        one, or where the step verified proposed tokens, those kept and one more."""
        ...


def _sampling_defaults(config: EngineConfig, model_config: ModelConfig) -> dict[str, Any]:
    """The settings a request leaves unset take the model's own (`ModelConfig.sampling_defaults`)
    under `generation_config` auto, as vLLM's `--generation-config auto` and llama.cpp do; none
    under vllm. A value SamplingParams refuses is the model's error, refused at start."""
    found: dict[str, Any] = dict(model_config.sampling_defaults or {}) if config.generation_config == "auto" else {}
    if not found:
        return {}
    try:
        SamplingParams(**found)
    except InvalidRequestError as exc:
        raise ConfigError(f"the model's sampling defaults (its generation config): {exc}; "
                          "--generation-config vllm leaves them out") from None
    # A warning, as vLLM's: a request without a temperature now samples otherwise than it would
    # on another model, which an operator should see at start.
    logger.warning("sampling defaults from the model's generation config, for what a request leaves unset: %s "
                   "(--generation-config vllm: inflight's own)", ", ".join(f"{k}={v}" for k, v in found.items()))
    return found


@dataclass(frozen=True)
class EngineParts:
    """What the step loop drives besides the scheduler and block manager it builds: a real model
    (`LLMEngine(config)` builds these itself), the simulator's cost model on a virtual clock, or
    a test's fake runner."""

    runner: Runner
    num_kv_blocks: int
    model_name: str
    model_config: ModelConfig
    tokenizer: Tokenizer | None = None  # None: prompts are token ids, outputs carry no text
    clock: Clock = field(default_factory=WallClock)  # every time the engine stamps or measures
    loaded: LoadedModel | None = None
    device: torch.device | None = None
    # False where prompt ids are synthetic (the simulator's stand for positions, not tokens).
    check_token_ids: bool = True
    # What the SLO policy predicts step times with (the simulator passes its own cost model);
    # None: the roofline cost model on the scheduler config's `slo_cost_profile`.
    step_time_model: StepTimeModel | None = None


class LLMEngine:
    """Owns the KV pool, the scheduler, the runner and the output processing; driven by `step()`,
    the one step loop of the server, the offline API, the benchmark and the simulator."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *,
                 parts: EngineParts | None = None, clock: Clock | None = None) -> None:
        """Loads `config.model` (or reuses `loaded`, a model already on the right device) and runs
        it, unless `parts` says what to run instead; `clock` replaces the parts' own (a
        benchmark's, when engines take turns on one host)."""
        self.config = config
        if parts is None:
            parts = self._model_parts(config, loaded)
        if clock is not None:
            parts = dataclasses.replace(parts, clock=clock)
        self.parts = parts
        self.clock = parts.clock
        self.device = parts.device
        self.model_name = parts.model_name
        self.model_config = model_config = parts.model_config

        sched_cfg = config.scheduler
        if sched_cfg.max_model_len > model_config.max_position_embeddings:
            logger.info("max_model_len %d is past the %d positions the model serves: %d it is",
                        sched_cfg.max_model_len, model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
            sched_cfg = dataclasses.replace(sched_cfg, max_model_len=model_config.max_position_embeddings)
        if parts.loaded is not None:  # a longrope model's factors follow the context it serves
            parts.loaded.model.use_context(sched_cfg.max_model_len)
        self.scheduler_config = sched_cfg
        cache = config.cache
        num_blocks = parts.num_kv_blocks
        # A window in every layer releases the blocks behind it; one in some layers only keeps
        # them all for the global layers.
        window = model_config.sliding_window if model_config.sliding_window_layers is None else None
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching, window)
        if sched_cfg.scheduling_policy is SchedulingPolicy.SLO:
            predictor = StepTimePredictor(parts.step_time_model
                                          or _slo_cost_model(sched_cfg, model_config, parts, cache.kv_cache_dtype))
            self.scheduler: Scheduler = SLOScheduler(sched_cfg, self.block_manager, predictor, clock=self.clock)
        else:
            policy = _POLICIES[sched_cfg.scheduling_policy]
            self.scheduler = policy(sched_cfg, self.block_manager, clock=self.clock)
        self.runner = parts.runner
        # Speculative decoding: its lengths follow the cost model, refitted to this engine's steps.
        self.speculator: Speculator | None = None
        if sched_cfg.speculative is not None:
            self.speculator = Speculator(sched_cfg.speculative,
                                         parts.step_time_model
                                         or _slo_cost_model(sched_cfg, model_config, parts, cache.kv_cache_dtype))
            self.scheduler.speculator = self.speculator
            if sched_cfg.speculative.method == "draft_model" and parts.loaded is not None:
                self.speculator.drafter = _draft_model(config, sched_cfg, parts, num_blocks)
        self.output_processor: OutputProcessor | LengthOutputProcessor = (
            OutputProcessor(parts.tokenizer) if parts.tokenizer is not None else LengthOutputProcessor())
        self.default_sampling = _sampling_defaults(config, model_config)

        self._grammar_compiler: GrammarCompiler | None = None
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.step_records: deque[StepRecord] = deque(maxlen=config.step_history)
        self.step_observers: list[StepObserver] = []
        self.num_failed_steps = 0
        self.num_oom_errors = 0
        logger.info("engine ready: %s on %s, %d KV blocks of %d tokens",
                    self.model_name, self.device or type(self.runner).__name__, num_blocks, cache.block_size)

    @staticmethod
    def _model_parts(config: EngineConfig, loaded: LoadedModel | None) -> EngineParts:
        device = select_device(config.device)
        torch.manual_seed(config.seed)
        if loaded is not None and not loaded.serves(config):
            loaded = None  # a model loaded with other weights or settings than this engine computes with
        if loaded is None:
            check_engine_fits(config)
            loaded = load_model_for(config)
        cache = config.cache
        kv_dtype = select_kv_dtype(cache.kv_cache_dtype, loaded.model.dtype)
        num_blocks = kv_pool_blocks(config, loaded)
        runner = ModelRunner(loaded.model, num_blocks, cache.block_size, Sampler(device, config.seed), kv_dtype)
        return EngineParts(runner, num_blocks, loaded.name, loaded.model.config, loaded.tokenizer,
                           loaded=loaded, device=device)

    def sampling_params(self, **given: Any) -> SamplingParams:
        """SamplingParams of a request's settings (those None: not given), the model's defaults
        (`default_sampling`) standing for those it leaves unset, SamplingParams' own for the rest.
        InvalidRequestError naming the field of a bad value."""
        return SamplingParams(**{**self.default_sampling, **{k: v for k, v in given.items() if v is not None}})

    @property
    def model(self) -> LlamaModel:
        if self.parts.loaded is None:
            raise ConfigError(f"this engine runs {type(self.runner).__name__}, not a model")
        return self.parts.loaded.model

    @property
    def tokenizer(self) -> Tokenizer:
        if self.parts.tokenizer is None:
            raise ConfigError("this engine has no tokenizer: give prompts as token ids")
        return self.parts.tokenizer

    def tokenizer_for(self, feature: str) -> Tokenizer:
        """The tokenizer, or InvalidRequestError naming the `feature` that needs one."""
        if self.parts.tokenizer is None:
            raise InvalidRequestError(f"{feature} needs a tokenizer, and this engine has none")
        return self.parts.tokenizer

    # --- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int] | None = None,
                 messages: Sequence[ChatMessage] | None = None) -> list[int]:
        """Prompt token ids from text, token ids, or chat messages (chat template applied)."""
        if messages is not None:
            return self.tokenizer.apply_chat_template(messages)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return self.tokenizer.encode(prompt)
        if prompt is None:
            raise InvalidRequestError("give a prompt or chat messages")
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if self.parts.check_token_ids and not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        grammar: Grammar | None = None,
    ) -> Request:
        """Queues a request; raises InvalidRequestError if it can never be served and
        EngineOverloadedError if the waiting queue is full. `priority`: lower is more urgent;
        only the priority policy takes one other than 0. `grammar`: the params' structured
        output compiled already (`compile_grammar`), else the engine compiles it."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt, messages)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        request = Request(
            request_id or f"req-{next(self._ids)}", token_ids, params,
            eos_token_ids=self.parts.tokenizer.eos_token_ids if self.parts.tokenizer is not None else frozenset(),
            priority=priority, arrival_time=arrival_time if arrival_time is not None else self.clock(),
            grammar=grammar,
        )
        self.enqueue_request(request)
        return request

    def compile_grammar(self, spec: StructuredOutputs) -> Grammar:
        """A request's grammar for `spec`; raises InvalidRequestError if it does not compile.
        Thread-safe, so that a server can compile (and refuse) outside the step loop."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer_for("structured output"),
                                                     self.model_config.vocab_size)
        return self._grammar_compiler.compile(spec)

    def check_params(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError (naming the field) for params beyond this engine's limits."""
        params.check_limits(vocab_size=self.model_config.vocab_size,
                            max_batch_size=self.scheduler_config.max_batch_size)

    def check_priority(self, priority: int) -> None:
        """Raises InvalidRequestError for a priority this engine's policy would ignore."""
        policy = self.scheduler_config.scheduling_policy
        if priority != 0 and policy not in (SchedulingPolicy.PRIORITY, SchedulingPolicy.SLO):
            raise InvalidRequestError(f"priority {priority}: this engine schedules by the {policy} policy; priorities "
                                      "need scheduling_policy=priority or slo (--scheduling-policy priority)")

    def enqueue_request(self, request: Request) -> None:
        """Queues a request built by the caller (its prompt already token ids); raises as
        `add_request` does."""
        limit = self.scheduler_config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloadedError(f"the waiting queue is full ({limit} requests); retry later")
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.check_priority(request.priority)
        if request.sampling_params.max_tokens is None:  # vLLM's None: up to the context's end
            room = max(self.scheduler_config.max_model_len - request.num_prompt_tokens, 1)  # 1: refused below
            request.sampling_params = dataclasses.replace(request.sampling_params, max_tokens=room)
        n = request.sampling_params.n
        if n > 1 and self.scheduler_config.scheduling_policy is SchedulingPolicy.STATIC:
            raise InvalidRequestError("n > 1 needs the continuous or priority policy (static reserves per request)")
        self.check_params(request.sampling_params)
        structured = request.sampling_params.structured_outputs
        if structured is not None and request.grammar is None:
            request.grammar = self.compile_grammar(structured)
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        self.output_processor.add(request)

    def abort(self, request_id: str) -> bool:
        """Ends a request at once and frees its KV blocks; False if it was not running."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT)
        self.output_processor.remove(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def cache_config_info(self) -> dict[str, str]:
        """The KV pool's configuration, labelled as vLLM's `cache_config_info` series labels it
        (`num_gpu_blocks`: the pool's blocks, whatever the device); `cache_dtype` is the type the
        pool holds (`kv_cache_dtype`, auto resolved)."""
        cache, loaded = self.config.cache, self.parts.loaded
        dtype = (str(select_kv_dtype(cache.kv_cache_dtype, loaded.model.dtype)).removeprefix("torch.")
                 if loaded is not None else cache.kv_cache_dtype)
        return {"block_size": str(cache.block_size), "cache_dtype": dtype,
                "num_gpu_blocks": str(self.block_manager.num_blocks),
                "enable_prefix_caching": str(cache.enable_prefix_caching)}

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters (see `EngineStats`)."""
        return scheduler_stats(self.scheduler, self.num_oom_errors, self.num_failed_steps)

    def reset_kv_peak(self) -> None:
        """Starts the KV peak afresh from the blocks in use now (a benchmark's run, say)."""
        self.block_manager.reset_peak()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, process outputs."""
        clock = self.clock
        start = clock()
        if self.speculator is not None:
            self.speculator.last_draft_s = 0.0
        out = self.scheduler.schedule()
        out.block_copies = self.block_manager.take_copies()
        scheduled = clock()
        result = self._execute(out)
        executed = clock()
        outputs = self._process(out, result)
        self._record(out, outputs, result.sampled, start, scheduled - start, clock() - executed)
        return outputs

    def _execute(self, out: SchedulerOutput) -> ModelStepResult:
        self.runner.last_timings = RunnerTimings()
        self.runner.last_logprobs = {}
        self.runner.last_prompt_logprobs = {}
        if out.is_empty:
            return ModelStepResult({})
        try:
            return ModelStepResult(self.runner.execute(out))
        except Exception as exc:  # a failed step fails its own requests, never the engine
            self.num_failed_steps += 1
            if is_out_of_memory(exc):
                self.num_oom_errors += 1
            logger.exception("step %d failed; failing its %d requests", out.step_id, len(out.scheduled))
            return ModelStepResult({}, exc)

    def _process(self, out: SchedulerOutput, result: ModelStepResult) -> list[RequestOutput]:
        if result.error is not None:
            # The exception's own text (allocator messages, shapes) goes to the log, not to clients.
            if is_out_of_memory(result.error):
                message = "out of memory in the model step; the request was ended"
            else:
                message = f"internal error in the model step ({type(result.error).__name__}); the request was ended"
            return [self._fail(s.request, message) for s in out.scheduled]
        sampled, logprobs = result.sampled, self.runner.last_logprobs
        for request_id, prompt_logprobs in self.runner.last_prompt_logprobs.items():  # empty unless asked
            self._requests[request_id].prompt_logprobs.extend(prompt_logprobs)
        self.scheduler.update_from_output(out, sampled)
        for s in out.scheduled:  # before a sample's first token can end it and free its blocks
            if s.request.awaits_fork and s.request.num_output_tokens == 1:
                self._fork(s.request)
        now = self.clock()
        outputs: list[RequestOutput] = []
        for s in out.scheduled:
            request = s.request
            tokens = sampled.get(request.request_id)
            if not tokens:
                continue
            # Taken back and given again one at a time, so that each is judged (stop rules, grammar,
            # max_tokens) as if it came alone; those after one that ends the request are dropped.
            del request.output_token_ids[-len(tokens):]
            token_logprobs = logprobs.get(request.request_id)
            for j, token in enumerate(tokens):
                request.output_token_ids.append(token)
                output = self._process_token(request, token, now,
                                             token_logprobs[j] if token_logprobs is not None else None)
                outputs.append(output)
                if output.finished:
                    break
        return outputs

    def _process_token(self, request: Request, token: int, now: float,
                       token_logprobs: TokenLogprobs | None) -> RequestOutput:
        """One new token of `request`, just appended to its output."""
        request.timings.add_token(now)
        if request.grammar is not None and not request.grammar.accept(token):
            # The mask allows only what the grammar accepts; a grammar stuck in an error (one
            # too complex for the parser, say) fails its own request. Its first line says why;
            # the parser's state dump that follows goes to the log.
            logger.info("request %s: structured output failed: %s", request.request_id, request.grammar.error)
            reason = request.grammar.error.splitlines()[0] if request.grammar.error else "no token allowed"
            return self._fail(request, f"structured output failed: {reason}", from_request=True)
        if token_logprobs is not None:
            request.output_logprobs.append(token_logprobs)
        text, finish = self.output_processor.process_token(request, token)
        if finish is not None:
            self._end(request, finish)
        first_with_prompt = request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 1
        return RequestOutput(request.request_id, [token], text, finish is not None, finish, request,
                             logprobs=token_logprobs,
                             prompt_logprobs=list(request.prompt_logprobs) if first_with_prompt else None)

    def _fork(self, parent: Request) -> None:
        """The other n - 1 samples of a prompt just computed, sharing its KV blocks."""
        children = [
            Request(sample_request_id(parent.request_id, j), parent.prompt_token_ids, parent.sampling_params,
                    eos_token_ids=parent.eos_token_ids, priority=parent.priority, arrival_time=parent.arrival_time,
                    sample_index=j, grammar=parent.grammar.fresh() if parent.grammar is not None else None)
            for j in range(1, parent.sampling_params.n)
        ]
        parent.samples = children
        self.scheduler.fork(parent, children)
        for child in children:
            self._requests[child.request_id] = child
            self.output_processor.add(child)

    def _end(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish(request, reason)
        self._requests.pop(request.request_id, None)
        self.output_processor.remove(request.request_id)

    def _fail(self, request: Request, message: str, from_request: bool = False) -> RequestOutput:
        request.error = message
        self._end(request, FinishReason.ERROR)
        return RequestOutput(request.request_id, [], "", True, FinishReason.ERROR, request, error=message,
                             error_from_request=from_request)

    def _record(self, out: SchedulerOutput, outputs: list[RequestOutput], sampled: dict[str, list[int]], start: float,
                schedule_s: float, process_s: float) -> None:
        timings = self.runner.last_timings
        record = StepRecord(
            step_id=out.step_id,
            start_s=start,
            duration_s=self.clock() - start,
            num_requests=len(out.scheduled),
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_spec_tokens=out.num_spec_tokens,
            num_accepted_tokens=sum(len(sampled.get(s.request.request_id, [0])) - 1
                                    for s in out.scheduled if s.spec_token_ids),
            num_wasted_tokens=out.num_wasted_tokens,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preempted=len(out.preempted),
            request_ids=tuple(s.request.request_id for s in out.scheduled),
            work=out.work(),
            schedule_s=schedule_s,
            prepare_s=timings.prepare_s,
            forward_s=timings.forward_s,
            sample_s=timings.sample_s,
            process_s=process_s,
            num_kv_live_tokens=self.block_manager.num_live_tokens(self.scheduler.running),
            draft_s=self.speculator.last_draft_s if self.speculator is not None else 0.0,
        )
        self.step_records.append(record)
        self.scheduler.observe_step(record.work, record.duration_s)
        if self.speculator is not None:  # the target's share: a drafter's time is its own cost
            self.speculator.observe_step(record.work, record.duration_s - record.draft_s)
        for observer in self.step_observers:
            observer(record, outputs)
