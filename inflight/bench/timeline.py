"""The step timeline of an in-process run: which requests each engine iteration computed, and
how many prefill, decode and wasted tokens. Recorded by a step observer on the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.bench.metrics import KvSample
from inflight.engine.output import RequestOutput, StepRecord


@dataclass(frozen=True, slots=True)
class StepSample:
    t_s: float  # step start, seconds from the run's start
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_wasted_tokens: int
    num_preempted: int
    request_indices: tuple[int, ...]  # workload indices of the requests computed in this step
    # Speculative decoding: proposed tokens the step verified, and of those the ones kept.
    num_spec_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class Timeline:
    steps: list[StepSample] = field(default_factory=list)
    # Workload index -> the step (index into `steps`) that produced the request's first token.
    first_token_step: dict[int, int] = field(default_factory=dict)
    # Workload index -> the step that produced its last token.
    last_token_step: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        keys = ("t_s", "duration_s", "num_prefill_tokens", "num_decode_tokens",
                "num_wasted_tokens", "num_preempted", "request_indices", "num_spec_tokens", "num_accepted_tokens")
        return {
            "step_fields": list(keys),
            "steps": [[_cell(getattr(s, k)) for k in keys] for s in self.steps],
            "first_token_step": {str(k): v for k, v in self.first_token_step.items()},
            "last_token_step": {str(k): v for k, v in self.last_token_step.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        keys = data["step_fields"]
        steps = []
        for row in data["steps"]:
            values = dict(zip(keys, row, strict=True))
            values["request_indices"] = tuple(values["request_indices"])
            steps.append(StepSample(**values))
        return cls(steps, {int(k): v for k, v in data["first_token_step"].items()},
                   {int(k): v for k, v in data["last_token_step"].items()})


class StepRecorder:
    """An engine step observer: turns each StepRecord into a StepSample and a KvSample, with
    times relative to `t0` (perf_counter seconds) and request ids mapped to workload indices."""

    def __init__(self, t0: float, num_kv_blocks: int, index_of: dict[str, int], block_size: int = 16) -> None:
        self.t0 = t0
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.index_of = index_of
        self.timeline = Timeline()
        self.samples: list[KvSample] = []

    def __call__(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        step = len(self.timeline.steps)
        indices = tuple(self.index_of[rid] for rid in record.request_ids if rid in self.index_of)
        self.timeline.steps.append(StepSample(
            record.start_s - self.t0, record.duration_s, record.num_prefill_tokens,
            record.num_decode_tokens, record.num_wasted_tokens, record.num_preempted, indices,
            record.num_spec_tokens, record.num_accepted_tokens,
        ))
        slots = record.num_kv_blocks_used * self.block_size
        self.samples.append(KvSample(
            record.start_s + record.duration_s - self.t0,
            100.0 * record.num_kv_blocks_used / self.num_kv_blocks,
            record.num_running, record.num_waiting,
            100.0 * record.num_kv_live_tokens / slots if slots else None,
        ))
        for out in outputs:
            index = self.index_of.get(out.request_id)
            if index is None or not out.new_token_ids:
                continue
            self.timeline.first_token_step.setdefault(index, step)
            self.timeline.last_token_step[index] = step


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    return list(value) if isinstance(value, tuple) else value
