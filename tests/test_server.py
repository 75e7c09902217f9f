"""The HTTP server end to end: a real uvicorn on a free loopback port, the real embedded model,
and the official `openai` client. Generations are kept short so the file runs in seconds."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import stream_in_background
from prometheus_client.parser import text_string_to_metric_families

from inflight import LLM, EngineConfig, LLMEngine, SamplingParams
from inflight.model.loaded import LoadedModel
from inflight.server.config import ServerConfig
from inflight.server.launcher import RunningServer, serve_in_thread

MAX_BODY_BYTES = 64 * 1024
NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def server(loaded: LoadedModel) -> Iterator[RunningServer]:
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=NUM_KV_BLOCKS, max_batch_size=32), loaded)
    with serve_in_thread(engine, ServerConfig(max_body_bytes=MAX_BODY_BYTES, shutdown_timeout_s=5)) as running:
        yield running


@pytest.fixture(scope="module")
def offline(loaded: LoadedModel) -> LLM:
    return LLM(loaded=loaded, num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def model(server: RunningServer) -> str:
    return server.engine.model_name


@pytest.fixture()
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get(("inflight:" + name, frozenset(labels.items())), 0.0)


def greedy(offline: LLM, prompt: Any, max_tokens: int) -> tuple[str, int, int]:
    (out,) = offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))
    return out.text, len(out.prompt_token_ids), len(out.token_ids)


# --- the openai client ---------------------------------------------------------------------------


def test_models_and_health(server: RunningServer, client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json() == {"version": importlib.metadata.version("inflight")}


def test_completion_matches_offline_greedy(client: openai.OpenAI, offline: LLM, model: str) -> None:
    prompt = "The capital of France is"
    text, num_prompt, num_output = greedy(offline, prompt, 12)
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert resp.choices[0].text == text
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (num_prompt, num_output)
    assert resp.usage.total_tokens == num_prompt + num_output

    token_ids = offline.tokenizer.encode(prompt)
    by_ids = client.completions.create(model=model, prompt=token_ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text


def test_streamed_completion_matches_and_reports_usage(client: openai.OpenAI, offline: LLM, model: str) -> None:
    prompt = "List three uses of a paperclip:\n1."
    text, num_prompt, num_output = greedy(offline, prompt, 16)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, num_output)
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_give_every_chunk_its_choices_count(client: openai.OpenAI, offline: LLM,
                                                                   model: str) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): each chunk carries its
    choice's tokens so far, whatever a chunk holds (with n = 2 the choices count apart)."""
    chat = [{"role": "user", "content": "Name a colour."}]
    ids = offline.engine.tokenize(messages=chat)
    chunks = list(client.chat.completions.create(
        model=model, messages=chat, max_tokens=12, n=2, temperature=1.0, seed=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, logprobs=True))
    counted = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        if not chunk.choices or chunk.choices[0].logprobs is None:
            continue
        choice = chunk.choices[0]
        counted[choice.index] += len(choice.logprobs.content or [])  # one entry a token
        assert chunk.usage is not None and chunk.usage.prompt_tokens == len(ids)
        assert chunk.usage.completion_tokens == counted[choice.index]
    final = chunks[-1].usage
    assert final is not None and final.completion_tokens == sum(counted.values()) > 0


def test_chat_matches_offline_greedy(client: openai.OpenAI, offline: LLM, model: str) -> None:
    messages: list[Any] = [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Name a primary colour."}]
    text, num_prompt, num_output = greedy(offline, messages, 12)
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text
    assert resp.usage is not None and resp.usage.prompt_tokens == num_prompt
    assert resp.usage.completion_tokens == num_output

    stream = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == resp.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == num_output

    plain = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                stream=True))
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text


def test_sampling_parameters_are_accepted(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.8,
                                  top_p=0.9, seed=7, frequency_penalty=0.5, presence_penalty=0.5,
                                  extra_body={"top_k": 20, "repetition_penalty": 1.1, "ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert first.usage is not None and first.usage.completion_tokens == 8  # ignore_eos
    assert first.choices[0].text == again.choices[0].text  # seeded

    stopped = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0,
                                        stop=[","], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and "," not in stopped.choices[0].text


def test_stop_token_ids_end_the_output(client: openai.OpenAI, offline: LLM, model: str) -> None:
    prompt = "Count: 1, 2, 3,"
    (free,) = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop_at = 3  # the fourth generated token becomes a stop token
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [free.token_ids[stop_at]]})
    first = free.token_ids.index(free.token_ids[stop_at])  # it may occur earlier, and stops there
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == first + 1
    assert resp.choices[0].text == offline.tokenizer.decode(free.token_ids[:first])


def test_no_op_values_of_unsupported_fields_are_accepted(client: openai.OpenAI, model: str) -> None:
    """Clients send these with their defaults; only values that would change the answer are refused."""
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        response_format={"type": "text"}, logit_bias={}, tool_choice="none", top_logprobs=0, logprobs=False,
        extra_body={"min_tokens": 0, "min_p": 0, "guided_json": None})
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_sampling_extras_through_the_openai_client(client: openai.OpenAI, offline: LLM, model: str) -> None:
    forced = client.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=0,
                                       logit_bias={"1234": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == offline.tokenizer.decode([1234] * 5)
    chat = [{"role": "user", "content": "Say hello."}]
    (free,) = offline.generate([chat], SamplingParams(max_tokens=100, temperature=0))
    held = client.chat.completions.create(model=model, messages=chat, max_tokens=100, temperature=0,
                                          extra_body={"min_tokens": len(free.token_ids) + 3})
    assert held.usage is not None and held.usage.completion_tokens >= len(free.token_ids) + 3
    stream = client.chat.completions.create(model=model, messages=chat, max_tokens=12, temperature=1.2, seed=3,
                                            stream=True, extra_body={"min_p": 1.0, "ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    (greedy,) = offline.generate([chat], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert text == greedy.text


def test_vllms_output_and_prompt_options(client: openai.OpenAI, offline: LLM, model: str) -> None:
    """include_stop_str_in_output keeps the stop string that ended the output; skip_special_tokens
    false shows a special token's text; truncate_prompt_tokens keeps the prompt's last k tokens."""
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    (free,) = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stop = free.text[4:7]  # three characters the output holds
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    kept = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    start = free.text.index(stop)
    assert cut.choices[0].text == free.text[:start]
    assert kept.choices[0].text == free.text[:start + len(stop)]
    assert kept.choices[0].finish_reason == cut.choices[0].finish_reason == "stop"

    marker = offline.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    forced = {"logit_bias": {str(marker): 100}, "max_tokens": 2, "temperature": 0}
    hidden = client.completions.create(model=model, prompt="Hi", **forced)
    shown = client.completions.create(model=model, prompt="Hi", **forced, extra_body={"skip_special_tokens": False})
    assert hidden.choices[0].text == "" and shown.choices[0].text == "<|im_start|>" * 2

    ids = offline.tokenizer.encode("The old lighthouse keeper climbed the stairs, counting each step as he went")
    truncated = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 5})
    (alone,) = offline.generate([ids[-5:]], SamplingParams(max_tokens=6, temperature=0))
    assert truncated.usage is not None and truncated.usage.prompt_tokens == 5
    assert truncated.choices[0].text == alone.text


def test_a_chat_continues_its_last_message_and_passes_template_variables(server: RunningServer, offline: LLM,
                                                                       model: str) -> None:
    """continue_final_message with add_generation_prompt false (vLLM's) goes on from the
    assistant's unfinished turn, as the rendered text sent as a plain prompt does; a template
    variable of chat_template_kwargs reaches the template (Qwen3's enable_thinking)."""
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    body = {"model": model, "messages": chat, "max_tokens": 8, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = offline.tokenizer.hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    (expected,) = offline.generate([offline.tokenizer.encode(text, add_special_tokens=False)],
                                   SamplingParams(max_tokens=8, temperature=0))
    assert r.json()["choices"][0]["message"]["content"] == expected.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)

    template = "{% if terse %}Be terse. {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = offline.tokenizer
    plain = tokenizer.apply_chat_template(chat[:1], chat_template=template)
    terse = tokenizer.apply_chat_template(chat[:1], chat_template=template, template_kwargs={"terse": True})
    assert tokenizer.decode(terse) == "Be terse. " + tokenizer.decode(plain)
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=32), offline.engine.parts.loaded)
    with serve_in_thread(engine, ServerConfig(chat_template=template, shutdown_timeout_s=5)) as templated:
        for kwargs, ids in (({}, plain), ({"terse": True}, terse)):
            r = httpx.post(templated.url + "/v1/chat/completions", timeout=60, json={
                "model": model, "messages": chat[:1], "max_tokens": 1, "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_list_of_prompts_gives_the_texts_of_each_alone(client: openai.OpenAI, offline: LLM, model: str) -> None:
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    alone = offline.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    resp = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [o.text for o in alone]
    assert resp.usage is not None and resp.usage.completion_tokens == 18
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in alone)
    ids = [o.prompt_token_ids for o in alone]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == [o.text for o in alone]
    stream = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finishes, usage = ["", "", ""], [None, None, None], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [o.text for o in alone] and finishes == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 18


def test_logprobs_through_the_openai_client(client: openai.OpenAI, offline: LLM, model: str) -> None:
    prompt = "The capital of France is"
    (ref,) = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens) == resp.choices[0].text == ref.text
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-5)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [v for c in chunks for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset
    chat = [{"role": "user", "content": "Say hello."}]
    (ref_chat,) = offline.generate([chat], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))
    for stream in (False, True):
        got = client.chat.completions.create(model=model, messages=chat, max_tokens=5, temperature=0, logprobs=True,
                                             top_logprobs=2, stream=stream, extra_body={"ignore_eos": True})
        if stream:
            content = [t for c in got if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        else:
            content = got.choices[0].logprobs.content
        assert [t.logprob for t in content] == pytest.approx([t.logprob for t in ref_chat.logprobs], abs=1e-5)
        assert all(len(t.top_logprobs) == 2 and bytes(t.bytes).decode("utf-8", "replace") == t.token
                   for t in content)
    plain = client.chat.completions.create(model=model, messages=chat, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_with_logprobs_as_lm_eval_asks(server: RunningServer, offline: LLM, hf_model: Any, model: str) -> None:
    """lm-evaluation-harness's loglikelihood request (token-id prompts, batched, max_tokens 1,
    logprobs 1, echo, greedy): every prompt token after the first has transformers' logprob, sent
    twice so that the second finds its blocks in the prefix cache."""
    tok = offline.tokenizer
    prompts = [tok.encode("Question: What is the capital of France? Answer: Paris"), list(range(700, 760))]
    body = {"model": model, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        for ids, choice in zip(prompts, r.json()["choices"], strict=True):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(ids) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert choice["text"].startswith(tok.decode(ids))
            with torch.inference_mode():
                ref = hf_model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
            want = [float(ref[q, ids[q + 1]]) for q in range(len(ids) - 1)]
            assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
            assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    streamed = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "Hello there", "stream": True,
                                                                "max_tokens": 3}, timeout=60)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text.startswith("Hello there") and events[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "echo": True}
    _assert_error_body(httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30), 400, "echo")


def test_prompt_logprobs_in_vllms_shape(server: RunningServer, offline: LLM, hf_model: Any, model: str) -> None:
    """vLLM's prompt_logprobs: per choice (completions) or per response (chat), None for the first
    prompt token, then each token's id and its k most likely alternatives' to logprob, rank and
    text: transformers' log-softmax and ranks. Beside echo with its own count, each reports its
    own; with stream it is a 400, as in vLLM."""
    tok = offline.tokenizer
    ids = tok.encode("The capital of France is Paris, and the capital of Spain is")
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2,
            "echo": True, "logprobs": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    with torch.inference_mode():
        ref = hf_model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for q, entry in enumerate(entries[1:]):
        token = ids[q + 1]
        best = ref[q].topk(2)
        assert set(entry) == {str(token), *(str(t) for t in best.indices.tolist())}
        assert entry[str(token)]["logprob"] == pytest.approx(float(ref[q, token]), abs=1e-4)
        assert entry[str(token)]["rank"] == int((ref[q] > ref[q, token]).sum()) + 1
        assert entry[str(token)]["decoded_token"] == tok.decode([token])
        for rank, t in enumerate(best.indices.tolist(), start=1):
            assert entry[str(t)]["rank"] == rank
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # echo's own count
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    chat_ids = offline.engine.tokenize(messages=chat["messages"])
    entries = r.json()["prompt_logprobs"]
    assert entries[0] is None and [list(e) for e in entries[1:]] == [[str(t)] for t in chat_ids[1:]]
    for stream_body, path in ((body, "/completions"), (chat, "/chat/completions")):
        _assert_error_body(_send(server.url, path, {**stream_body, "stream": True}, model, timeout=30), 400,
                           "prompt_logprobs")
    _assert_error_body(_send(server.url, "/completions", {**body, "prompt_logprobs": 21}, model, timeout=30), 400,
                       "prompt_logprobs")


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server: RunningServer, model: str) -> None:
    """OpenAI's scoring form (echo, max_tokens 0, as vLLM takes it): each choice is its prompt and
    the prompt's logprobs, those of the max_tokens 1 form, with nothing generated, in a whole
    response and streamed alike; without echo, max_tokens 0 stays a 400."""
    prompts = ["The capital of France is", "Once upon a time, in a land far away"]
    body = {"model": model, "prompt": prompts, "logprobs": 2, "echo": True, "temperature": 0}
    scored = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=60)
    generated = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert scored.status_code == 200 and generated.status_code == 200, (scored.text, generated.text)
    scored_body = scored.json()
    usage = scored_body["usage"]
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]
    assert usage["prompt_tokens"] == generated.json()["usage"]["prompt_tokens"]
    for prompt, mine, theirs in zip(prompts, scored_body["choices"], generated.json()["choices"], strict=True):
        assert mine["finish_reason"] == "length" and mine["text"] == prompt
        lp, ref = mine["logprobs"], theirs["logprobs"]
        assert len(lp["tokens"]) == len(ref["tokens"]) - 1  # the generated token left out
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert lp[key] == ref[key][:-1], key
    streamed = httpx.post(server.url + "/v1/completions", timeout=60, json={
        **body, "prompt": prompts[0], "max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == prompts[0]
    tokens = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == scored_body["choices"][0]["logprobs"]["tokens"]
    assert events[-1]["usage"]["completion_tokens"] == 0
    _assert_error_body(httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": model, "prompt": "hi", "max_tokens": 0}), 400, "max_tokens")


def test_n_samples_through_the_openai_client(client: openai.OpenAI, server: RunningServer, model: str) -> None:
    prompt = "Write a short poem about the sea."
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2] and len({c.text for c in resp.choices}) == 3
    assert resp.usage is not None and resp.usage.completion_tokens == 24
    single = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert single.usage is not None and resp.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    again = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    two_prompts = client.completions.create(model=model, prompt=[prompt, "Hello"], max_tokens=4, n=2,
                                            temperature=0, extra_body={"ignore_eos": True})
    texts = [c.text for c in two_prompts.choices]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]  # greedy samples agree
    chat = [{"role": "user", "content": "Name a color."}]
    stream = client.chat.completions.create(model=model, messages=chat, max_tokens=6, temperature=1.0, seed=1,
                                            n=2, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts, usage = ["", ""], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts) and usage is not None and usage.completion_tokens == 12
    assert server.engine.num_active == 0


def test_lm_eval_task_loglikelihoods_match_transformers(server: RunningServer, offline: LLM, hf_model: Any,
                                                        model: str) -> None:
    """Items of benchmarks/lm_eval/task.jsonl scored as lm-eval's local-completions scores them:
    one batched request of context + continuation ids, the continuation's summed logprobs."""
    from pathlib import Path

    tok = offline.tokenizer
    lines = (Path(__file__).parents[1] / "benchmarks" / "lm_eval" / "task.jsonl").read_text().splitlines()
    items = [json.loads(line) for line in lines[:2] + lines[-2:]]
    pairs = [(item["query"], " " + choice) for item in items for choice in item["choices"]]
    encoded = []
    for context, continuation in pairs:
        whole = tok.encode(context + continuation)
        encoded.append((whole, len(tok.encode(context))))
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": [ids for ids, _ in encoded], "max_tokens": 1, "logprobs": 1, "echo": True,
        "temperature": 0})
    assert r.status_code == 200, r.text
    for (ids, ctxlen), choice in zip(encoded, r.json()["choices"], strict=True):
        ours = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        with torch.inference_mode():
            ref = hf_model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
        theirs = sum(float(ref[q - 1, ids[q]]) for q in range(ctxlen, len(ids)))
        assert abs(ours - theirs) < 1e-3, (ours, theirs)


def test_tokenize_and_detokenize_in_vllms_shapes(server: RunningServer, offline: LLM, model: str) -> None:
    tok = offline.tokenizer
    text = "Tokenize this, please: naïve café"
    r = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == offline.engine.scheduler_config.max_model_len
    assert len(body["token_strs"]) == body["count"] and all(isinstance(s, str) for s in body["token_strs"])
    bare = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    chat = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"model": model, "messages": chat})
    assert r.json()["tokens"] == tok.apply_chat_template(chat)
    back = httpx.post(server.url + "/detokenize", json={"model": model, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tok.decode(body["tokens"])}
    _assert_error_body(httpx.post(server.url + "/tokenize", json={"prompt": "x", "messages": chat}), 400, "prompt")
    _assert_error_body(httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    _assert_error_body(httpx.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"}), 404, "model")


def test_sixteen_concurrent_streams_are_batched(server: RunningServer, offline: LLM, model: str) -> None:
    prompts = [f"Write a sentence about the number {i}." for i in range(16)]
    expected = [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, str | None, int]:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        usage = chunks[-1].usage
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return chunks[0].id, text, finish, usage.completion_tokens if usage else -1

    async def run_all() -> list[tuple[str, str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    before = scrape(server.url)
    results = asyncio.run(run_all())
    after = scrape(server.url)
    assert len(results) == 16 and len({r[0] for r in results}) == 16
    for (_, text, finish, num_tokens), want in zip(results, expected, strict=True):
        assert finish == "length" and num_tokens == 8
        assert text == want  # fp32 greedy: batch composition does not change the tokens
    # One request per step would take at least 16 * 8 steps; batching takes far fewer.
    num_steps = metric(after, "iteration_tokens_count") - metric(before, "iteration_tokens_count")
    assert num_steps <= 16 * 8 // 2, f"{num_steps} steps: the requests were not batched"


# --- disconnects ---------------------------------------------------------------------------------


def _wait_idle(url: str, idle_usage: float, timeout_s: float = 15.0) -> dict[Any, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if metric(samples, "num_requests_running") == 0 and metric(samples, "kv_cache_usage_perc") == idle_usage:
            return samples
        assert time.monotonic() < deadline, f"engine not idle: {samples}"
        time.sleep(0.1)


def test_disconnect_mid_stream_aborts_the_request(server: RunningServer, model: str) -> None:
    before = scrape(server.url)
    idle_usage = metric(before, "kv_cache_usage_perc")
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert len(received) >= 2
        busy = scrape(server.url)
        assert metric(busy, "num_requests_running") == 1 and metric(busy, "kv_cache_usage_perc") > idle_usage
    after = _wait_idle(server.url, idle_usage)  # 1500 tokens would take far longer than the wait
    assert (metric(after, "request_failure_total", reason="aborted")
            == metric(before, "request_failure_total", reason="aborted") + 1)


@contextmanager
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """The records uvicorn logs at ERROR meanwhile (an exception that escaped a handler: a client
    that left sees no 500, only the server's log does)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def test_disconnect_while_waiting_for_a_whole_completion(server: RunningServer, model: str) -> None:
    before = scrape(server.url)
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True}
    with server_errors() as errors:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
        after = _wait_idle(server.url, metric(before, "kv_cache_usage_perc"))
    assert (metric(after, "request_failure_total", reason="aborted")
            == metric(before, "request_failure_total", reason="aborted") + 1)
    assert not errors, [r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in errors]


# --- bad input -----------------------------------------------------------------------------------

LONG_IDS = [1] * 2100  # past max_model_len (2048)

BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body (bytes are sent raw), status, param)
    ("malformed json", "/completions", b'{"model": "M", "prompt": ', 400, None),
    ("not an object", "/completions", b"[1, 2]", 400, None),
    ("not utf-8", "/completions", b"\xff\xfe", 400, None),
    ("missing prompt", "/completions", {"model": "M"}, 400, "prompt"),
    ("missing messages", "/chat/completions", {"model": "M"}, 400, "messages"),
    ("top_logprobs out of range", "/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("empty messages", "/chat/completions", {"model": "M", "messages": []}, 400, "messages"),
    ("bad role", "/chat/completions",
     {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("image content part", "/chat/completions", {"model": "M", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]},
     400, "messages"),
    ("wrong type", "/completions", {"model": "M", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("prompt wrong type", "/completions", {"model": "M", "prompt": 42}, 400, "prompt"),
    ("unknown model", "/completions", {"model": "gpt-0", "prompt": "hi"}, 404, "model"),
    ("empty prompt", "/completions", {"model": "M", "prompt": ""}, 400, "prompt"),
    ("empty token list", "/completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("token id out of vocab", "/completions", {"model": "M", "prompt": [10**9]}, 400, "prompt"),
    ("too many prompts", "/completions", {"model": "M", "prompt": ["a"] * 257}, 400, "prompt"),
    ("a batch with an empty prompt", "/completions", {"model": "M", "prompt": ["a", ""]}, 400, "prompt"),
    ("prompt too long", "/completions", {"model": "M", "prompt": LONG_IDS}, 400, "prompt"),
    ("prompt too long, max_tokens", "/completions", {"model": "M", "prompt": LONG_IDS, "max_tokens": 4}, 400, "prompt"),
    ("max_tokens 0", "/completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond context", "/completions",
     {"model": "M", "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("chat max_completion_tokens 0", "/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     400, "max_completion_tokens"),
    ("negative temperature", "/completions", {"model": "M", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", "/completions", {"model": "M", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/completions", {"model": "M", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n above 16", "/completions", {"model": "M", "prompt": "hi", "n": 17}, 400, "n"),
    ("chat n zero", "/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("empty stop string", "/completions", {"model": "M", "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("penalty out of range", "/completions",
     {"model": "M", "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("logprobs above 20", "/completions", {"model": "M", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("chat top_logprobs above 20", "/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("best_of", "/completions", {"model": "M", "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("unknown response_format", "/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                                      "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("logit_bias id outside the vocabulary", "/completions",
     {"model": "M", "prompt": "hi", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("logit_bias key not an id", "/completions", {"model": "M", "prompt": "hi", "logit_bias": {"x": 5}}, 400,
     "logit_bias"),
    ("logit_bias value out of range", "/completions", {"model": "M", "prompt": "hi", "logit_bias": {"5": 101}},
     400, "logit_bias"),
    ("min_tokens above max_tokens", "/completions", {"model": "M", "prompt": "hi", "min_tokens": 9, "max_tokens": 4},
     400, "min_tokens"),
    ("min_p above one", "/completions", {"model": "M", "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("guided_choice not a list", "/completions", {"model": "M", "prompt": "hi", "guided_choice": "a"}, 400,
     "guided_choice"),
    ("chat top_logprobs", "/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                                "top_logprobs": 2}, 400, "top_logprobs"),
    ("tool_choice required", "/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                                   "tool_choice": "required"}, 400, "tool_choice"),
    ("negative stop token id", "/completions", {"model": "M", "prompt": "hi", "stop_token_ids": [-1]}, 400,
     "stop_token_ids"),
    ("oversized body", "/completions", {"model": "M", "prompt": "x" * (MAX_BODY_BYTES + 1)}, 413, None),
    # vLLM's fields inflight does not compute, at other values than their no-op ones
    ("beam search", "/completions", {"model": "M", "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ("bad_words", "/completions", {"model": "M", "prompt": "hi", "bad_words": ["x"]}, 400, "bad_words"),
    ("allowed_token_ids", "/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                                "allowed_token_ids": [5]}, 400, "allowed_token_ids"),
    ("a request's chat template", "/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                                        "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("truncate_prompt_tokens 0", "/completions", {"model": "M", "prompt": "hi", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("continue_final_message with a generation prompt", "/chat/completions",
     {"model": "M", "messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("continue_final_message after a user turn", "/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": False}, 400, "continue_final_message"),
    ("chat_template_kwargs setting an argument", "/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs"),
]


def _send(url: str, path: str, body: Any, model: str, **kwargs: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + "/v1" + path, content=body, headers={"content-type": "application/json"}, **kwargs)
    if body.get("model") == "M":
        body = {**body, "model": model}
    return httpx.post(url + "/v1" + path, json=body, **kwargs)


def _assert_error_body(resp: httpx.Response, status: int, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error(server: RunningServer, model: str, name: str, path: str, body: Any,
                                          status: int, param: str | None) -> None:
    _assert_error_body(_send(server.url, path, body, model, timeout=30), status, param)


def test_a_request_names_the_served_model_or_none(server: RunningServer, model: str) -> None:
    """As vLLM's and llama.cpp's servers: a missing or empty `model` means the served one (curl users
    leave it out), another name is a 404 model_not_found."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    for path, body in (("/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
                       ("/chat/completions", chat)):
        named = _send(server.url, path, {**body, "model": model}, model, timeout=30)
        assert named.status_code == 200, named.text
        for unnamed in (body, {**body, "model": ""}):
            resp = _send(server.url, path, unnamed, model, timeout=30)
            assert resp.status_code == 200 and resp.json()["model"] == model, resp.text
            assert resp.json()["choices"][0] == named.json()["choices"][0]
        other = _send(server.url, path, {**body, "model": "not-" + model}, model, timeout=30)
        _assert_error_body(other, 404, "model")
        assert other.json()["error"]["code"] == "model_not_found"


def test_a_limit_is_reported_under_the_clients_own_field_name(server: RunningServer, model: str) -> None:
    """SamplingParams' logprobs limit, hit through chat's top_logprobs, names top_logprobs."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}
    error = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()["error"]
    assert error["param"] == "top_logprobs" and error["message"].startswith("top_logprobs must be"), error


def test_oversized_chunked_body_is_refused_without_content_length(server: RunningServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "M", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    resp = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in resp.request.headers
    _assert_error_body(resp, 413)


def test_unknown_route_and_method_get_openai_errors(server: RunningServer) -> None:
    _assert_error_body(httpx.get(server.url + "/v1/nothing"), 404)
    _assert_error_body(httpx.get(server.url + "/v1/completions"), 405)


def test_bad_requests_do_not_disturb_a_running_stream(server: RunningServer, model: str) -> None:
    before = scrape(server.url)
    body = {"model": model, "prompt": "The history of the bicycle", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    thread, lines = stream_in_background(server.url + "/v1/completions", body)
    for _, path, bad, status, _ in BAD_REQUESTS:
        assert _send(server.url, path, bad, model, timeout=30).status_code == status
    thread.join(60)
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    assert '"completion_tokens":40' in "".join(lines)
    after = scrape(server.url)
    assert metric(after, "request_failure_total", reason="invalid") == \
        metric(before, "request_failure_total", reason="invalid") + len(BAD_REQUESTS)
    assert httpx.get(server.url + "/health").status_code == 200


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_parse_and_move_with_requests(server: RunningServer, client: openai.OpenAI, model: str) -> None:
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_usage_peak_perc",
                "kv_cache_blocks_used", "kv_cache_blocks_total", "num_preemptions", "num_oom_errors",
                "num_kv_allocation_failures",
                "num_failed_steps", "prompt_tokens", "generation_tokens", "time_to_first_token_seconds",
                "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                "iteration_tokens"]
    for name in expected:
        assert "inflight:" + name in families, name
    assert all(name.startswith("inflight:") for name in families)
    # vLLM's info series: the pool's configuration in its labels (the fp32 pool of a CPU engine).
    [info] = families["inflight:cache_config_info"].samples
    assert info.value == 1 and info.labels == {"block_size": "16", "cache_dtype": "float32",
                                               "num_gpu_blocks": str(NUM_KV_BLOCKS), "enable_prefix_caching": "True"}

    before = scrape(server.url)
    resp = client.completions.create(model=model, prompt="Question: What is 17 times 23? Answer:", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    after = scrape(server.url)
    assert resp.usage is not None

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("prompt_tokens_total") == resp.usage.prompt_tokens
    assert moved("generation_tokens_total") == resp.usage.completion_tokens == 6
    assert moved("request_success_total", finished_reason="length") == 1
    assert moved("time_to_first_token_seconds_count") == 1
    assert moved("request_queue_time_seconds_count") == 1
    assert moved("e2e_request_latency_seconds_count") == 1
    assert moved("inter_token_latency_seconds_count") == 5
    assert moved("iteration_tokens_count") >= 6
    assert metric(after, "kv_cache_blocks_total") == NUM_KV_BLOCKS
    assert 0 < metric(after, "kv_cache_usage_peak_perc") <= 1
