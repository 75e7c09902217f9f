"""Rows (c), (d), (e), (h): inflight through its offline door, `LLMEngine.add_request` / `step`,
on one loaded model shared by the first three configurations (h: the model loaded with int8
matmuls, `--quantization int8`)."""

from __future__ import annotations

import math
from typing import Any

from peer_protocol import Clock, PeerRecord, PeerRequest, RunResult, warmup_requests

from inflight import LLM, SamplingParams
from inflight.model.loaded import LoadedModel

CONFIGS: dict[str, dict[str, Any]] = {
    "c": {"scheduling_policy": "static", "max_batch_size": 64},
    "d": {"enable_chunked_prefill": False, "max_num_tokens": 2048, "max_batch_size": 64},
    "e": {"enable_chunked_prefill": True, "max_num_tokens": 512, "max_batch_size": 64},
    "h": {"enable_chunked_prefill": True, "max_num_tokens": 512, "max_batch_size": 64, "quantization": "int8"},
}


def kv_blocks_for(requests: list[PeerRequest], block_size: int = 16) -> int:
    """A pool that holds every request at its full length at once: no preemption in any row,
    so the rows differ by scheduling alone."""
    need = sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / block_size) for r in requests)
    return need + len(requests)


def run_inflight(row: str, loaded: LoadedModel, requests: list[PeerRequest]) -> RunResult:
    options = {**CONFIGS[row], "num_kv_blocks": kv_blocks_for(requests)}
    engine = LLM(loaded=loaded, dtype="float32", device="cpu", **options).engine
    _drive(engine, warmup_requests(), Clock(warmup_requests()))
    engine.step_records.clear()
    clock = Clock(requests)
    records = _drive(engine, requests, clock)
    steps = list(engine.step_records)
    info = {
        "options": options,
        "num_steps": len(steps),
        "num_preemptions": sum(s.num_preempted for s in steps),
        "num_wasted_tokens": sum(s.num_wasted_tokens for s in steps),
    }
    return RunResult(f"inflight-{row}", clock.wall_s(records), records, info)


def _drive(engine: Any, requests: list[PeerRequest], clock: Clock) -> list[PeerRecord]:
    clock.start()
    handles = {}
    while clock.has_pending or engine.has_unfinished():
        for i in clock.due():
            r = requests[i]
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
            handles[i] = engine.add_request(r.prompt_token_ids, params, arrival_time=clock.t0 + r.arrival_s)
        if engine.has_unfinished():
            engine.step()
        else:
            clock.wait_for_next()
    records = []
    for i, r in enumerate(requests):
        request = handles[i]
        times = [t - clock.t0 for t in request.timings.token_times]
        records.append(PeerRecord(r.arrival_s, list(request.output_token_ids), times))
    return records
