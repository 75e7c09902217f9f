"""`inflight check --plan`: the checklist before the load test ("上线前检查清单").

From an engine's configuration (inflight's options, or vLLM's names: `--max-num-seqs`,
`--max-num-batched-tokens`, `--max-model-len`, `--kv-cache-memory-bytes`,
`--gpu-memory-utilization`, as flags or in its YAML config) and a workload spec, without sending
any traffic, flag what the load test would find the slow way:

- requests longer than `max_model_len` (refused);
- a prompt longer than the step's token budget with chunked prefill off (never scheduled);
- a KV pool that cannot hold the full batch at the workload's mean context (preemption ahead);
- a full step's time, predicted by the simulator's cost model on the hardware profile, above
  the SLA's p99 TBT (every decode in the batch waits that long whenever a prefill fills a step).

Each line carries the number behind it. The pool is sized as the engine would size it on the
profile's device (`CostModel.num_kv_blocks`), unless the configuration fixes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from inflight.bench.sla import SLA
from inflight.bench.workload import BenchRequest
from inflight.config import EngineConfig
from inflight.errors import ConfigError
from inflight.options import engine_option_names
from inflight.perf.cost_model import CostModel, SeqWork
from inflight.sim.runs import SimTarget

# vLLM's option names for what inflight calls otherwise; the rest share their names.
VLLM_NAMES = {"max_num_seqs": "max_batch_size", "max_num_batched_tokens": "max_num_tokens"}
# Options of the target rather than of the engine.
TARGET_NAMES = {"gpu_memory_utilization", "tensor_parallel_size"}


def read_engine_config(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(engine options, target options, keys not read) of a YAML config: inflight's option names
    or vLLM's (`vllm serve --config`: the long flags' names, dashes or underscores)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read engine config {path}: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"engine config {path}: expected a mapping of options")
    known = engine_option_names()
    options: dict[str, Any] = {}
    target: dict[str, Any] = {}
    ignored = []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = VLLM_NAMES.get(name, name)
        if name in TARGET_NAMES:
            target[name] = value
        elif name in known and name != "model":
            options[name] = value
        else:
            ignored.append(str(key))
    return options, target, ignored


@dataclass(frozen=True)
class PlanLine:
    name: str
    flagged: bool | None  # None: shown for information (no limit to hold it to)
    text: str

    @property
    def status(self) -> str:
        return "INFO" if self.flagged is None else "FLAG" if self.flagged else "OK"


@dataclass(frozen=True)
class Plan:
    lines: list[PlanLine]
    num_kv_blocks: int
    full_step_s: float
    decode_step_s: float

    @property
    def flags(self) -> list[PlanLine]:
        return [line for line in self.lines if line.flagged]


def check_plan(target: SimTarget, options: dict[str, Any], requests: Sequence[BenchRequest],
               sla: SLA | None = None) -> Plan:
    """The checklist for `requests` (their lengths) on the engine `options` describe."""
    if not requests:
        raise ConfigError("the workload has no requests")
    config = EngineConfig.from_kwargs(None, **options)
    sched, cache = config.scheduler, config.cache
    cost = target.cost_model(config.dtype)
    block = cache.block_size
    num_blocks = cache.num_kv_blocks or cost.num_kv_blocks(
        block, target.gpu_memory_utilization, cache.kv_cache_memory_fraction, cache.kv_cache_memory_bytes)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    lines = [_model_len_line(prompts, outputs, sched.max_model_len),
             _budget_line(prompts, sched.max_num_tokens, sched.enable_chunked_prefill)]
    batch = min(sched.max_batch_size, len(requests))
    mean_prompt, mean_output = sum(prompts) / len(prompts), sum(outputs) / len(outputs)
    # A running request holds its prompt and, on average, half its output.
    context = max(1, round(mean_prompt + mean_output / 2))
    lines.append(_kv_line(num_blocks, block, batch, context, mean_prompt, mean_output, sched.max_batch_size,
                          max(p + o for p, o in zip(prompts, outputs, strict=True)), cost))
    decode_s = cost.step_time([SeqWork(1, context, True)] * batch)
    full_s, chunk = _full_step(cost, batch, context, sched.max_num_tokens, sched.enable_chunked_prefill, max(prompts),
                               round(mean_prompt))
    lines.append(_step_line(cost, target, batch, context, chunk, full_s, decode_s, sched.max_num_tokens,
                            round(mean_prompt), sla))
    return Plan(lines, num_blocks, full_s, decode_s)


def _model_len_line(prompts: list[int], outputs: list[int], max_model_len: int) -> PlanLine:
    totals = [p + o for p, o in zip(prompts, outputs, strict=True)]
    longest = max(range(len(totals)), key=totals.__getitem__)
    over = sum(t > max_model_len for t in totals)
    shape = f"{prompts[longest]} + {outputs[longest]} = {totals[longest]} tokens"
    if over:
        return PlanLine("max_model_len", True, f"{over} of {len(totals)} requests exceed max_model_len "
                                                f"{max_model_len} (longest {shape}): they would be refused")
    return PlanLine("max_model_len", False, f"the longest request ({shape}) fits max_model_len {max_model_len}")


def _budget_line(prompts: list[int], budget: int, chunked: bool) -> PlanLine:
    longest = max(prompts)
    if chunked:
        return PlanLine("token budget", False, f"chunked prefill splits prompts into steps of at most {budget} "
                                               f"tokens (the longest, {longest}, in {math.ceil(longest / budget)})")
    over = sum(p > budget for p in prompts)
    if over:
        return PlanLine("token budget", True, f"the longest prompt, {longest} tokens, exceeds max_num_tokens "
                                              f"{budget} with chunked prefill off: {over} requests can never be "
                                              f"scheduled (enable chunked prefill or raise max_num_tokens to "
                                              f"{longest})")
    return PlanLine("token budget", False, f"every prompt (longest {longest}) fits max_num_tokens {budget} whole")


def _kv_line(num_blocks: int, block: int, batch: int, context: int, mean_prompt: float, mean_output: float,
             max_batch_size: int, longest: int, cost: CostModel) -> PlanLine:
    per_request = math.ceil(context / block)
    holds = num_blocks // per_request
    pool = (f"KV pool {num_blocks} blocks ({num_blocks * block} tokens, "
            f"{num_blocks * cost.kv_bytes_per_block(block) / 2**30:.2f} GiB)")
    at = f"at the mean context of {context} tokens (prompt {mean_prompt:.0f} + half the output {mean_output / 2:.0f})"
    if math.ceil(longest / block) > num_blocks:
        return PlanLine("KV pool", True, f"{pool} cannot hold the longest request alone ({longest} tokens)")
    if holds < batch:
        need = batch * per_request
        return PlanLine("KV pool", True, f"{pool} holds {holds} requests {at}; a batch of {batch} needs {need} "
                                         f"blocks: preemption ahead (max_batch_size {holds}, or {need} blocks)")
    return PlanLine("KV pool", False, f"{pool} holds {holds} requests {at}, the batch of {batch} "
                                      f"(max_batch_size {max_batch_size}) included")


def _full_step(cost: CostModel, batch: int, context: int, budget: int, chunked: bool, longest_prompt: int,
               mean_prompt: int) -> tuple[float, int]:
    """(seconds, prefill tokens) of a step at the token budget: the batch less one decoding at the
    mean context, and prefills filling the rest: prompts of the workload's mean length (the last
    one a chunk), or with chunked prefill off the longest prompt that fits whole."""
    decodes = min(batch - 1, budget - 1)
    room = budget - decodes
    work = [SeqWork(1, context, True)] * decodes
    if not chunked:
        room = min(room, longest_prompt)
        work.append(SeqWork(room, room, True))
        return cost.step_time(work), room
    size = max(1, mean_prompt)
    for start in range(0, room, size):
        n = min(size, room - start)
        work.append(SeqWork(n, n, True))
    return cost.step_time(work), room


def _step_line(cost: CostModel, target: SimTarget, batch: int, context: int, chunk: int, full_s: float,
               decode_s: float, budget: int, mean_prompt: int, sla: SLA | None) -> PlanLine:
    decodes = min(batch - 1, budget - 1)
    shape = (f"a full step ({decodes} decodes at {context} tokens of context + {chunk} prefill tokens = "
             f"{decodes + chunk} tokens) is predicted at {1000 * full_s:.0f} ms on {target.hardware.name} "
             f"({cost.engine.name}); a decode-only step of {batch} at {1000 * decode_s:.0f} ms")
    limit = sla.max_tbt_p99_ms if sla else None
    if limit is None:
        return PlanLine("step time", None, shape + " (no max_tbt_p99_ms in an SLA to hold it to)")
    if 1000 * full_s <= limit:
        return PlanLine("step time", False, f"{shape}: within the SLA's TBT p99 of {limit:g} ms")
    if 1000 * decode_s > limit:
        return PlanLine("step time", True, f"{shape}: even the decode-only step is above the SLA's TBT p99 of "
                                           f"{limit:g} ms (a smaller max_batch_size, or faster hardware)")
    lo, hi = decodes + 1, budget  # the largest budget whose full step fits: step time grows with it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if 1000 * _full_step(cost, batch, context, mid, True, mid, mean_prompt)[0] <= limit:
            lo = mid
        else:
            hi = mid - 1
    return PlanLine("step time", True, f"{shape}: above the SLA's TBT p99 of {limit:g} ms "
                                       f"(max_num_tokens {lo} would fit)")


def format_plan(plan: Plan, title: str, configuration: str, ignored: Sequence[str] = ()) -> str:
    out = [title, f"  configuration: {configuration}"]
    if ignored:
        out.append(f"  not read from the engine config: {', '.join(ignored)}")
    out += [f"  {line.status:<5} {line.name:<14} {line.text}" for line in plan.lines]
    flags = plan.flags
    out.append(f"RESULT: {len(flags)} flag{'s' if len(flags) != 1 else ''}"
               + (f" ({', '.join(line.name for line in flags)})" if flags else ": nothing found before traffic"))
    return "\n".join(out)
