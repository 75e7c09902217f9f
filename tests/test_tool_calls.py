"""Tool calls through the official `openai` client: a named function or `"required"` constrain
the output to the tools' schemas and come back as `tool_calls`, whole or streamed; `"auto"`
reads Hermes' `<tool_call>` format, Llama 3's JSON, LFM2's Python-style calls or GLM's keys and
values where the chat template teaches one (else a 400); earlier calls and their results go back
into the template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

import inflight
from inflight import EngineConfig, LLMEngine
from inflight.model.loaded import LoadedModel
from inflight.server.config import ServerConfig
from inflight.server.launcher import RunningServer, serve_in_thread
from inflight.server.tools import (
    ToolCallReader,
    ToolMode,
    parse_hermes,
    parse_llama3_json,
    parse_tagged,
    tool_call_format,
)

HERMES_TEMPLATE = (Path(inflight.__file__).parent / "data" / "chatml_tools.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]


def assert_valid_call(name: str, arguments: str) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(arguments), schemas[name])  # and a KeyError for an unknown tool


# --- reading Hermes' format ------------------------------------------------------------------------

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}'
               '\n</tool_call>')


def test_hermes_calls_are_read_out_of_the_text() -> None:
    content, calls = parse_hermes(HERMES_TEXT)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Asia/Tokyo"})]
    assert len({c.id for c in calls}) == 2
    assert parse_hermes("no calls here") == ("no calls here", [])
    bad = "<tool_call>{not json}</tool_call> tail"
    assert parse_hermes(bad) == (bad, [])  # not a call: left as text


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_hermes_reading_equals_the_whole(step: int) -> None:
    reader = ToolCallReader("hermes")
    content, calls = "", []
    for i in range(0, len(HERMES_TEXT), step):
        piece, deltas = reader.feed(HERMES_TEXT[i:i + step])
        assert "<" not in piece  # the start of a tag is held back, never streamed as content
        content += piece
        calls += deltas
    piece, deltas = reader.end()
    content, calls = content + piece, calls + deltas
    whole_content, whole_calls = parse_hermes(HERMES_TEXT)
    assert content.strip() == whole_content
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole_calls)]


def test_text_that_only_looks_like_a_tag_is_streamed_in_the_end() -> None:
    reader = ToolCallReader("hermes")
    assert reader.feed("a <tool") == ("a ", [])
    assert reader.feed("box> b") == ("<toolbox> b", [])
    assert reader.end() == ("", [])


# --- reading Llama 3's JSON -------------------------------------------------------------------------

# The part of Llama 3.1's chat template that renders tools in the user turn, as Meta ships it
# (3.2's and 3.3's say the same); enough for `tool_call_format` and the server to render tools.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if loop.last and tools is not none and message.role == 'user' %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}{{- 'Do not use variables.\n\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content "
    "+ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
LLAMA3_TEXT = ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
               '{"name": "get_time", "parameters": {"zone": "Asia/Tokyo"}}')


def test_llama3_json_calls_are_read_and_prose_stays_content() -> None:
    assert tool_call_format(LLAMA3_TEMPLATE) == "llama3_json" and tool_call_format(HERMES_TEMPLATE) == "hermes"
    content, calls = parse_llama3_json("  " + LLAMA3_TEXT + "\n")
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Asia/Tokyo"})]
    for text in ("It is sunny in Paris.", '{"city": "Paris"}', '{"name": "get_weather", "parameters": {"ci',
                 '{"name": "get_time", "parameters": {}} and then some prose'):
        assert parse_llama3_json(text) == (text, [])  # not (all) calls: the answer as it stands


@pytest.mark.parametrize("text", [LLAMA3_TEXT, "It is sunny in Paris, {probably}.", "\n\n" + LLAMA3_TEXT])
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_streamed_llama3_json_reading_equals_the_whole(text: str, step: int) -> None:
    reader = ToolCallReader("llama3_json")
    content, calls = "", []
    for i in range(0, len(text), step):
        piece, deltas = reader.feed(text[i:i + step])
        content, calls = content + piece, calls + deltas
    piece, deltas = reader.end()
    content, calls = content + piece, calls + deltas
    whole_content, whole_calls = parse_llama3_json(text)
    assert (content or None) == whole_content
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole_calls)]


# --- reading LFM2's Python-style calls ---------------------------------------------------------------

# How LFM2's and LFM2.5's chat templates list the tools (the words llama.cpp recognizes them by), with
# the rest of a ChatML template around them.
LFM2_TEMPLATE = (
    "{{- bos_token -}}{%- if tools -%}{{- '<|im_start|>system\nList of tools: <|tool_list_start|>[' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{%- if not loop.last -%}, {% endif -%}{%- endfor -%}"
    "{{- ']<|tool_list_end|><|im_end|>\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")
LFM2_TEXT = ('Let me check.<|tool_call_start|>[get_weather(city="Paris", unit=\'celsius\'), '
             'get_time(zone="Asia/Tokyo")]<|tool_call_end|>Checking both.')


def test_lfm2_calls_are_read_out_of_the_text() -> None:
    """LFM2's format, as llama.cpp reads it: a list of Python calls between special tokens, each
    argument by keyword, its values Python literals or JSON's true, false and null; several calls
    in one tag. A tag whose body is not such a list stays in the text."""
    assert tool_call_format(LFM2_TEMPLATE) == "lfm2"
    assert tool_call_format(LFM2_TEMPLATE.replace("<|tool_list_start|>", "").replace("<|tool_list_end|>", "")) == (
        "lfm2")  # LFM2.5's, the list without its tokens
    content, calls = parse_tagged(LFM2_TEXT, "lfm2")
    assert content == "Let me check.Checking both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Asia/Tokyo"})]
    _, [call] = parse_tagged('<|tool_call_start|>[f(a=1, b=[true, None, 2.5], c={"k": null}, d=False)]'
                             '<|tool_call_end|>', "lfm2")
    assert json.loads(call.function.arguments) == {"a": 1, "b": [True, None, 2.5], "c": {"k": None}, "d": False}
    for body in ("[f(1)]", "f(a=1)", "[f(a=g(2))]", "[os.system(a=1)]", "[f(**k)]", "[f(a=1)", "[]", "[f(a=x)]"):
        text = f"<|tool_call_start|>{body}<|tool_call_end|>"
        assert parse_tagged(text, "lfm2") == (text, []), body  # not a list of calls by keyword: text


# --- reading GLM-4.5's to 4.7's keys and values ----------------------------------------------------

# How GLM-4.5's template teaches its calls (4.7's: the same without the newlines), with the rest of a
# ChatML template around it.
GLM_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\n# Tools\n<tools>\n' -}}{%- for tool in tools -%}"
    "{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}{{- '</tools>\nFor each function call, output the function "
    "name and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}"
    "</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call><|im_end|>\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")
GLM_TEXT = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>"
            "<tool_call>get_time<arg_key>zone</arg_key><arg_value>Asia/Tokyo</arg_value></tool_call> Checking both.")


def test_glm_calls_are_read_out_of_the_text() -> None:
    """GLM's format, as vLLM's glm45 reader takes it: a name, then keys and values, with newlines
    between (4.5's) or none (4.7's); a value stays as written where the tool's schema types it a
    string, else it is its JSON value where it has one. A tag whose body is not a name and its
    arguments stays in the text; under GLM's template "auto" reads this format, not Hermes' JSON."""
    from inflight.server.protocol import Tool
    from inflight.server.tools import string_args

    assert tool_call_format(GLM_TEMPLATE) == "glm45"
    content, calls = parse_tagged(GLM_TEXT, "glm45")
    assert content == "Let me check. Checking both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Asia/Tokyo"})]
    pairs = {"n": "12", "s": "[1, 2]", "o": '{"a": true}', "p": "True", "t": "a b"}
    typed = "<tool_call>f" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs.items())
    typed += "</tool_call>"
    schema = {"type": "object",
              "properties": {"n": {"type": "string"}, "s": {"type": "array"}, "o": {"type": "object"}}}
    strings = string_args([Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": schema}})])
    assert strings == {"f": frozenset({"n"})}
    _, [call] = parse_tagged(typed, "glm45", strings)
    assert json.loads(call.function.arguments) == {"n": "12", "s": [1, 2], "o": {"a": True}, "p": True, "t": "a b"}
    _, [untyped] = parse_tagged(typed, "glm45")  # (no schema: every value that parses is parsed)
    assert json.loads(untyped.function.arguments)["n"] == 12
    for body in ("", "get weather", "f<arg_key>a</arg_key>", "f<arg_key>a</arg_key><arg_value>1</arg_value> more",
                 "f\ntext<arg_key>a</arg_key><arg_value>1</arg_value>"):
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tagged(text, "glm45") == (text, []), body
    _, [no_arguments] = parse_tagged("<tool_call>now\n</tool_call>", "glm45")
    assert (no_arguments.function.name, no_arguments.function.arguments) == ("now", "{}")


# --- reading DeepSeek's calls (V3's, R1's and its distilled models', V3.1's) -----------------------

# How DeepSeek's templates teach their calls (R1's distilled models' alike), with the rest of a ChatML
# template around them.
DEEPSEEK_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\nYou may call functions. ' -}}{%- for tool in tools -%}"
    "{{- tool | tojson -}}{%- endfor -%}{{- ' Call them as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
    "<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><|im_end|>\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")
DEEPSEEK_TEXT = ('Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                 '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>get_time'
                 '<｜tool▁sep｜>{"zone": "Asia/Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜> Checking both.')


def test_deepseek_calls_are_read_out_of_the_text() -> None:
    """DeepSeek's format: a block of calls, each `function<｜tool▁sep｜>name` then the arguments'
    JSON in a fence (V3's, R1's) or `name<｜tool▁sep｜>` then the JSON (V3.1's); a block holding
    anything else, or a call that is not one, stays in the text."""
    assert tool_call_format(DEEPSEEK_TEMPLATE) == "deepseek"
    content, calls = parse_tagged(DEEPSEEK_TEXT, "deepseek")
    assert content == "Let me check. Checking both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Asia/Tokyo"})]
    call = "<｜tool▁call▁begin｜>{}<｜tool▁call▁end｜>"
    for body in ("", "text", call.format("f{}"), call.format("function<｜tool▁sep｜>f\n```json\n[1]\n```"),
                 call.format("get time<｜tool▁sep｜>{}"), call.format("f<｜tool▁sep｜>{}") + " more",
                 call.format("f<｜tool▁sep｜>{\"a\": ")):
        text = f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
        assert parse_tagged(text, "deepseek") == (text, []), body


@pytest.mark.parametrize("step", [1, 4, 5, 1000])
@pytest.mark.parametrize(("mode", "text"), [("lfm2", LFM2_TEXT), ("glm45", GLM_TEXT), ("deepseek", DEEPSEEK_TEXT)])
def test_streamed_tagged_reading_equals_the_whole(mode: ToolMode, text: str, step: int) -> None:
    reader = ToolCallReader(mode)
    content, calls = "", []
    for i in range(0, len(text), step):
        piece, deltas = reader.feed(text[i:i + step])
        assert "<|" not in piece and "<tool" not in piece and "<arg" not in piece and "<｜" not in piece
        content, calls = content + piece, calls + deltas
    piece, deltas = reader.end()
    content, calls = content + piece, calls + deltas
    whole_content, whole_calls = parse_tagged(text, mode)
    assert content == whole_content
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole_calls)]


# --- through the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(loaded: LoadedModel) -> Iterator[RunningServer]:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=256, max_batch_size=16), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        yield running


@pytest.fixture(scope="module")
def llama3_server(loaded: LoadedModel) -> Iterator[RunningServer]:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64, max_batch_size=4), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5, chat_template=LLAMA3_TEMPLATE)) as running:
        yield running


def test_auto_under_a_llama3_template_reads_its_json(llama3_server: RunningServer) -> None:
    """Under Llama 3's template "auto" is served (the model decides): an answer forced to be a
    call by its first tokens comes back as that call, whole and streamed alike."""
    body = {"model": llama3_server.engine.model_name, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 24,
            "temperature": 0}
    resp = httpx.post(llama3_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    rendered = httpx.post(llama3_server.url + "/tokenize", timeout=30, json={"messages": ASK, "tools": [WEATHER]})
    assert "Given the following functions" in llama3_server.engine.tokenizer.decode(rendered.json()["tokens"])
    message = resp.json()["choices"][0]["message"]
    content, calls = parse_llama3_json(message["content"] or "")
    assert message["tool_calls"] == [] and calls == []  # prose (the small model does not call): content
    forced = {**body, "tool_choice": "auto",
              "extra_body": {"guided_regex": r'\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}'}}
    for stream in (False, True):
        with _client(llama3_server) as client:
            if stream:
                content, streamed, finish = _streamed(client.chat.completions.create(**forced, stream=True))
                names = [c["name"] for c in streamed.values()]
                arguments = [c["arguments"] for c in streamed.values()]
            else:
                choice = client.chat.completions.create(**forced).choices[0]
                content, finish = choice.message.content, choice.finish_reason
                names = [c.function.name for c in choice.message.tool_calls or []]
                arguments = [c.function.arguments for c in choice.message.tool_calls or []]
        assert names == ["get_time"] and [json.loads(a) for a in arguments] == [{"zone": "UTC"}]
        assert not content and finish == "tool_calls"


def _forced_auto_calls(loaded: LoadedModel, template: str, regex: str,
                       max_tokens: int) -> Iterator[tuple[str | None, list[tuple[str, Any]], str | None]]:
    """Under `template`, "auto" with the answer forced to `regex`: (content, the calls' names and
    arguments, finish reason) of a whole response, then of a stream."""
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64, max_batch_size=4), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5, chat_template=template)) as server:
        body = {"model": server.engine.model_name, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": max_tokens,
                "temperature": 0, "tool_choice": "auto", "extra_body": {"guided_regex": regex}}
        with _client(server) as client:
            choice = client.chat.completions.create(**body).choices[0]
            yield choice.message.content, [(c.function.name, json.loads(c.function.arguments))
                                           for c in choice.message.tool_calls or []], choice.finish_reason
            content, streamed, finish = _streamed(client.chat.completions.create(**body, stream=True))
            yield content, [(c["name"], json.loads(c["arguments"])) for c in streamed.values()], finish


def test_auto_under_an_lfm2_template_reads_its_python_calls(loaded: LoadedModel) -> None:
    """Under LFM2's template "auto" reads its Python-style calls: an answer forced to be two calls in
    one tag, after some prose, comes back as those calls and the prose, whole and streamed alike
    (the embedded model's vocabulary writes the markers as text; LFM2's own has them as special
    tokens, which a request of this format keeps in its text)."""
    regex = (r'Sure\.<\|tool_call_start\|>\[get_time\(zone="UTC"\), get_weather\(city="Oslo", '
             r'unit="celsius"\)\]<\|tool_call_end\|>')
    for content, got, finish in _forced_auto_calls(loaded, LFM2_TEMPLATE, regex, 48):
        assert got == [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
        assert content == "Sure." and finish == "tool_calls"


def test_auto_under_a_deepseek_template_reads_its_calls(loaded: LoadedModel) -> None:
    """Under DeepSeek's template "auto" reads its calls block: an answer forced to be prose and two
    calls (V3's fenced form and V3.1's) comes back as those calls and the prose, whole and streamed
    alike (the embedded model's vocabulary writes DeepSeek's markers as text)."""
    regex = ('Sure\\.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\\n```json\\n'
             '\\{"zone": "UTC"\\}\\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
             '\\{"city": "Oslo", "unit": "celsius"\\}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    for content, got, finish in _forced_auto_calls(loaded, DEEPSEEK_TEMPLATE, regex, 160):
        assert got == [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
        assert content == "Sure." and finish == "tool_calls"


def test_auto_under_a_glm_template_reads_its_keys_and_values(loaded: LoadedModel) -> None:
    """Under GLM's template "auto" reads its calls: an answer forced to be prose and two calls, one a
    string that looks like a number (kept a string, as the tool's schema types it), comes back as
    those calls and the prose, whole and streamed alike."""
    regex = (r"Sure\.<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>2024</arg_value>\n</tool_call>"
             r"<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>unit</arg_key>"
             r"<arg_value>celsius</arg_value></tool_call>")
    for content, got, finish in _forced_auto_calls(loaded, GLM_TEMPLATE, regex, 160):
        assert got == [("get_time", {"zone": "2024"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
        assert content == "Sure." and finish == "tool_calls"


@pytest.fixture(scope="module")
def hermes_server(loaded: LoadedModel) -> Iterator[RunningServer]:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=256, max_batch_size=16), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5, chat_template=HERMES_TEMPLATE)) as running:
        yield running


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _streamed(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """Content, tool calls (index -> id, name, arguments) and finish reason, accumulated from
    chunks as the OpenAI SDK's users do."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function and d.function.name) or ""
                call["arguments"] += (d.function and d.function.arguments) or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_named_function_is_called_with_valid_arguments(server: RunningServer) -> None:
    model = server.engine.model_name
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    with _client(server) as client:
        resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                              max_tokens=64, temperature=0)
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "stop" and message.content is None
        (call,) = message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        assert_valid_call(call.function.name, call.function.arguments)
        streamed = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                                  tool_choice=choice, max_tokens=64, temperature=0, stream=True)
        content, calls, finish = _streamed(streamed)
    assert content == "" and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    assert server.engine.num_active == 0


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_one_or_more_tools(server: RunningServer, parallel: bool) -> None:
    model = server.engine.model_name
    with _client(server) as client:
        resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                              parallel_tool_calls=parallel, max_tokens=160, temperature=0)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            assert_valid_call(call.function.name, call.function.arguments)
        streamed = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                                  tool_choice="required", parallel_tool_calls=parallel,
                                                  max_tokens=160, temperature=0, stream=True)
        _, streamed_calls, finish = _streamed(streamed)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_auto_needs_a_template_that_teaches_a_readable_format(server: RunningServer,
                                                              hermes_server: RunningServer) -> None:
    body = {"model": server.engine.model_name, "messages": ASK, "tools": [WEATHER], "max_tokens": 24,
            "temperature": 0}
    for extra in ({}, {"tool_choice": "auto"}):  # auto is the default with tools
        resp = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice", resp.text
    resp = httpx.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["tool_calls"] == []
    # Under a Hermes template the model decides; whatever it wrote comes back as content or calls.
    resp = httpx.post(hermes_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert message["content"] or message["tool_calls"]
    for call in message["tool_calls"]:
        assert call["function"]["name"] and json.loads(call["function"]["arguments"]) is not None


def test_tools_and_earlier_calls_reach_the_template(hermes_server: RunningServer) -> None:
    conversation = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    resp = httpx.post(hermes_server.url + "/tokenize", timeout=30,
                      json={"messages": conversation, "tools": [WEATHER], "return_token_strs": False})
    assert resp.status_code == 200, resp.text
    text = httpx.post(hermes_server.url + "/detokenize", json={"tokens": resp.json()["tokens"]}, timeout=30).json()
    rendered = text["prompt"]
    assert '"name": "get_weather"' in rendered and "<tools>" in rendered
    assert '{"city": "Paris", "unit": "celsius"}' in rendered and "18 degrees and sunny" in rendered
    with _client(hermes_server) as client:
        reply = client.chat.completions.create(model=hermes_server.engine.model_name, messages=conversation,
                                               tools=[WEATHER], tool_choice="none", max_tokens=16, temperature=0)
    assert reply.choices[0].message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
], ids=["required-without-tools", "unknown-name", "duplicate-names", "bad-name", "with-response-format",
        "unknown-choice", "functions"])
def test_bad_tool_requests_get_a_400(server: RunningServer, body: dict[str, Any], param: str) -> None:
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"model": server.engine.model_name, "messages": ASK, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


def test_an_unreadable_chat_template_is_one_line_at_startup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from inflight.cli import main

    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("inflight: error: --chat-template: cannot read") and "\n" not in err
