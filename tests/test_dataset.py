"""A team's own prompts as traffic: OpenAI JSONL (bodies and Batch API lines) and ShareGPT read,
replayed in a seeded order as text (chat to /v1/chat/completions, prompts to /v1/completions),
lengths from the server's usage; a bad file is one line naming where."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from inflight.bench.client import run_http
from inflight.bench.corpus import Corpus
from inflight.bench.dataset import DatasetError, read_dataset
from inflight.bench.workload import WorkloadError, generate_requests, load_workload, parse_workload
from inflight.cli import main
from inflight.model.loaded import LoadedModel

CHAT = {"messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 5}
PROMPT = {"prompt": "Once upon a time there was", "max_tokens": 7, "timestamp": 2.5}
BATCH = {"custom_id": "r3", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Name three colours."}],
                  "max_completion_tokens": 3}, "timestamp": 0.5}
REPLY = "Why did the cat sit on the computer? To keep an eye on the mouse."
SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Tell me a joke about cats."},
                                  {"from": "gpt", "value": REPLY}, {"from": "human", "value": "Another"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},  # no question: skipped
    {"id": "c", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello there, how can I help?"}]},
]


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def corpus(loaded: LoadedModel) -> Corpus:
    return Corpus(loaded.tokenizer)


def test_openai_jsonl_records(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text(f"{json.dumps(CHAT)}\n\n{json.dumps(PROMPT)}\n{json.dumps(BATCH)}\n")
    chat, prompt, batch = read_dataset(path)
    assert chat.messages == tuple(CHAT["messages"]) and chat.output_len == 5 and chat.prompt is None
    assert prompt.prompt == PROMPT["prompt"] and prompt.output_len == 7 and prompt.timestamp == 2.5
    assert prompt.where == "line 3"  # the blank line still counts
    assert batch.messages == ({"role": "user", "content": "Name three colours."},) and batch.output_len == 3
    assert batch.timestamp == 0.5


def test_sharegpt_takes_the_first_question_and_its_reply(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    first, third = read_dataset(path)
    assert first.messages == ({"role": "user", "content": "Tell me a joke about cats."},)
    assert first.reference == REPLY and first.output_len is None and first.where == "record 1"
    assert third.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert read_dataset(jsonl(tmp_path / "sg.jsonl", SHAREGPT))[1].where == "line 3"  # JSONL alike


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "a"}\n{"prompt": \n', "line 2: not JSON"),
    ('{"prompt": "a"}\n[1]\n', "line 2: expected a JSON object"),
    ('{"input": "a"}\n', "line 1: needs field 'messages' (chat) or 'prompt' (completions)"),
    ('{"prompt": "a", "max_tokens": 0}\n', "line 1: field 'max_tokens' must be an integer >= 1"),
    ('{"prompt": "a", "timestamp": "soon"}\n', "line 1: field 'timestamp' must be a number >= 0"),
    ('{"messages": [{"role": "user", "content": ["x"]}]}\n', "line 1: field 'messages[0]' needs a string 'role'"),
    ('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}]',
     "record 1: field 'conversations[1].from': unknown speaker 'robot'"),
    ('[{"conversations": "hi"}]', "record 1: field 'conversations' must be a list"),
    ("\n\n", "has no records"),
])
def test_a_bad_file_is_one_line_naming_where(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_dataset(path)


def test_the_seed_fixes_order_and_arrivals_and_lengths_come_from_the_records(tmp_path: Path,
                                                                             corpus: Corpus) -> None:
    rows = [{"prompt": f"Request number {i} asks about item {i}.", "max_tokens": 3 + i} for i in range(12)]
    jsonl(tmp_path / "prompts.jsonl", rows)
    spec_path = tmp_path / "team.yaml"
    spec_path.write_text(yaml.safe_dump({"seed": 4, "arrivals": {"kind": "poisson", "rate": 5},
                                         "dataset": {"path": "prompts.jsonl"}}))  # relative to the spec
    spec, path = load_workload(str(spec_path))
    first = generate_requests(spec, corpus, path.parent)
    assert generate_requests(spec, corpus, path.parent) == first
    assert sorted(r.prompt for r in first) == sorted(r["prompt"] for r in rows)  # each record once
    assert [r.prompt for r in first] != [r["prompt"] for r in rows]  # in a drawn order
    for r in first:
        assert r.send_text and r.messages is None and r.output_len == 3 + int(r.prompt.split()[2])
        assert r.prompt_token_ids == corpus.tokenizer.encode(r.prompt)  # type: ignore[attr-defined]
    assert first[0].arrival_s == 0 and first[-1].arrival_s > 0
    other, _ = load_workload(str(spec_path), seed=5)
    assert [r.prompt for r in generate_requests(other, corpus, path.parent)] != [r.prompt for r in first]
    more, _ = load_workload(str(spec_path), num_requests=30)  # more than the file: repeated
    assert len(generate_requests(more, corpus, path.parent)) == 30
    assert spec.sha256 != parse_workload({**spec.model_dump(), "seed": 5}).sha256


def test_chat_records_counted_through_the_chat_template_and_replies_give_output_lengths(
        tmp_path: Path, corpus: Corpus, loaded: LoadedModel) -> None:
    (tmp_path / "sg.json").write_text(json.dumps(SHAREGPT))
    spec = parse_workload({"name": "sg", "dataset": {"path": str(tmp_path / "sg.json")}})
    requests = generate_requests(spec, corpus)
    assert len(requests) == 2
    joke = next(r for r in requests if r.messages and "joke" in r.messages[-1]["content"])
    assert joke.prompt_token_ids == loaded.tokenizer.apply_chat_template(list(joke.messages or ()))
    assert joke.output_len == len(loaded.tokenizer.encode(REPLY, add_special_tokens=False))


def test_timestamps_and_lengths_drawn_where_a_record_has_none(tmp_path: Path, corpus: Corpus) -> None:
    jsonl(tmp_path / "t.jsonl", [{"prompt": "late", "timestamp": 9.0}, {"prompt": "early", "timestamp": 7.5},
                                 {"prompt": "middle", "timestamp": 8.0, "max_tokens": 2}])
    base = {"name": "t", "dataset": {"path": str(tmp_path / "t.jsonl"), "timestamps": True}}
    with pytest.raises(WorkloadError, match="line 2: no field 'max_tokens', and the spec has no output_len"):
        generate_requests(parse_workload(base), corpus)
    requests = generate_requests(parse_workload({**base, "output_len": 6}), corpus)
    assert [(r.prompt, r.arrival_s, r.output_len) for r in requests] == [
        ("early", 0.0, 6), ("middle", 0.5, 2), ("late", 1.5, 6)]
    jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "timestamp": 1}, {"prompt": "b", "max_tokens": 1}])
    with pytest.raises(WorkloadError, match="line 2: no field 'timestamp'"):
        generate_requests(parse_workload({**base, "output_len": 6}), corpus)
    for clash in ({"prompt_len": 5}, {"shared_prefix": {"fraction": 1, "num_tokens": 4}}):
        with pytest.raises(WorkloadError, match="a dataset gives its own prompts"):
            parse_workload({**base, **clash})


def test_the_client_sends_text_and_reports_the_servers_counts(tmp_path: Path, corpus: Corpus) -> None:
    """Chat records go to /v1/chat/completions as messages, prompts to /v1/completions as text; a
    chat stream's role-only first chunk is not a token; the usage's prompt_tokens is the length; a
    warm-up request goes first and is left out."""
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="inflight:kv_cache_usage_perc 0.25\n")
        body = json.loads(request.content)
        n = body["max_tokens"]
        if request.url.path == "/v1/chat/completions":
            seen.append(("chat", body["messages"]))
            chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
            chunks += [{"choices": [{"index": 0, "delta": {"content": "w"}, "finish_reason": None}]}] * n
            chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        else:
            seen.append(("completion", body["prompt"]))
            chunks = [{"choices": [{"index": 0, "text": "w", "finish_reason": None}]}] * n
        chunks.append({"choices": [], "usage": {"prompt_tokens": 100 + n, "completion_tokens": n}})
        content = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=content.encode(), headers={"content-type": "text/event-stream"})

    jsonl(tmp_path / "d.jsonl", [CHAT, PROMPT, BATCH])
    requests = generate_requests(parse_workload({"name": "d", "dataset": {"path": str(tmp_path / "d.jsonl")}}),
                                 corpus)
    capture, info = run_http("http://fake", requests, progress=False, transport=httpx.MockTransport(handler),
                             metrics_interval_s=0.01, num_warmups=1)
    warmup, timed = seen[0], seen[1:]  # the first request once more, before the clock starts, left out
    assert info["warmups"] == {"requests": 1, "failed": 0} and len(capture.results) == 3
    first = requests[0]
    assert warmup == (("chat", list(first.messages)) if first.messages else ("completion", first.prompt))
    assert sorted(timed, key=str) == sorted([("chat", CHAT["messages"]), ("completion", PROMPT["prompt"]),
                                             ("chat", BATCH["body"]["messages"])], key=str)  # type: ignore[index]
    for request, result in zip(requests, capture.results, strict=True):
        assert result.ok and result.num_output_tokens == request.output_len
        assert result.prompt_len == 100 + request.output_len  # the server's count, not ours
        assert len(result.token_gaps_s) == request.output_len - 1  # role and finish chunks are not tokens


def test_bench_replays_a_dataset_in_process_and_refuses_a_bad_one_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = jsonl(tmp_path / "d.jsonl", [CHAT, PROMPT, BATCH])
    assert main(["bench", "--dataset", str(path), "--num-kv-blocks", "64", "--no-progress",
                 "--output", str(tmp_path / "run.json")]) == 0
    document = json.loads((tmp_path / "run.json").read_text())
    assert document["workload"]["spec"]["dataset"]["path"] == str(path)
    (run,) = document["runs"]
    assert sorted(r["output_len"] for r in run["requests"]) == [3, 5, 7]
    capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert main(["bench", "--dataset", str(tmp_path / "bad.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "line 2: field 'prompt' must be a non-empty string" in err
    assert main(["bench", "--no-progress"]) == 2
    assert "give --workload (a spec) or --dataset" in capsys.readouterr().err
