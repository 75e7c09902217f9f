"""One simulated run as a bench run: engine options in, `BenchRun` out, so the bench's table,
JSON, plots and SLA check apply to it unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inflight.bench.metrics import RequestSLO
from inflight.bench.results import BenchRun
from inflight.bench.runs import RunPlan, resolve_options
from inflight.bench.workload import BenchRequest
from inflight.config import EngineConfig, MatmulStorage, ModelConfig
from inflight.errors import ConfigError
from inflight.fleet.routing import RouterConfig
from inflight.perf.cost_model import CostModel
from inflight.perf.profiles import EngineProfile, HardwareProfile, default_engine
from inflight.sim.fleet import run_fleet
from inflight.sim.shapes import checkpoint_storage, resolve_shapes
from inflight.sim.simulator import run_simulation, sim_engine


@dataclass(frozen=True)
class SimTarget:
    """What is simulated: a model's shapes on `tp` devices of one kind, run by one engine (its
    profile: kernels and step loop), with weights and KV cache in the given types (`auto`: the
    compute type, or the checkpoint's matrices as stored, `matmul_storage`, where inflight's CPU
    kernels keep them)."""

    model_name: str
    shapes: ModelConfig
    hardware: HardwareProfile
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    engine: EngineProfile | None = None  # None: the hardware's default
    weight_dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    matmul_storage: MatmulStorage | None = None

    @classmethod
    def of(cls, model: str | None, hardware: HardwareProfile, engine: EngineProfile | None = None,
           **options: Any) -> SimTarget:
        """`model` (a built-in shape's name, a checkpoint, None: the embedded model) on `hardware`:
        on a CPU, a local checkpoint's matrices priced as inflight's kernels read them, as stored
        (`checkpoint_storage`); a GPU engine's, and a named shape's, in the compute type."""
        name, shapes = resolve_shapes(model)
        stored = checkpoint_storage(model) if hardware.kind == "cpu" else None
        return cls(name, shapes, hardware, engine=engine, matmul_storage=stored, **options)

    @property
    def engine_profile(self) -> EngineProfile:
        return self.engine or default_engine(self.hardware)

    def cost_model(self, dtype: str | None = None, quantization: str = "none") -> CostModel:
        """`quantization` int8: inflight's W8A8 on a CPU (`--quantization int8`), priced at the
        hardware's int8 peak and the engine's calibrated efficiency for it."""
        weight_dtype, engine = self.weight_dtype, self.engine_profile
        if quantization == "int8":
            hw = self.hardware
            if hw.kind != "cpu":
                raise ConfigError(f"--quantization int8 is inflight's CPU W8A8; {hw.name} is a GPU "
                                  f"(its 8-bit weights: --weight-dtype int8)")
            if not (hw.peak_flops_int8 > 0 and engine.int8):
                raise ConfigError(f"{hw.name} has no int8 calibration: `inflight sim calibrate --quantization int8 "
                                  f"--base PROFILE.json -o FILE` on the machine adds it")
            weight_dtype, engine = "int8", engine.for_int8()
        elif quantization != "none":
            raise ConfigError(f"--quantization {quantization} is not modelled by the simulator (its matmuls have no "
                              f"calibrated profile)")
        return CostModel(self.shapes, self.hardware, self.tp, dtype, engine, weight_dtype, self.kv_cache_dtype,
                         self.matmul_storage)

    def describe(self) -> str:
        where = f"{self.model_name} on {self.hardware.name}" + (f" x{self.tp}" if self.tp > 1 else "")
        types = [f"{what} {t}" for what, t in (("weights", self.weight_dtype), ("KV", self.kv_cache_dtype))
                 if t != "auto"]
        return f"{where}, {self.engine_profile.name}" + (f" ({', '.join(types)})" if types else "")

    def to_dict(self) -> dict[str, Any]:
        hw, engine = self.hardware.to_dict(), self.engine_profile.to_dict()
        hw.pop("schema")
        engine.pop("schema")
        return {"kind": "simulated", "model": self.model_name, "tp": self.tp,
                "gpu_memory_utilization": self.gpu_memory_utilization, "weight_dtype": self.weight_dtype,
                "kv_cache_dtype": self.kv_cache_dtype,
                "matmul_storage": self.matmul_storage._asdict() if self.matmul_storage else None,
                "hardware": hw, "engine": engine}


# Options of the fleet, not of one engine: `replicas` engines behind the `router` policy.
FLEET_OPTIONS = ("replicas", "router")
# Options of the simulation, not of the engine: with speculative decoding, the chance that a
# proposed token is kept and that a lookup finds a proposal (properties of the workload and the
# proposer).
SIM_OPTIONS = ("acceptance_rate", "proposal_rate")


def simulate(target: SimTarget, options: dict[str, Any], requests: Sequence[BenchRequest], label: str = "sim",
             max_concurrency: int | None = None, slo: RequestSLO | None = None) -> BenchRun:
    """Simulates the requests on an engine built with `options` (the engine's keyword options,
    as `inflight bench` takes them; device and seed are ignored). With `replicas` N > 1 among
    them, on a fleet of N such engines behind the `router` policy (default prefix), as
    `inflight serve --replicas N` runs them."""
    engine_options = {k: v for k, v in options.items() if k not in FLEET_OPTIONS + SIM_OPTIONS}
    acceptance_rate, proposal_rate = options.get("acceptance_rate"), options.get("proposal_rate")
    replicas = int(options.get("replicas", 1))
    config = EngineConfig.from_kwargs(None, **engine_options)
    cost_model = target.cost_model(config.dtype, config.quantization)
    draft_cost_model = None
    speculative = config.scheduler.speculative
    if speculative is not None and speculative.model is not None:  # a draft model: its shapes, same device
        _, draft_shapes = resolve_shapes(speculative.model)
        stored = checkpoint_storage(speculative.model) if target.matmul_storage is not None else None
        draft_cost_model = cost_model.for_draft(draft_shapes, stored)
    recorded = {**options, "model": target.model_name, "hardware": target.hardware.name, "tp": target.tp,
                "engine_profile": cost_model.engine.name, "dtype": cost_model.dtype,
                "weight_dtype": cost_model.weight_dtype, "kv_cache_dtype": cost_model.kv_cache_dtype}
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    if replicas == 1:
        engine = sim_engine(config, cost_model, target.gpu_memory_utilization, acceptance_rate, draft_cost_model,
                            proposal_rate)
        capture = run_simulation(engine, requests, max_concurrency)
        recorded["num_kv_blocks_allocated"] = engine.block_manager.num_blocks
        return BenchRun.measure(label, recorded, capture, slo)
    if max_concurrency is not None:
        raise ConfigError("--max-concurrency is for one engine; a simulated fleet takes the whole workload")
    try:
        router = RouterConfig(options.get("router", "prefix"), seed=0)  # pow2's draws too: reproducible
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    engines = [sim_engine(config, cost_model, target.gpu_memory_utilization, acceptance_rate, draft_cost_model,
                          proposal_rate) for _ in range(replicas)]
    result = run_fleet(engines, requests, router)
    recorded.update(num_kv_blocks_allocated=engines[0].block_manager.num_blocks, routed=result.routed,
                    prefix_hit_rate=round(result.prefix_hit_rate, 4))
    return BenchRun.measure(label, recorded, result.capture, slo)


def simulate_plans(target: SimTarget, base_options: dict[str, Any], plans: Sequence[RunPlan],
                   requests: Sequence[BenchRequest], max_concurrency: int | None = None,
                   slo: RequestSLO | None = None) -> list[BenchRun]:
    """Every `--compare`/`--sweep` plan, resolved as `inflight bench` resolves it."""
    return [simulate(target, resolve_options(base_options, plan), requests, plan.label, max_concurrency, slo)
            for plan in plans]
