"""The server's own OpenAPI schema, fuzzed with schemathesis: every endpoint, schema-valid and
schema-violating inputs, on the real model. No input may get a 5xx or hang, and the server
must be healthy and idle afterwards.

Cost is bounded by the server, not the fuzzer: a small `max_model_len` caps every generation
(prompt and output together) at a few dozen tokens, and a small body limit caps the inputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis.checks import CheckFunction, not_a_server_error
from schemathesis.specs.openapi import checks

from inflight import EngineConfig, LLMEngine
from inflight.model.loaded import LoadedModel
from inflight.server.config import ServerConfig
from inflight.server.launcher import RunningServer, serve_in_thread

MAX_MODEL_LEN = 48  # a chat prompt takes 14+ tokens of it, so chats still run
# Per operation. Schema-violating inputs are refused before the engine, so they are cheap.
MAX_EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 100}
REQUEST_TIMEOUT_S = 30  # a hang shows as a timeout, which fails the case

CHECKS: list[CheckFunction] = [
    not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]
# What the schema forbids must be refused as the server documents it: 400, 404 for another
# model name, 413 for a body past the limit.
CONFIG = schemathesis.Config.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": ["400", "404", "413"]}}})


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "inflight:" + name and labels.items() <= s.labels.items())


@pytest.fixture(scope="module")
def server(loaded: LoadedModel) -> Iterator[RunningServer]:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=256, max_batch_size=8, max_model_len=MAX_MODEL_LEN),
                       loaded)
    config = ServerConfig(max_body_bytes=16 * 1024, default_max_tokens=4, shutdown_timeout_s=5)
    with serve_in_thread(engine, config) as running:
        yield running


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_input_gets_a_server_error(server: RunningServer, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=CONFIG)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                               "GET /v1/models", "GET /health", "GET /metrics"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # the GETs take no parameters: there is nothing to get wrong

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES[mode], deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=REQUEST_TIMEOUT_S)

        call()


# Bodies a schema-driven generator does not produce. The first three were 500s before the
# server parsed bodies with pydantic's JSON parser instead of json.loads.
HOSTILE_BODIES: list[tuple[str, str, bytes, int]] = [
    ("lone surrogate in prompt", "/v1/completions", b'{"model": "M", "prompt": "\\ud800 hi"}', 400),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"model": "M", "messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    ("nesting past the stack", "/v1/completions", b'{"model": "M", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("NaN literal", "/v1/completions", b'{"model": "M", "prompt": "hi", "temperature": NaN}', 400),
    ("4000-digit max_tokens", "/v1/completions",
     b'{"model": "M", "prompt": "hi", "max_tokens": 1' + b"0" * 4000 + b"}", 400),
    ("4000-digit seed", "/v1/completions",
     b'{"model": "M", "prompt": "hi", "max_tokens": 2, "temperature": 1, "seed": 1' + b"0" * 4000 + b"}", 200),
    ("denormal temperature", "/v1/completions",
     b'{"model": "M", "prompt": "hi", "max_tokens": 2, "temperature": 5e-324}', 200),
    ("huge penalties and top_k", "/v1/completions",
     b'{"model": "M", "prompt": "hi", "max_tokens": 2, "temperature": 1e308, "top_k": 1' + b"0" * 30 +
     b', "repetition_penalty": 1e308, "frequency_penalty": 2}', 200),
    ("integral floats", "/v1/completions", b'{"model": "M", "prompt": [1.0, 2.0], "max_tokens": 2.0}', 200),
]


@pytest.mark.parametrize(("name", "path", "body", "status"), HOSTILE_BODIES, ids=[b[0] for b in HOSTILE_BODIES])
def test_hostile_bodies_get_a_clean_answer(server: RunningServer, name: str, path: str, body: bytes,
                                           status: int) -> None:
    body = body.replace(b'"M"', f'"{server.engine.model_name}"'.encode())
    resp = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    if status == 400:
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_the_schema_carries_the_servers_limits(server: RunningServer) -> None:
    schema = httpx.get(server.url + "/openapi.json").json()
    body = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert body["model"]["anyOf"][0]["enum"] == [server.engine.model_name, ""]  # "" or none: the served model
    assert body["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": MAX_MODEL_LEN - 1}
    text, token_ids, *_ = body["prompt"]["oneOf"]
    assert text["minLength"] == 1 and text["maxLength"] == server.engine.max_prompt_chars
    assert token_ids["minItems"] == 1 and token_ids["items"]["minimum"] == 0
    assert body["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(schema["paths"][path]["post"]["responses"]) >= {"200", "400", "404", "413", "429", "500", "503"}


def test_healthy_and_idle_after_fuzzing(server: RunningServer) -> None:
    url = server.url
    deadline = time.monotonic() + 30
    while metric(url, "num_requests_running") + metric(url, "num_requests_waiting") + \
            metric(url, "kv_cache_blocks_used") > 0:
        assert time.monotonic() < deadline, "the engine is not idle after fuzzing"
        time.sleep(0.1)
    assert httpx.get(url + "/health").status_code == 200
    assert metric(url, "request_failure_total", reason="error") == 0
    assert metric(url, "num_failed_steps_total") == 0
    body = {"model": server.engine.model_name, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
