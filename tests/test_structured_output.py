"""Structured output: every constraint's outputs match it, in the engine and through the server
(the official `openai` client), unconstrained rows of the same batch are untouched, preemption
keeps a grammar's state, and a constraint that does not compile is a clear error."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inflight import LLM, EngineConfig, LLMEngine, SamplingParams
from inflight.errors import InvalidRequestError
from inflight.model.loaded import LoadedModel
from inflight.request import Grammar, StructuredOutputs
from inflight.server.config import ServerConfig
from inflight.server.launcher import RunningServer, serve_in_thread

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["English", "French", "Chinese"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a famous scientist as JSON with name, age and languages."}]


def assert_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)  # raises with the violation


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(max_batch_size=16)


def generate(llm: LLM, prompt: Any, constraint: StructuredOutputs, **params: Any) -> list[Any]:
    params.setdefault("max_tokens", 96)
    params.setdefault("temperature", 0)
    return llm.generate([prompt], SamplingParams(structured_outputs=constraint, **params))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 3}],
                         ids=["greedy", "sampled-n3"])
def test_json_schema_outputs_parse_and_match_the_schema(llm: LLM, sampling: dict[str, Any]) -> None:
    outs = generate(llm, ASK_PERSON, StructuredOutputs(json=PERSON), **sampling)
    assert len(outs) == sampling.get("n", 1)
    for out in outs:
        assert out.finish_reason == "stop", out.text  # the grammar ends the output once complete
        assert_person(out.text)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_json_object_regex_choice_and_grammars_are_each_met(llm: LLM) -> None:
    prompt = [{"role": "user", "content": "Answer briefly: is the sky blue? Then give a phone number."}]
    (obj,) = generate(llm, prompt, StructuredOutputs(json_object=True), max_tokens=200)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert obj.text.lstrip().startswith("{")
    (phone,) = generate(llm, prompt, StructuredOutputs(regex=r"\(\d{3}\) \d{3}-\d{4}"))
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    choices = ("yes", "no", "it depends")
    answers = {generate(llm, prompt, StructuredOutputs(choice=choices), temperature=1.0, seed=s)[0].text
               for s in range(6)}
    assert answers <= set(choices) and answers
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    (gbnf_out,) = generate(llm, prompt, StructuredOutputs(grammar=gbnf))
    assert re.fullmatch(r"The answer is \d\d\.", gbnf_out.text), gbnf_out.text
    lark = 'start: "colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"'
    (lark_out,) = generate(llm, prompt, StructuredOutputs(grammar=lark))
    assert lark_out.text in {"colour: red", "colour: green", "colour: blue"}


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 1e30, 1e308], ids=["denormal", "tiny", "huge", "inf-in-fp32"])
@pytest.mark.parametrize("temperature", [0, 5e-324, 1.0], ids=["greedy", "denormal-temperature", "sampled"])
def test_no_logit_edit_lets_a_forbidden_token_through(llm: LLM, penalty: float, temperature: float) -> None:
    """Penalties at the ends of their range (in fp32, 5e-324 is 0 and 1e308 is inf) turn some
    logits into +inf or NaN; a large logit_bias on a token the grammar forbids: the output still
    matches the grammar, and the request ends as a grammar ends it, not as a failure."""
    pattern = r"[a-c]{4}d"
    prompt = "abcd abcd abca abcd abcd abcb"  # repeated, so that the penalty meets seen tokens
    forbidden = llm.tokenizer.encode(" hello", add_special_tokens=False)[0]
    for seed in range(3):
        (out,) = generate(llm, prompt, StructuredOutputs(regex=pattern), temperature=temperature, seed=seed,
                          repetition_penalty=penalty, presence_penalty=2.0, frequency_penalty=-2.0,
                          logit_bias=((forbidden, 100.0),), max_tokens=12)
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), (out.finish_reason, out.text)
    assert llm.engine.block_manager.num_used_blocks == 0


EDGES = {"temperature": [0, 5e-324, 1e-6, 0.7, 1e300], "top_p": [1e-300, 0.5, 1.0], "top_k": [0, 1, 7],
         "min_p": [0.0, 0.5, 1.0], "repetition_penalty": [5e-324, 1e-30, 1.0, 1e30, 1e308],
         "presence_penalty": [-2.0, 0.0, 2.0], "frequency_penalty": [-2.0, 0.0, 2.0], "seed": [None, 5]}


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.fixed_dictionaries({name: st.sampled_from(values) for name, values in EDGES.items()},
                                      optional={"constrained": st.booleans(), "bias": st.sampled_from([-100.0, 100.0]),
                                                "n": st.integers(1, 2)}),
                min_size=1, max_size=4))
def test_sampling_settings_at_their_edges_keep_the_grammar(llm: LLM, batch: list[dict[str, Any]]) -> None:
    """Batches of requests whose settings sit at the ends of their ranges (several overflow or
    round to 0 in fp32), some constrained: every output finishes as a grammar or max_tokens ends
    it, and each constrained one matches its regex."""
    pattern = r"(abc |abd ){1,6}"
    prompt = "abc abd abc abc abd abc abd abd"
    params = []
    for row in batch:
        options = {k: v for k, v in row.items() if k in EDGES}
        bias = ((llm.tokenizer.encode(" the", add_special_tokens=False)[0], row["bias"]),) if "bias" in row else ()
        constraint = StructuredOutputs(regex=pattern) if row.get("constrained") else None
        params.append(SamplingParams(max_tokens=10, n=row.get("n", 1), logit_bias=bias,
                                     structured_outputs=constraint, **options))
    outs = llm.generate([prompt] * len(params), params)
    samples = [p for p in params for _ in range(p.n)]
    for sample, out in zip(samples, outs, strict=True):
        assert out.finish_reason in ("stop", "length"), (sample, out)
        if sample.structured_outputs is not None:
            assert re.fullmatch(r"(abc |abd )*(a|ab|abc|abd)?", out.text), (sample, out.text)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_unconstrained_rows_of_the_batch_are_untouched(llm: LLM) -> None:
    prompts = ["The capital of France is", "List three uses of a paperclip:\n1.", "Once upon a time"]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, plain)]
    constrained = SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputs(json=PERSON))
    mixed = llm.generate([prompts[0], ASK_PERSON, prompts[1], ASK_PERSON, prompts[2]],
                         [plain, constrained, plain, constrained, plain])
    assert [mixed[i].token_ids for i in (0, 2, 4)] == alone
    assert mixed[1].token_ids == mixed[3].token_ids  # two copies of one constraint, each its own state


def test_a_preempted_request_keeps_its_grammar(make_llm: Callable[..., LLM]) -> None:
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(json=PERSON))
    (reference,) = make_llm().generate([ASK_PERSON], params)
    # 9 blocks of 16 tokens: the two requests' prompts (~40 tokens each) fit, their outputs do
    # not, so the later one is preempted and recomputed mid-output.
    small = make_llm(num_kv_blocks=9, max_batch_size=2)
    outs = small.generate([ASK_PERSON, ASK_PERSON], params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [reference.token_ids] * 2
    assert small.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("constraint", [
    StructuredOutputs(regex="(unclosed"),
    StructuredOutputs(json="{not json"),
    StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
    StructuredOutputs(grammar="root ::= missing_rule"),
], ids=["regex", "json-text", "schema", "grammar"])
def test_a_constraint_that_does_not_compile_is_refused(llm: LLM, constraint: StructuredOutputs) -> None:
    with pytest.raises(InvalidRequestError, match="cannot compile"):
        llm.generate(["hi"], SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished()


def test_structured_outputs_take_exactly_one_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputs(choice=())


# --- through the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(loaded: LoadedModel) -> Iterator[RunningServer]:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=256, max_batch_size=16), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        yield running


@pytest.fixture()
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_response_format_through_the_openai_client(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.model_name
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=96, temperature=0,
                                          response_format=fmt)
    assert resp.choices[0].finish_reason == "stop"
    assert_person(resp.choices[0].message.content or "")
    stream = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=96, temperature=1.0,
                                            seed=3, n=2, response_format=fmt, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        assert_person(text)
    obj = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    assert server.engine.num_active == 0


def test_vllms_guided_fields_on_completions(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.model_name
    resp = client.completions.create(model=model, prompt=["Is water wet?", "Is fire cold?"], max_tokens=8,
                                     temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert [c.text in {"yes", "no"} for c in resp.choices] == [True, True]
    resp = client.completions.create(model=model, prompt="A date:", max_tokens=16, temperature=0,
                                     extra_body={"structured_outputs": {"regex": r"20\d\d-[01]\d-[0-3]\d"}})
    assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", resp.choices[0].text)
    resp = client.completions.create(model=model, prompt="Data:", max_tokens=96, temperature=0,
                                     extra_body={"guided_json": json.dumps(PERSON)})
    assert_person(resp.choices[0].text)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(", "max_tokens": 4}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
], ids=["schema-missing", "unknown-type", "bad-schema", "bad-regex", "two-constraints", "two-in-one",
        "empty-choice", "bad-grammar"])
def test_bad_constraints_get_a_400_naming_the_field(server: RunningServer, body: dict[str, Any], param: str) -> None:
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": server.engine.model_name, "messages": [{"role": "user", "content": "x"}], **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"], error
    assert server.engine.num_active == 0


# Found by the schema fuzzer: this prompt and a schema of unknown keywords (any JSON value), sampled
# at temperature 1e300, ended in "structured output failed". Not the grammar's doing: 1e300 is inf
# in fp32, the logits divided by it were NaN where the mask had put -inf, and the NaN softmax's
# draw fell on the vocabulary's last token, which the grammar refuses. Such a temperature now draws
# uniformly from what the mask allows.
FUZZED_PROMPT = [3726, 515, 329, 1256, 76, 413, 0, 796, 24687, 178, 623, 2696, 4096, 11028, 500, 418]
ANY_VALUE = json.loads(
    r"""{"": {"\u00c6$H\u00b5\u00e0": {"\u00f9\u0092W\u00a7": null, "\ufc7f": true, "\r\u00d2": 13208325},"""
    r""" "\u0098+\u0084\u00f3P\u0019": null,"""
    r""" "y\u00d4": {"\uda62\udd55\u00f7\u00cc\u00d2;#-\ub7c3\ud876\udd9f~": null}},"""
    r""" "\u023a": {"\u00a9\ud96a\ude4c\u00d4!5\u000e": null, "\ud8de\ude3a\uda33\udd19": false, "\u00c6\f": null}}""")


def _error_of(resp: httpx.Response, stream: bool) -> dict[str, Any] | None:
    """The error a response carries: its body's, or a stream's last error event."""
    if not stream:
        return resp.json().get("error") if resp.status_code != 200 else None
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    return events[-1]["error"] if events else None


@pytest.mark.parametrize("stream", [False, True])
def test_an_infinite_temperature_draws_within_the_grammar(server: RunningServer, stream: bool) -> None:
    body = {"model": server.engine.model_name, "prompt": FUZZED_PROMPT, "max_tokens": 16, "temperature": 1e300,
            "seed": 0, "guided_json": ANY_VALUE, "stream": stream}
    resp = httpx.post(server.url + "/v1/completions", timeout=30, json=body)
    assert _error_of(resp, stream) is None, resp.text
    assert server.engine.num_active == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_refuses_a_token_is_the_clients_error(server: RunningServer, stream: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance can refuse a token its own mask let through (a grammar past its parser's limits
    gives up mid-output); injected here, the third token refused with a two-line error: the client
    gets the first line as its own error, and the request ends."""
    real, seen = Grammar.accept, [0]

    def refusing(grammar: Grammar, token_id: int) -> bool:
        seen[0] += 1
        return seen[0] < 3 and real(grammar, token_id)

    monkeypatch.setattr(Grammar, "accept", refusing)
    monkeypatch.setattr(Grammar, "error", property(lambda _: "parser too complex: lexer gave up\n(state dump)"))
    body = {"model": server.engine.model_name, "prompt": "Name a fruit:", "max_tokens": 16, "temperature": 0,
            "guided_regex": "[a-z ]{1,40}", "stream": stream}
    resp = httpx.post(server.url + "/v1/completions", timeout=30, json=body)
    error = _error_of(resp, stream)
    assert error is not None and (stream or resp.status_code == 400), resp.text
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "structured output failed: parser too complex: lexer gave up", error
    assert server.engine.num_active == 0


def _failures(url: str, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "inflight:request_failure_total" and s.labels.get("reason") == reason)


@pytest.mark.parametrize("stream", [False, True])
def test_a_regex_the_vocabulary_cannot_spell_is_the_clients_error_not_the_servers(server: RunningServer,
                                                                                  stream: bool) -> None:
    """The embedded vocabulary has no token for the bytes 0xF1 and 0xF2 (which begin only code
    points of unassigned planes), so the output cannot follow a regex of one: llguidance gives up
    on the first token. The client's error (a 400, or the stream's error event), counted as an
    invalid request, not as a server error (which the pre-launch gate counts against the server)."""
    invalid, errors = _failures(server.url, "invalid"), _failures(server.url, "error")
    body = {"model": server.engine.model_name, "prompt": "Hi", "max_tokens": 8, "guided_regex": "\U000983ec",
            "stream": stream}
    resp = httpx.post(server.url + "/v1/completions", timeout=30, json=body)
    error = _error_of(resp, stream)
    assert error is not None and (stream or resp.status_code == 400), resp.text
    assert error["type"] == "invalid_request_error" and error["message"].startswith("structured output failed")
    assert (_failures(server.url, "invalid"), _failures(server.url, "error")) == (invalid + 1, errors)
    assert server.engine.num_active == 0
