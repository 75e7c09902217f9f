"""`--reasoning-parser`: a chat's <think> ... </think> sent as the message's reasoning, apart from
its content, streamed or whole, with tool calls read from the content alone."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import pytest

from inflight import EngineConfig, LLMEngine
from inflight.model.loaded import LoadedModel
from inflight.request import FinishReason
from inflight.server.config import ServerConfig
from inflight.server.launcher import RunningServer, serve_in_thread
from inflight.server.protocol import UsageInfo
from inflight.server.reasoning import ReasoningSplitter
from inflight.server.serving import _ChatFormat
from inflight.server.stream import Delta

# (output, qwen3's (reasoning, content), deepseek_r1's)
CASES = [
    ("<think>plan it</think>\n\nParis.", ("plan it", "\n\nParis."), ("plan it", "\n\nParis.")),
    ("plan it</think>Paris.", (None, "plan it</think>Paris."), ("plan it", "Paris.")),  # opened in the prompt
    ("<think>cut short by max_tok", ("cut short by max_tok", None), ("cut short by max_tok", None)),
    ("Paris.", (None, "Paris."), ("Paris.", None)),
    ("<thin", (None, "<thin"), ("<thin", None)),
    ("<think></think>Paris.", (None, "Paris."), (None, "Paris.")),
    ("<think>a </thin> b</think></think>", ("a </thin> b", "</think>"), ("a </thin> b", "</think>")),
    ("", (None, None), (None, None)),
]


def _pieces(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(("text", "qwen3", "deepseek_r1"), CASES)
def test_a_streamed_output_splits_as_the_whole_one_however_it_is_cut(text, qwen3, deepseek_r1):
    """Every way of cutting the output into two or three deltas (markers split included) gives
    the whole output's reasoning and content."""
    for parser, expected in (("qwen3", qwen3), ("deepseek_r1", deepseek_r1)):
        assert ReasoningSplitter.split(parser, text) == expected
        for n in (1, 2):
            for cuts in itertools.combinations(range(1, len(text)), n):
                splitter = ReasoningSplitter(parser)
                parts = [splitter.feed(p) for p in _pieces(text, cuts)] + [splitter.end()]
                reasoning = "".join(r for r, _ in parts) or None
                content = "".join(c for _, c in parts) or None
                assert (reasoning, content) == expected, (parser, cuts)


def _deltas(pieces: list[str]) -> list[Delta]:
    out, n = [], 0
    for i, text in enumerate(pieces):
        n += 1
        out.append(Delta(text, 1, FinishReason.STOP if i == len(pieces) - 1 else None, 7, n))
    return out


def test_tool_calls_are_read_from_the_answer_alone(loaded: LoadedModel):
    """A thought that mentions a tool call's tags is not a call; the answer's call is."""
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = ["<think>maybe <tool_", "call> later</th", "ink>\n", call[:20], call[20:]]
    whole = _ChatFormat("chatcmpl-1", "m", loaded.tokenizer, ("auto", None), "qwen3").response(
        [_deltas(pieces)], UsageInfo.of(7, len(pieces))).model_dump()
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "maybe <tool_call> later"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["weather"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    streamed = _ChatFormat("chatcmpl-1", "m", loaded.tokenizer, ("auto", None), "qwen3")
    chunks = [streamed.chunk(0, d) for d in _deltas(pieces)]
    deltas = [c.model_dump()["choices"][0]["delta"] for c in chunks if c is not None]
    assert "".join(d.get("reasoning", "") for d in deltas) == "maybe <tool_call> later"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "name" in c["function"]] \
        == ["weather"]
    plain = _ChatFormat("chatcmpl-1", "m", loaded.tokenizer).response([_deltas(["Paris."])], UsageInfo.of(7, 1))
    assert "reasoning" not in plain.model_dump()["choices"][0]["message"]  # no parser: no field


@pytest.fixture(scope="module")
def servers(loaded: LoadedModel) -> Iterator[tuple[RunningServer, RunningServer]]:
    with serve_in_thread(LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64), loaded),
                         ServerConfig(shutdown_timeout_s=5)) as plain, \
            serve_in_thread(LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64), loaded),
                            ServerConfig(shutdown_timeout_s=5, reasoning_parser="deepseek_r1")) as parsing:
        yield plain, parsing


def test_the_parser_over_http_streamed_and_whole(servers: tuple[RunningServer, RunningServer]):
    """deepseek_r1 on a model that never closes a thought: the whole output is its reasoning,
    the same streamed as whole, and the text a server without the parser gives as content."""
    plain, parsing = servers
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Name a city."}],
            "max_tokens": 12, "temperature": 0}
    expected = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=60).json()
    text = expected["choices"][0]["message"]["content"]
    assert text and "reasoning" not in expected["choices"][0]["message"]
    whole = httpx.post(parsing.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert (whole["reasoning"], whole["reasoning_content"], whole["content"]) == (text, text, None)
    reasoning, content = "", ""
    with httpx.stream("POST", parsing.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning", "")
                    content += choice["delta"].get("content", "") or ""
    assert (reasoning, content) == (text, "")
