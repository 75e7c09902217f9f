"""`--reasoning-parser`: a chat's <think> ... </think> sent as the message's reasoning, apart from
its content, streamed or whole, with tool calls read from the content alone; structured output
constrains the answer only, the thought running free."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from inflight import LLM, EngineConfig, LLMEngine, SamplingParams
from inflight.model.loaded import LoadedModel
from inflight.model.tokenizer import Tokenizer
from inflight.request import FinishReason, Grammar, StructuredOutputs, ThinkMarkers
from inflight.server.config import ServerConfig
from inflight.server.launcher import RunningServer, serve_in_thread
from inflight.server.protocol import UsageInfo
from inflight.server.reasoning import ReasoningSplitter, reasoning_splitter, split_reasoning, think_markers
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
        assert split_reasoning(parser, text) == expected
        for n in (1, 2):
            for cuts in itertools.combinations(range(1, len(text)), n):
                splitter = ReasoningSplitter(parser)
                parts = [splitter.feed(p) for p in _pieces(text, cuts)] + [splitter.end()]
                reasoning = "".join(r for r, _ in parts) or None
                content = "".join(c for _, c in parts) or None
                assert (reasoning, content) == expected, (parser, cuts)


# gpt-oss's harmony (its markers are special tokens, which its chats keep): output -> (reasoning, content)
HARMONY = [
    ("<|channel|>analysis<|message|>User asks. Answer Paris.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Paris.", ("User asks. Answer Paris.", "Paris.")),
    ("<|channel|>final<|message|>Paris.<|return|>", (None, "Paris.")),  # a request that keeps its stop token
    ("<|channel|>analysis<|message|>a <|end of thought", ("a <|end of thought", None)),  # cut by max_tokens
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", ("a", None)),  # a header cut short
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Looking it up."
     "<|end|><|start|>assistant<|channel|>final<|message|>Paris.", ("a", "Looking it up.Paris.")),
    ("<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     (None, '{"city": "Paris"}')),
    ("Paris, <|the|> capital.", (None, "Paris, <|the|> capital.")),  # no markup: all content
    ("<|im_start|>Paris", (None, "<|im_start|>Paris")), ("<|st", (None, None)),
    ("", (None, None)),
]


@pytest.mark.parametrize(("text", "expected"), HARMONY)
def test_a_harmony_output_splits_by_channel_however_it_is_cut(text, expected):
    """openai_gptoss: the analysis channel's text is the reasoning, the others' the content, the
    markup neither, streamed in any two or three deltas (markers split included) as whole."""
    assert split_reasoning("openai_gptoss", text) == expected
    for n in (1, 2):
        for cuts in itertools.combinations(range(1, len(text)), n):
            splitter = reasoning_splitter("openai_gptoss")
            parts = [splitter.feed(p) for p in _pieces(text, cuts)] + [splitter.end()]
            assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None) == expected, cuts


# ... where the request has tools: a message to a recipient becomes a Hermes call in the content
HARMONY_CALLS = [
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",  # <|call|>: a stop token
     ("Need weather.", '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>')),
    ("<|start|>assistant to=functions.clock<|channel|>commentary json<|message|>{}<|call|>",
     (None, '<tool_call>{"name": "clock", "arguments": {}}</tool_call>')),
    ("<|channel|>final<|message|>Paris.", (None, "Paris.")),
]


@pytest.mark.parametrize(("text", "expected"), HARMONY_CALLS)
def test_a_harmony_call_becomes_a_hermes_call_however_it_is_cut(text, expected):
    assert split_reasoning("openai_gptoss", text, tool_calls=True) == expected
    for cuts in itertools.combinations(range(1, len(text)), 2):
        splitter = reasoning_splitter("openai_gptoss", tool_calls=True)
        parts = [splitter.feed(p) for p in _pieces(text, cuts)] + [splitter.end()]
        assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None) == expected, cuts


def test_a_harmony_call_is_an_openai_tool_call(loaded: LoadedModel):
    """Through the chat format with tools, whole and streamed: the call's name and arguments, the
    thought as reasoning, finish_reason tool_calls."""
    text = HARMONY_CALLS[0][0]
    pieces = [text[:40], text[40:95], text[95:]]
    whole = _ChatFormat("chatcmpl-1", "m", loaded.tokenizer, ("hermes", None), "openai_gptoss").response(
        [_deltas(pieces)], UsageInfo.of(7, 3)).model_dump()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["reasoning"] == "Need weather."
    [call] = whole["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("weather", {"city": "Paris"})
    streamed = _ChatFormat("chatcmpl-1", "m", loaded.tokenizer, ("hermes", None), "openai_gptoss")
    deltas = [c.model_dump()["choices"][0] for d in _deltas(pieces) if (c := streamed.chunk(0, d)) is not None]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if c["function"].get("name")] == ["weather"]
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls" and not any(d["delta"].get("content") for d in deltas)


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


def test_harmony_chats_keep_their_special_tokens_for_the_parser(loaded: LoadedModel):
    """openai_gptoss over HTTP: a chat's text keeps its special tokens, which the parser reads (an
    output opening with another special token is content, markers and all; without the parser
    the tokens are skipped); a structured output beside it is a 400 naming the field."""
    special = loaded.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Name a city."}],
            "max_tokens": 3, "temperature": 0, "logit_bias": {str(special): 100}}
    with serve_in_thread(LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64), loaded),
                         ServerConfig(shutdown_timeout_s=5, reasoning_parser="openai_gptoss")) as server:
        message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert (message["content"], message["reasoning"]) == ("<|im_start|>" * 3, None)
        refused = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            **body, "response_format": {"type": "json_object"}})
        assert refused.status_code == 400 and "openai_gptoss" in refused.json()["error"]["message"]
        # tools "auto": read from harmony's calls whatever the template (this one renders no tools)
        tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
        with_tools = httpx.post(server.url + "/v1/chat/completions", json={**body, "tools": [tool]}, timeout=60)
        assert with_tools.status_code == 200, with_tools.text
        assert with_tools.json()["choices"][0]["message"]["content"] == "<|im_start|>" * 3
    pieces = ["<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|chan", "nel|>final<|message|>Paris."]
    whole = _ChatFormat("chatcmpl-1", "m", loaded.tokenizer, None, "openai_gptoss").response(
        [_deltas(pieces)], UsageInfo.of(7, 2)).model_dump()["choices"][0]["message"]
    assert (whole["reasoning"], whole["reasoning_content"], whole["content"]) == ("Think.", "Think.", "Paris.")


# --- structured output beside a reasoning parser: the thought free, the answer constrained -------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a famous scientist as JSON with name and age."}]


def _run(llm: LLM, grammar: Grammar | None, max_tokens: int = 72) -> list[int]:
    engine = llm.engine
    request = engine.add_request(messages=ASK, params=SamplingParams(max_tokens=max_tokens, temperature=0),
                                 grammar=grammar)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    return list(request.output_token_ids)


def _markers_the_model_writes(free: list[int], at: int) -> int:
    """A token of the free output first seen at or after `at`: the thought's end stands in for
    </think> (the embedded model has no thought markers of its own)."""
    return next(t for i, t in enumerate(free) if i >= at and t not in free[:i])


@pytest.fixture(scope="module")
def json_grammar(loaded: LoadedModel, make_llm: Callable[..., LLM]) -> tuple[LLM, Grammar, list[int]]:
    llm = make_llm()
    return llm, llm.engine.compile_grammar(StructuredOutputs(json=PERSON)), _run(llm, None)


@pytest.mark.parametrize("opens", [False, True], ids=["deepseek_r1", "qwen3"])
def test_the_grammar_waits_for_the_thought_to_end(json_grammar, opens: bool) -> None:
    """The output runs as it would unconstrained up to the thought's end, and the answer after it
    matches the schema; for qwen3 the thought must open with the first token."""
    llm, grammar, free = json_grammar
    end = _markers_the_model_writes(free, 6)
    cut = free.index(end) + 1
    start = free[0] if opens else llm.engine.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    out = _run(llm, grammar.after_thinking(ThinkMarkers(start, end, opens)))
    assert out[:cut] == free[:cut]
    answer = llm.engine.tokenizer.decode(out[cut:])
    assert json.loads(answer).keys() == {"name", "age"}, answer
    constrained = _run(llm, grammar.fresh())
    assert constrained != out


def test_a_qwen3_output_that_does_not_open_a_thought_is_all_answer(json_grammar) -> None:
    """A first token other than <think> starts the answer: the output is the grammar's own."""
    llm, grammar, free = json_grammar
    tokenizer = llm.engine.tokenizer.hf
    start, end = tokenizer.convert_tokens_to_ids("<|im_start|>"), _markers_the_model_writes(free, 6)
    assert _run(llm, grammar.after_thinking(ThinkMarkers(start, end, True))) == _run(llm, grammar.fresh())


def test_speculation_keeps_a_thinking_grammars_tokens(loaded: LoadedModel, make_llm: Callable[..., LLM],
                                                      json_grammar) -> None:
    """Proposals across the thought's end are cut where the answer's grammar refuses them and
    rolled back with the thought's state: the same tokens as without speculation."""
    llm, grammar, free = json_grammar
    markers = ThinkMarkers(free[0], _markers_the_model_writes(free, 6), True)
    expected = _run(llm, grammar.after_thinking(markers))
    spec = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                        "adaptive": False})
    assert _run(spec, grammar.after_thinking(markers)) == expected
    assert sum(s.num_spec_tokens for s in spec.engine.step_records) > 0


def test_a_thinking_grammars_state_through_accept_validate_and_rollback(json_grammar) -> None:
    llm, _, _ = json_grammar
    tokenizer = llm.engine.tokenizer
    grammar = llm.engine.compile_grammar(StructuredOutputs(regex="yes|no"))
    (yes,), (maybe,) = tokenizer.encode("yes", False), tokenizer.encode("maybe", False)
    start, end, word = (tokenizer.encode(t, False)[0] for t in (" Hmm", " So", " think"))
    g = grammar.after_thinking(ThinkMarkers(start, end, opens=True))
    assert g.constrains and g.also_allowed == start  # the first token: the grammar's or <think>
    assert g.valid_prefix([yes]) == 1 and g.valid_prefix([maybe]) == 0
    assert g.valid_prefix([start, word, maybe, end, yes, yes]) == 5 and g.valid_prefix([start, word]) == 2
    assert g.accept(start) and not g.constrains and g.also_allowed is None
    assert g.accept(maybe) and g.accept(end) and g.constrains and not g.is_complete
    assert g.valid_prefix([maybe]) == 0 and g.valid_prefix([yes]) == 1
    assert g.accept(yes) and g.is_complete
    g.rollback(2)  # back inside the thought
    assert not g.constrains and g.valid_prefix([maybe, end, yes]) == 3
    g.rollback(2)  # back before it
    assert g.also_allowed == start
    assert g.accept(yes) and g.is_complete  # no thought: the first token is the answer's
    g.rollback(1)
    assert g.also_allowed == start and g.accept(start) and not g.constrains  # undecided again: may still think
    g.rollback(1)
    assert not g.accept(maybe)
    r1 = grammar.after_thinking(ThinkMarkers(start, end, opens=False))
    assert not r1.constrains and r1.valid_prefix([yes, maybe, end, yes]) == 4
    assert r1.fresh().think == r1.think


def test_think_markers_are_the_vocabularys_tokens_or_none(loaded: LoadedModel) -> None:
    assert think_markers("qwen3", loaded.tokenizer) is None  # the embedded model has none
    hf = copy.deepcopy(loaded.tokenizer.hf)
    hf.add_tokens(["<think>", "</think>"])
    markers = think_markers("deepseek_r1", Tokenizer(hf))
    assert markers == ThinkMarkers(len(hf) - 2, len(hf) - 1, opens=False)
    assert think_markers("qwen3", Tokenizer(hf)).opens


def test_a_structured_chat_beside_deepseek_r1_on_a_model_without_markers_is_a_400(
        servers: tuple[RunningServer, RunningServer]) -> None:
    """Its answer could not be told from its thought: refused, naming the field, not constrained
    whole into what the parser would call reasoning."""
    _, parsing = servers
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": ASK, "max_tokens": 12,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    resp = httpx.post(parsing.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "response_format" and "</think>" in error["message"]
