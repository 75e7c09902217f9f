"""Simulated against measured: re-simulate the runs of an `inflight bench` run file (same
workload spec, same engine options, same KV pool) and set the figures side by side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from inflight.bench.metrics import BenchMetrics
from inflight.bench.results import BenchRun
from inflight.bench.timeline import Timeline
from inflight.bench.workload import BenchRequest, parse_workload
from inflight.config import CacheConfig, SchedulerConfig
from inflight.perf.cost_model import CostModel, SeqWork
from inflight.sim.runs import SimTarget, simulate
from inflight.sim.workload import synthetic_requests

# A measured step this much slower than the cost model says was most likely stalled by other
# work on the machine (another process, the allocator), not by its own composition.
STALL_RATIO = 1.5

FIGURES: list[tuple[str, Callable[[BenchMetrics], float | None]]] = [
    ("output throughput (tok/s)", lambda m: m.output_throughput),
    ("TTFT p50 (ms)", lambda m: m.ttft_ms.p50),
    ("TTFT p99 (ms)", lambda m: m.ttft_ms.p99),
    ("TBT p50 (ms)", lambda m: m.tbt_ms.p50),
    ("TBT p99 (ms)", lambda m: m.tbt_ms.p99),
    ("TPOT mean (ms)", lambda m: m.tpot_ms.mean),
    ("e2e p50 (ms)", lambda m: m.e2e_ms.p50),
    ("KV cache peak (%)", lambda m: m.kv_peak_perc),
    ("preemptions", lambda m: m.num_preemptions),
]


class StepReplay(NamedTuple):
    """The measured steps' own compositions priced by the cost model: how far the model is
    from each step, apart from how the run unfolded."""

    num_steps: int
    measured_s: float
    predicted_s: float
    median_ratio: float  # measured / predicted, per step
    num_stalled: int  # steps over STALL_RATIO times their prediction
    stalled_s: float  # the time those steps took beyond their prediction


class Comparison(NamedTuple):
    label: str
    measured: BenchMetrics
    simulated: BenchMetrics
    steps: StepReplay | None = None

    def rows(self) -> list[tuple[str, float | None, float | None, float | None]]:
        """(figure, measured, simulated, relative error in percent)."""
        out = []
        for name, get in FIGURES:
            m, s = get(self.measured), get(self.simulated)
            err = None if m is None or s is None or m == 0 else 100.0 * (s - m) / m
            out.append((name, m, s, err))
        return out


def engine_options_of(run: BenchRun) -> dict[str, Any]:
    """The engine options a measured run used, with its KV pool fixed to what it allocated."""
    names = set(CacheConfig.__dataclass_fields__) | set(SchedulerConfig.__dataclass_fields__) | {"dtype",
                                                                                                  "quantization"}
    options = {k: v for k, v in run.options.items() if k in names}
    if "num_kv_blocks_allocated" in run.options:
        options["num_kv_blocks"] = run.options["num_kv_blocks_allocated"]
    return options


def measured_acceptance_rate(metrics: BenchMetrics) -> float | None:
    """The simulator's acceptance rate (the chance a proposed token is kept once those before it
    were) that gives a measured run's tokens kept per verifying step at its mean proposal length:
    a solves a + a^2 + ... + a^L = kept per step, L = proposed per step (rounded)."""
    perc, per_draft = metrics.spec_acceptance_perc, metrics.spec_tokens_per_draft
    if perc is None or per_draft is None:
        return None
    kept = per_draft - 1
    if perc <= 0 or kept <= 0:
        return 0.0
    length = max(1, round(kept / (perc / 100)))
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        if sum(mid ** j for j in range(1, length + 1)) < kept:
            low = mid
        else:
            high = mid
    return low


def resimulate(document: dict[str, Any], runs: Sequence[BenchRun], target: SimTarget) -> list[Comparison]:
    spec = parse_workload(document["workload"]["spec"])
    requests = synthetic_requests(spec)
    out = []
    for run in runs:
        options = engine_options_of(run)
        rate = measured_acceptance_rate(run.metrics)
        if options.get("speculative_config") is not None and rate is not None:
            options["acceptance_rate"] = rate
            if run.metrics.spec_proposal_perc is not None:  # lookups that found a proposal
                options["proposal_rate"] = run.metrics.spec_proposal_perc / 100
        sim = simulate(target, options, requests, run.label, document.get("max_concurrency"))
        timeline = run.capture.timeline
        cost_model = target.cost_model(options.get("dtype"), options.get("quantization", "none"))
        # Prefix-cache hits are not in the timeline, so those steps cannot be rebuilt.
        hits = spec.shared_prefix is not None and options.get("enable_prefix_caching", True)
        steps = replay_steps(timeline, requests, cost_model) if timeline and timeline.steps and not hits else None
        out.append(Comparison(run.label, run.metrics, sim.metrics, steps))
    return out


def step_compositions(timeline: Timeline, requests: Sequence[BenchRequest]) -> list[list[SeqWork]]:
    """Each recorded step's composition, rebuilt from the requests it computed and its prefill
    token count: decodes first, then the prefill tokens handed out in the scheduler's order.
    Not for runs with prefix-cache hits; approximate after a preemption (neither is recorded
    per step)."""
    computed: dict[int, int] = {}
    steps = []
    for step in timeline.steps:
        batch, left = [], step.num_prefill_tokens
        prefilling = []
        decoding = [i for i in step.request_indices if computed.get(i, 0) >= requests[i].prompt_len]
        # Proposed tokens verified, and those kept (which request's is not recorded): spread over
        # the decodes, the kept ones in order, each request keeping at most what it verified.
        extra = [step.num_spec_tokens // len(decoding) + (j < step.num_spec_tokens % len(decoding))
                 for j in range(len(decoding))] if decoding else []
        kept, left_kept = [], step.num_accepted_tokens
        for e in extra:
            kept.append(min(e, left_kept))
            left_kept -= kept[-1]
        position = {i: j for j, i in enumerate(decoding)}
        for i in step.request_indices:
            done, prompt = computed.get(i, 0), requests[i].prompt_len
            if done >= prompt:
                j = position[i]
                n = 1 + extra[j]
                batch.append(SeqWork(n, done + n, n))
                computed[i] = done + 1 + kept[j]  # its context grows by its token and the kept proposals
            else:
                prefilling.append(i)
        for i in prefilling:
            done, prompt = computed.get(i, 0), requests[i].prompt_len
            n = min(prompt - done, left)
            left -= n
            batch.append(SeqWork(n, done + n, done + n == prompt))
            computed[i] = done + n
        steps.append(batch)
    return steps


def replay_steps(timeline: Timeline, requests: Sequence[BenchRequest], cost_model: CostModel) -> StepReplay:
    measured = np.array([s.duration_s for s in timeline.steps])
    predicted = np.array([cost_model.step_time(b) for b in step_compositions(timeline, requests)])
    stalled = measured > STALL_RATIO * predicted
    return StepReplay(len(measured), float(measured.sum()), float(predicted.sum()),
                      float(np.median(measured / predicted)), int(stalled.sum()),
                      float((measured - predicted)[stalled].sum()))


def format_comparisons(comparisons: Sequence[Comparison], title: str) -> str:
    lines = [title]
    for c in comparisons:
        lines.append(f"{'[' + c.label + ']':<30}{'measured':>10}{'simulated':>12}{'error':>9}")
        for name, m, s, err in c.rows():
            lines.append(f"  {name:<28}{_num(m):>10}{_num(s):>12}{'-' if err is None else f'{err:+.1f}%':>9}")
        if c.steps is not None:
            r = c.steps
            lines.append(f"  its {r.num_steps} steps priced by the cost model: "
                         f"measured {r.measured_s:.1f} s, predicted "
                         f"{r.predicted_s:.1f} s ({100 * (r.predicted_s - r.measured_s) / r.measured_s:+.1f}%), "
                         f"median step measured/predicted {r.median_ratio:.2f}")
            lines.append(f"  stalled steps (over {STALL_RATIO}x their prediction): {r.num_stalled}, "
                         f"{r.stalled_s:.1f} s beyond it")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"
