"""Which engine configurations a bench invocation runs (`--compare`, `--sweep`), and running
them in-process over one loaded model."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inflight.bench.local import TurnClock, engine_steps, run_engine, warm_up
from inflight.bench.metrics import RequestSLO
from inflight.bench.results import BenchRun, Capture
from inflight.bench.workload import BenchRequest
from inflight.config import EngineConfig, SchedulerConfig
from inflight.engine.engine import LLMEngine, kv_pool_blocks, load_model_for
from inflight.errors import ConfigError
from inflight.model.loaded import LoadedModel
from inflight.options import engine_option_names

# Named engine configurations for --compare, as overrides of the base options.
PRESETS: dict[str, dict[str, Any]] = {
    "static": {"scheduling_policy": "static"},
    # Without chunked prefill a step must hold a whole prompt; see `resolve_options`.
    "continuous": {"scheduling_policy": "continuous", "enable_chunked_prefill": False},
    "chunked": {"scheduling_policy": "continuous", "enable_chunked_prefill": True},
    "priority": {"scheduling_policy": "priority", "enable_chunked_prefill": True},
    # The SLO policy with the targets given as engine options (--ttft-slo-ms, --tbt-slo-ms, --slo-from).
    "slo": {"scheduling_policy": "slo", "enable_chunked_prefill": True},
    "prefix-caching": {"enable_prefix_caching": True},
    "no-prefix-caching": {"enable_prefix_caching": False},
}


@dataclass(frozen=True, slots=True)
class RunPlan:
    label: str
    overrides: dict[str, Any]
    preset: str | None = None


def parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "on", "yes"):
        return True
    if lowered in ("false", "off", "no"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_sweep(text: str, extra: Sequence[str] = ()) -> tuple[str, list[Any]]:
    """`max_num_tokens=64,128,256` -> ("max_num_tokens", [64, 128, 256]); `extra`: option
    names allowed besides the engine's (the simulator's fleet options)."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    items = [v for v in values.split(",") if v.strip()]
    if not sep or not key or not items:
        raise ConfigError(f"--sweep wants OPTION=V1,V2,..., got {text!r}")
    if key not in engine_option_names() - {"model"} and key not in extra:
        raise ConfigError(f"--sweep: unknown engine option {key!r}")
    return key, [parse_value(v) for v in items]


def parse_compare(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        what = ", ".join(unknown) if unknown else repr(text)
        raise ConfigError(f"--compare: unknown configuration {what}; choose from {', '.join(PRESETS)}")
    return names


def plan_runs(compare: Sequence[str] = (), sweeps: Sequence[tuple[str, list[Any]]] = ()) -> list[RunPlan]:
    """One run per combination of a compared preset and one value of each swept option."""
    plans = []
    presets: list[str | None] = [*compare] or [None]
    for preset in presets:
        for values in itertools.product(*(v for _, v in sweeps)):
            swept = {k: v for (k, _), v in zip(sweeps, values, strict=True)}
            parts = ([preset] if preset else []) + [f"{k}={_fmt(v)}" for k, v in swept.items()]
            overrides = {**(PRESETS[preset] if preset else {}), **swept}
            plans.append(RunPlan(" ".join(parts) or "default", overrides, preset))
    return plans


def resolve_options(base: dict[str, Any], plan: RunPlan) -> dict[str, Any]:
    """The engine options of one run. The `continuous` preset (no chunked prefill) raises the
    step token budget to `max_model_len` when it is smaller, as vLLM does without chunked
    prefill: a whole prompt must fit one step, and a budget just big enough for the longest
    prompt would let that prompt in only when no request is decoding. `--reject-late` applies to
    the SLO policy's runs only."""
    options = {**base, **plan.overrides}
    if options.get("scheduling_policy") != "slo":
        options.pop("reject_late", None)  # the SLO policy's alone, when runs compare it with others
    if plan.preset == "continuous":
        max_model_len = options.get("max_model_len", SchedulerConfig().max_model_len)
        options["max_num_tokens"] = max(options.get("max_num_tokens", 0), max_model_len)
    return options


def run_in_process(model: str | None, base_options: dict[str, Any], plans: Sequence[RunPlan],
                   requests: Sequence[BenchRequest], *, max_concurrency: int | None = None,
                   slo: RequestSLO | None = None, progress: bool = True,
                   loaded: LoadedModel | None = None) -> list[BenchRun]:
    """Runs every plan on a fresh engine over one loaded model, one after the other."""
    configs, loaded = _checked_plans(model, base_options, plans, loaded)
    runs = []
    for plan, options in configs:
        config = EngineConfig.from_kwargs(model, **options)
        engine = LLMEngine(config, loaded)
        warm_up(engine)
        capture = run_engine(engine, requests, max_concurrency, progress, plan.label)
        runs.append(BenchRun.measure(plan.label, _recorded(options, engine), capture, slo))
        del engine, capture
        gc.collect()
    return runs


def _checked_plans(model: str | None, base_options: dict[str, Any], plans: Sequence[RunPlan],
                   loaded: LoadedModel | None) -> tuple[list[tuple[RunPlan, dict[str, Any]]], LoadedModel]:
    """Each plan with its engine options, every one checked before anything loads (a bad option
    fails fast), and the model they share (`loaded`, or loaded now)."""
    configs = [(plan, resolve_options(base_options, plan)) for plan in plans]
    for _, options in configs:
        EngineConfig.from_kwargs(model, **options)
    if loaded is None:
        loaded = load_model_for(EngineConfig.from_kwargs(model, **base_options))
    return configs, loaded


def _recorded(options: dict[str, Any], engine: LLMEngine) -> dict[str, Any]:
    """A run's engine options as recorded beside its figures, with what the engine made of them."""
    return {**options, "model": engine.model_name, "device": str(engine.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "num_kv_blocks_allocated": engine.block_manager.num_blocks}


def run_lockstep(model: str | None, base_options: dict[str, Any], plans: Sequence[RunPlan],
                 requests: Sequence[BenchRequest], *, max_concurrency: int | None = None,
                 slo: RequestSLO | None = None,
                 loaded: LoadedModel | Sequence[LoadedModel] | None = None) -> list[BenchRun]:
    """Every plan's engine runs the workload at once, taking turns step by step, each on a clock
    of its own that runs only during its turns (`TurnClock`): its steps, latencies and duration
    are its own work's, and a host whose speed drifts over the minutes of a run slows every plan
    alike (`run_in_process` runs the plans one after the other: there a second engine identical
    to the first ran 0.88-1.12x its tok/s on a shared 2-core host: `benchmarks/drift_check.py`).
    The turn goes to the engine least far through the workload (the share of its output tokens
    made; of those as far, the one with the fewest turns), so engines of different speeds cross
    the workload together and spread over the same minutes: taking one step each, an engine
    twice as fast finished halfway and the slower one ran its second half alone, in minutes the
    faster one never saw (a single stream's ratio to off moved from 1.96x to 1.77x between two
    rounds: in the first the speculating engines' plain steps took 7.0 ms against off's 7.8, in
    the second 7.8 as off's). The engines share the loaded weights and are alive together (one KV
    pool each); each sees the caches as the others' steps left them. Each KV pool is the size its
    engine would have alone (sized by the memory available before the first is built). `loaded`
    may give each plan a model of its own (the same weights, a model object apart: what differs
    is the model's, not an engine option)."""
    if loaded is None or isinstance(loaded, LoadedModel):
        configs, first = _checked_plans(model, base_options, plans, loaded)
        models = [first] * len(configs)
    else:
        models = list(loaded)
        if len(models) != len(plans):
            raise ValueError(f"{len(plans)} plans but {len(models)} loaded models")
        configs, _ = _checked_plans(model, base_options, plans, models[0])
    sizes = [kv_pool_blocks(EngineConfig.from_kwargs(model, **options), own)
             for (_, options), own in zip(configs, models, strict=True)]
    clocks = [TurnClock() for _ in configs]
    engines = []
    for (_, options), size, clock, own in zip(configs, sizes, clocks, models, strict=True):
        config = EngineConfig.from_kwargs(model, **{**options, "num_kv_blocks": size})
        engines.append(LLMEngine(config, own, clock=clock))
        with clock.turn():
            warm_up(engines[-1])
    steps = [engine_steps(engine, requests, max_concurrency, False) for engine in engines]
    captures: list[Capture | None] = [None] * len(engines)
    progress = [0.0] * len(engines)
    turns = [0] * len(engines)
    while running := [j for j, capture in enumerate(captures) if capture is None]:
        j = min(running, key=lambda i: (progress[i], turns[i], i))
        turns[j] += 1
        with clocks[j].turn():
            try:
                progress[j] = next(steps[j])
            except StopIteration as done:
                captures[j] = done.value
    runs = []
    for (plan, options), engine, capture in zip(configs, engines, captures, strict=True):
        assert capture is not None
        runs.append(BenchRun.measure(plan.label, {**_recorded(options, engine), "lockstep": True}, capture, slo))
    del engines, steps
    gc.collect()
    return runs


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
