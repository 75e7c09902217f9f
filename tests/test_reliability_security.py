"""Security basics: loopback by default, a warning when exposed without a key, the API key
compared in constant time, body and prompt size refused before any tokenizing, and prompts
never written to the logs. No test binds anything but 127.0.0.1."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight import EngineConfig, LLMEngine
from inflight.cli import build_parser
from inflight.model.loaded import LoadedModel
from inflight.server.cli import exposure_warning
from inflight.server.config import ServerConfig
from inflight.server.launcher import RunningServer, serve_in_thread

MAX_MODEL_LEN = 256
SECRET = "zebra-quartz-7731"  # a prompt no log line could contain by chance


@pytest.fixture(scope="module")
def server(loaded: LoadedModel) -> Iterator[RunningServer]:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=128, max_model_len=MAX_MODEL_LEN), loaded)
    # info: uvicorn's access log is on, as `inflight serve` has it by default.
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5), log_level="info") as running:
        yield running


def test_serve_binds_loopback_by_default() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_out_of_range_is_one_line_before_anything_loads(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The socket layer took 99999 as 34463 (99999 mod 65536) and served there, logging 99999.
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--port", port])
    assert exited.value.code == 2
    assert "argument --port:" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(("host", "api_key", "warned"), [
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False), ("127.0.0.2", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.20", None, True), ("my-host.example", None, True),
    ("0.0.0.0", "s3cret", False),
])
def test_exposed_without_a_key_warns(host: str, api_key: str | None, warned: bool) -> None:
    warning = exposure_warning(host, api_key)
    assert (warning is not None) == warned
    if warning is not None:
        assert host in warning and "API key" in warning


def test_api_key_is_compared_in_constant_time(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=16), loaded)
    with serve_in_thread(engine, ServerConfig(api_key="s3cret")) as running:
        models = running.url + "/v1/models"
        for key in ("s3crex", "s", "s3cret-and-more"):  # same length, shorter, longer: no shortcut
            assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}).status_code == 401
        assert httpx.get(models, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # A header that is not UTF-8 text is refused like any wrong key, not a 500.
        assert httpx.get(models, headers={"Authorization": b"Bearer \xff\xfe"}).status_code == 401
    assert [b for _, b in compared] == [b"s3cret"] * 5
    assert [a for a, _ in compared][:4] == [b"s3crex", b"s", b"s3cret-and-more", b"s3cret"]


def test_a_10mb_prompt_is_refused_before_it_is_read(server: RunningServer) -> None:
    body = json.dumps({"model": server.engine.model_name, "prompt": "x" * 10_000_000}).encode()
    start = time.monotonic()
    resp = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - start < 5


def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(server: RunningServer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    engine = server.engine
    tokenized: list[int] = []
    real = engine.tokenize

    def counting_tokenize(*args: Any) -> list[int]:
        tokenized.append(1)
        return real(*args)

    monkeypatch.setattr(engine, "tokenize", counting_tokenize)
    # Every token covers at most L characters (the longest in the vocabulary), so a text of
    # more than max_model_len * L characters has more than max_model_len tokens.
    limit = engine.max_prompt_chars
    assert limit % MAX_MODEL_LEN == 0 and limit // MAX_MODEL_LEN < 1000  # L: SmolLM2's is 81
    model = engine.model_name
    too_long = "ab " * (limit // 3 + 1)
    resp = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": too_long}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert "too long" in resp.json()["error"]["message"]
    chat = {"model": model, "messages": [{"role": "system", "content": too_long[: limit // 2]},
                                         {"role": "user", "content": too_long[: limit // 2 + 1]}]}
    resp = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert tokenized == []
    # Within the bound, the prompt is tokenized and refused on its real token count.
    resp = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": too_long[:limit]}, timeout=30)
    assert resp.status_code == 400 and "max_model_len" in resp.json()["error"]["message"]
    assert tokenized == [1]


_RUNS = st.builds(lambda c, n: c * n, st.sampled_from([" ", "\n", "#", "=", "-", "ab", "<|im_start|>", "é", "人"]),
                  st.integers(1, 400))


@given(text=st.text(min_size=1, max_size=300) | _RUNS | st.lists(_RUNS, min_size=1, max_size=5).map("".join))
@settings(max_examples=300, deadline=None)
def test_no_token_stands_for_more_characters_than_the_bound(server: RunningServer, text: str) -> None:
    # The soundness of the pre-check: characters <= tokens * L for any text, counting only the
    # characters the vocabulary can represent. SmolLM2 has no token for some control bytes
    # (0x06, for one; transformers' tokenizer drops them too): a prompt made of those is
    # refused by its length in characters, which the error message states.
    chars_per_token = server.engine.max_prompt_chars // MAX_MODEL_LEN
    represented = "".join(c for c in text if server.engine.tokenize(c))
    assert len(represented) <= chars_per_token * len(server.engine.tokenize(text))


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))  # with any traceback


def test_prompts_and_outputs_are_never_logged(server: RunningServer) -> None:
    capture = _Capture()
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "inflight"]
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # every level down: another server in this process may have raised uvicorn's
        lg.addHandler(capture)
        lg.setLevel(logging.DEBUG)
    try:
        url, model = server.url, server.engine.model_name
        requests: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"model": model, "prompt": f"Repeat: {SECRET}", "max_tokens": 8, "temperature": 0}),
            ("/v1/completions", {"model": model, "prompt": f"Say {SECRET}", "max_tokens": 4, "stream": True}),
            ("/v1/chat/completions", {"model": model, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": f"Say {SECRET}"}]}),
            ("/v1/completions", {"model": SECRET, "prompt": SECRET}),  # 404
            ("/v1/completions", {"model": model, "prompt": SECRET, "temperature": -1}),  # 400
            ("/v1/completions", {"model": model, "prompt": SECRET * 4000}),  # 400: too long
        ]
        outputs = [httpx.post(url + path, json=body, timeout=60) for path, body in requests]
        assert [r.status_code for r in outputs] == [200, 200, 200, 404, 400, 400]
        generated = outputs[0].json()["choices"][0]["text"].strip()
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(capture)
            lg.setLevel(level)
    access = [line for line in capture.lines if line.startswith("uvicorn.access")]
    assert len(access) >= len(requests), "the access log was not captured"
    assert any("POST /v1/completions" in line for line in access)
    for line in capture.lines:
        assert SECRET not in line
        assert len(generated) < 8 or generated not in line
