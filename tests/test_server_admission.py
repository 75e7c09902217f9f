"""Who gets in: overload (429), API keys (401), and draining on shutdown (503, then a clean
error for requests past the drain timeout). Each test runs its own small in-thread server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest
from conftest import stream_in_background
from prometheus_client.parser import text_string_to_metric_families

from inflight import EngineConfig, LLMEngine
from inflight.model.loaded import LoadedModel
from inflight.server.config import ServerConfig
from inflight.server.launcher import serve_in_thread


def _engine(loaded: LoadedModel, **options: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=128, **options), loaded)


def _failures(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "inflight:request_failure_total" and s.labels.get("reason") == reason:
                return s.value
    return 0.0


def test_overload_gets_429_while_admitted_requests_complete(loaded: LoadedModel) -> None:
    engine = _engine(loaded, max_batch_size=1, max_waiting_requests=2)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        body = {"model": engine.model_name, "prompt": "Count to ten:", "max_tokens": 16, "ignore_eos": True}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(10)))

        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
        for r in responses:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 16
            else:
                error = r.json()["error"]
                assert error["type"] == "rate_limit_error" and "waiting queue is full" in error["message"]
        assert _failures(running.url, "overloaded") == statuses.count(429)
        # Once the queue drains, requests are admitted again.
        assert httpx.post(running.url + "/v1/completions", json={**body, "max_tokens": 2},
                          timeout=60).status_code == 200


def test_api_key_is_required_on_v1(loaded: LoadedModel) -> None:
    engine = _engine(loaded)
    with serve_in_thread(engine, ServerConfig(api_key="s3cret", served_model_name="tiny")) as running:
        base = running.url + "/v1"
        assert httpx.get(base + "/models").status_code == 401
        assert httpx.get(base + "/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(base + "/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        resp = httpx.post(base + "/completions", json={"model": "tiny", "prompt": "hi"})
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        # Health and metrics stay open to probes and scrapers.
        assert httpx.get(running.url + "/health").status_code == 200
        assert httpx.get(running.url + "/metrics").status_code == 200

        with (openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as bad,
              pytest.raises(openai.AuthenticationError)):
            bad.models.list()
        with openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0) as good:
            assert [m.id for m in good.models.list().data] == ["tiny"]
            out = good.completions.create(model="tiny", prompt="Hello", max_tokens=3)
            assert out.usage is not None and out.usage.completion_tokens >= 1
            with pytest.raises(openai.NotFoundError):
                good.completions.create(model=engine.model_name, prompt="Hello", max_tokens=3)


def test_shutdown_refuses_new_requests_and_ends_overdue_ones_cleanly(loaded: LoadedModel) -> None:
    engine = _engine(loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=1.0)) as running:
        body = {"model": engine.model_name, "prompt": "Tell me a long story.", "max_tokens": 1500,
                "ignore_eos": True, "stream": True}
        thread, lines = stream_in_background(running.url + "/v1/completions", body)
        running.server.should_exit = True
        deadline = time.monotonic() + 5
        while httpx.get(running.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(running.url + "/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        thread.join(30)
        assert not thread.is_alive()
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2] and "shutting down" in events[-2]


def test_a_failed_step_fails_its_request_and_the_loop_keeps_serving(loaded: LoadedModel) -> None:
    engine = _engine(loaded)
    fail_next = {"execute": False, "schedule": False}
    execute, schedule = engine.runner.execute, engine.scheduler.schedule

    def flaky_execute(out: Any) -> Any:
        if fail_next["execute"]:
            fail_next["execute"] = False
            raise RuntimeError("injected model failure")
        return execute(out)

    def flaky_schedule() -> Any:
        if fail_next["schedule"]:
            fail_next["schedule"] = False
            raise RuntimeError("injected scheduler failure")
        return schedule()

    # Patched before the loop starts; afterwards only the loop thread calls these.
    engine.runner.execute = flaky_execute  # type: ignore[method-assign]
    engine.scheduler.schedule = flaky_schedule  # type: ignore[method-assign]
    with serve_in_thread(engine, ServerConfig()) as running:
        body = {"model": engine.model_name, "prompt": "Hello there", "max_tokens": 4}
        with openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0) as client:
            # A failed model step: the engine fails the step's requests (500 / an SSE error event).
            fail_next["execute"] = True
            resp = httpx.post(running.url + "/v1/completions", json=body, timeout=30)
            message = resp.json()["error"]["message"]
            assert resp.status_code == 500 and "internal error in the model step" in message
            assert "injected" not in message  # exception text stays in the server log
            fail_next["execute"] = True
            with pytest.raises(openai.APIError, match="internal error in the model step"):
                list(client.completions.create(**body, stream=True))
            # Something unexpected in the engine's own bookkeeping: its requests fail, the loop lives.
            fail_next["schedule"] = True
            resp = httpx.post(running.url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"

            out = client.completions.create(**body)
            assert out.usage is not None and out.usage.completion_tokens >= 1
        text = httpx.get(running.url + "/metrics").text
        assert "inflight:num_failed_steps_total 2.0" in text
        assert _failures(running.url, "error") == 3
