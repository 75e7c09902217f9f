"""Injected faults through the real HTTP server: a model step that raises, or that runs out of
memory for real. Only the requests in that step fail, each with a clear error event; their KV
blocks return; requests not in that step (waiting at that moment, or arriving later) complete;
the failure metrics move. (`test_server_admission.py` covers a lone failing request.)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, NamedTuple

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from inflight import EngineConfig, LLMEngine
from inflight.engine.engine import is_out_of_memory
from inflight.engine.scheduler import SchedulerOutput
from inflight.model.loaded import LoadedModel
from inflight.server.config import ServerConfig
from inflight.server.launcher import serve_in_thread

MAX_BATCH_SIZE = 4
NUM_STREAMS = 2 * MAX_BATCH_SIZE  # half run when the fault strikes, half wait for a slot
MAX_TOKENS = 16


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "inflight:" + name and labels.items() <= s.labels.items())


def wait_idle(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(url, "num_requests_running") + metric(url, "num_requests_waiting") + \
            metric(url, "kv_cache_blocks_used") > 0:
        assert time.monotonic() < deadline, "the engine did not return to idle"
        time.sleep(0.05)


def run_out_of_memory() -> None:
    # A petabyte: past any machine's memory and past the 47-bit address space, so even an
    # overcommitting allocator refuses it. On CPU this raises RuntimeError "can't allocate memory".
    torch.empty(1 << 50, dtype=torch.uint8)


def raise_error() -> None:
    raise RuntimeError("injected model failure")


class StreamResult(NamedTuple):
    request_id: str | None
    text: str
    error: dict[str, Any] | None
    num_output_tokens: int | None
    done: bool


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamResult:
    request_id, parts, error, usage, done = None, [], None, None, False
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            error = event.get("error", error)
            request_id = event.get("id", request_id)
            usage = event.get("usage") or usage
            parts.extend(c["text"] for c in event.get("choices", []))
    return StreamResult(request_id, "".join(parts), error, usage and usage["completion_tokens"], done)


def test_the_real_allocation_failure_is_classified_as_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as info:
        run_out_of_memory()
    assert is_out_of_memory(info.value)
    assert not is_out_of_memory(RuntimeError("injected model failure"))


@pytest.mark.parametrize(("fault", "is_oom"), [(run_out_of_memory, True), (raise_error, False)], ids=["oom", "error"])
def test_a_failed_step_fails_only_its_requests(loaded: LoadedModel, fault: Any, is_oom: bool) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=256, max_batch_size=MAX_BATCH_SIZE), loaded)
    armed = threading.Event()
    failed_ids: list[str] = []

    def before_forward(out: SchedulerOutput) -> None:
        # Strike once, in a decode step of a full batch while others wait: so the step holds
        # streams already under way, and some concurrent requests are not in it.
        if armed.is_set() and len(out.scheduled) == MAX_BATCH_SIZE and engine.num_waiting > 0 and \
                all(s.request.num_output_tokens >= 2 for s in out.scheduled):
            armed.clear()
            failed_ids.extend(s.request.request_id for s in out.scheduled)
            fault()

    engine.runner.before_forward = before_forward  # set before the loop starts; only it calls this
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        url = running.url
        before = {name: metric(url, name) for name in ("num_oom_errors_total", "num_failed_steps_total")}
        errors_before = metric(url, "request_failure_total", reason="error")
        body = {"model": engine.model_name, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}

        async def run_all() -> list[StreamResult]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*(_stream(client, {**body, "prompt": f"Story {i}:"})
                                              for i in range(NUM_STREAMS)))

        armed.set()
        results = asyncio.run(run_all())
        assert not armed.is_set() and len(failed_ids) == MAX_BATCH_SIZE, "the fault never struck"

        by_id = {r.request_id: r for r in results}
        assert len(by_id) == NUM_STREAMS
        for request_id, result in by_id.items():
            assert result.done, "every stream ends with [DONE]"
            if request_id in failed_ids:
                assert result.error is not None and result.error["type"] == "server_error"
                expected = "out of memory in the model step" if is_oom else "internal error in the model step"
                assert expected in result.error["message"]
                assert result.num_output_tokens is None and len(result.text) > 0  # it had been streaming
            else:  # waiting when the step failed: served in full afterwards
                assert result.error is None and result.num_output_tokens == MAX_TOKENS

        wait_idle(url)  # the failed requests' KV blocks came back
        assert metric(url, "num_oom_errors_total") - before["num_oom_errors_total"] == (1 if is_oom else 0)
        assert metric(url, "num_failed_steps_total") - before["num_failed_steps_total"] == 1
        assert metric(url, "request_failure_total", reason="error") - errors_before == MAX_BATCH_SIZE
        assert httpx.get(url + "/health").status_code == 200
        again = httpx.post(url + "/v1/completions", json={**body, "prompt": "Again:", "stream": False}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == MAX_TOKENS
    engine.block_manager.check_invariants()
