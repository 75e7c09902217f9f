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
from inflight.config import EngineConfig, ModelConfig
from inflight.sim.cost_model import CostModel
from inflight.sim.hardware import HardwareProfile
from inflight.sim.simulator import run_simulation, sim_engine


@dataclass(frozen=True)
class SimTarget:
    """What is simulated: a model's shapes on `tp` devices of one kind."""

    model_name: str
    shapes: ModelConfig
    hardware: HardwareProfile
    tp: int = 1
    gpu_memory_utilization: float = 0.9

    def describe(self) -> str:
        return f"{self.model_name} on {self.hardware.name}" + (f" x{self.tp}" if self.tp > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        hw = self.hardware.to_dict()
        hw.pop("schema")
        return {"kind": "simulated", "model": self.model_name, "tp": self.tp,
                "gpu_memory_utilization": self.gpu_memory_utilization, "hardware": hw}


def simulate(target: SimTarget, options: dict[str, Any], requests: Sequence[BenchRequest], label: str = "sim",
             max_concurrency: int | None = None, slo: RequestSLO | None = None) -> BenchRun:
    """Simulates the requests on an engine built with `options` (the engine's keyword options,
    as `inflight bench` takes them; device and seed are ignored)."""
    config = EngineConfig.from_kwargs(None, **options)
    cost_model = CostModel(target.shapes, target.hardware, target.tp, config.dtype)
    engine = sim_engine(config, cost_model, target.gpu_memory_utilization)
    capture = run_simulation(engine, requests, max_concurrency)
    recorded = {**options, "model": target.model_name, "hardware": target.hardware.name, "tp": target.tp,
                "dtype": cost_model.dtype, "num_kv_blocks_allocated": engine.block_manager.num_blocks}
    return BenchRun.measure(label, recorded, capture, slo)


def simulate_plans(target: SimTarget, base_options: dict[str, Any], plans: Sequence[RunPlan],
                   requests: Sequence[BenchRequest], max_concurrency: int | None = None,
                   slo: RequestSLO | None = None) -> list[BenchRun]:
    """Every `--compare`/`--sweep` plan, resolved as `inflight bench` resolves it."""
    return [simulate(target, resolve_options(base_options, plan), requests, plan.label, max_concurrency, slo)
            for plan in plans]
