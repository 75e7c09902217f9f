"""`inflight serve --replicas 2` as users run it: a real process that starts Ray (no dashboard,
two CPUs), Ray Serve, the ingress and two engine replicas of one thread each, on loopback.

One fleet serves every test here (Ray's start-up is the cost): the official openai client,
greedy text equal to the single process's, prefix affinity and its overload fallback, the
merged `/metrics`, then a replica killed mid-stream (and Ray Serve replacing it), and last SIGTERM, which must drain and
exit 0. (That the single process imports no Ray is checked by tests/test_server_sigterm.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight.engine.llm import LLM
from inflight.request import SamplingParams
from tests.test_server_sigterm import _free_port, _wait_healthy

API_KEY = "fleet-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_WAITING_TOKENS = 300  # the router's overload limit in this fleet: two of the prompts below
SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, cite the "
          "relevant rule by its number, and never invent a rule. Rules: 1. Parcels over 30 kg go by freight. "
          "2. Liquids need a sealed inner container. 3. Batteries ship only inside the device. ")


class Fleet:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def metrics(self) -> dict[tuple[str, str | None], float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {(s.name, s.labels.get("replica")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def replica_pids(self) -> dict[str, int]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {s.labels["replica"]: int(s.labels["pid"]) for f in text_string_to_metric_families(text)
                if f.name == "inflight:replica_info" for s in f.samples}

    def wait_for_replicas(self, n: int, timeout_s: float, without: str | None = None) -> dict[str, int]:
        """The replicas reporting, once there are `n` (none of them `without`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = self.replica_pids()
            if len(pids) >= n and without not in pids:
                return pids
            time.sleep(0.5)
        raise AssertionError(f"fewer than {n} replicas (besides {without}) reported in {timeout_s} s")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    port = _free_port()
    log = tmp_path_factory.mktemp("fleet") / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "inflight.cli", "serve", "--replicas", "2", "--replica-cpus", "1", "--port", str(port),
         "--num-kv-blocks", "256", "--max-model-len", "1024", "--shutdown-timeout", "10", "--log-level", "warning",
         "--router-max-waiting-tokens", str(MAX_WAITING_TOKENS), "--api-key", API_KEY],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    fleet = Fleet(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_healthy(fleet.url, proc, timeout_s=240)
        fleet.wait_for_replicas(2, timeout_s=60)
        yield fleet
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _chat(fleet: Fleet, user: str, max_tokens: int = 8) -> tuple[str, str]:
    """The reply's text and the replica that wrote it."""
    raw = fleet.client.chat.completions.with_raw_response.create(
        model=fleet.client.models.list().data[0].id, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    return raw.parse().choices[0].message.content or "", raw.headers["x-inflight-replica"]


def test_openai_client_through_the_fleet_matches_one_process(fleet: Fleet, make_llm: Callable[..., LLM]) -> None:
    client = fleet.client
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    pieces = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(pieces)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (alone,) = make_llm(max_model_len=1024).generate(
        [messages], SamplingParams(max_tokens=12, temperature=0))
    assert whole.choices[0].message.content == streamed == alone.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    completion = client.completions.create(model=model, prompt=["Once upon a time", "The sea"], max_tokens=5,
                                           temperature=0)
    assert [c.index for c in completion.choices] == [0, 1] and all(c.text for c in completion.choices)
    # Errors are the replica's own, unchanged: a 400 that names its parameter.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=5, logprobs=99)
    assert "logprobs" in str(err.value)
    assert httpx.post(fleet.url + "/tokenize", json={"prompt": "hello world"}, headers=AUTH).json()["count"] >= 2
    # The API key holds through the fleet.
    refused = httpx.post(fleet.url + "/v1/completions", json={"model": model, "prompt": "x"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_prefix_affinity_and_the_overload_fallback(fleet: Fleet) -> None:
    # One at a time, the same system prompt keeps landing where its blocks are cached.
    served = {_chat(fleet, f"Question {i}: can I ship a phone?")[1] for i in range(4)}
    assert len(served) == 1
    home = served.pop()
    # The board has a replica's counters as of its last report (about once a second): wait for one.
    deadline = time.monotonic() + 15
    while fleet.metrics().get(("inflight:prefix_cache_hits_total", home), 0.0) <= 0:
        assert time.monotonic() < deadline, f"{home} reported no prefix-cache hits for the shared prompt"
        time.sleep(0.5)
    # A burst with that prefix, each request with ~150 tokens of its own to prefill, overloads its
    # home (more than MAX_WAITING_TOKENS waiting): the rest of the burst goes elsewhere.
    results: list[str] = []

    def burst(i: int) -> None:
        question = f"Burst {i}: which rule covers these? " + " ".join(f"parcel{i}x{j}" for j in range(40))
        results.append(_chat(fleet, question, 4)[1])

    threads = [threading.Thread(target=burst, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 6 and home in results and len(set(results)) == 2


def test_metrics_carry_a_replica_label(fleet: Fleet) -> None:
    values = fleet.metrics()
    replicas = {r for (name, r) in values if name == "inflight:kv_cache_blocks_total"}
    assert len(replicas) == 2 and None not in replicas
    assert all(values[("inflight:kv_cache_blocks_total", r)] == 256 for r in replicas)
    assert sum(values.get(("inflight:prefix_cache_queries_total", r), 0) for r in replicas) > 0


def _running(fleet: Fleet) -> float:
    return sum(v for (name, r), v in fleet.metrics().items() if name == "inflight:num_requests_running" and r)


def test_a_client_that_leaves_stops_its_request_on_the_replica(fleet: Fleet) -> None:
    # Alone on its replica, the stream is that replica's channel: the ingress must abort it by
    # a call pinned there, not cancel the call that carries the channel.
    model = fleet.client.models.list().data[0].id
    body = {"model": model, "prompt": "A long tale:", "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
        deadline = time.monotonic() + 15
        for line in resp.iter_lines():  # until a replica's report shows it running
            assert line.startswith("data: {") or not line, f"the stream ended early: {line}"
            if line and _running(fleet) >= 1:
                break
            assert time.monotonic() < deadline, "the request never showed as running"
    deadline = time.monotonic() + 15  # 600 tokens would take a minute on one thread
    while _running(fleet):
        assert time.monotonic() < deadline, "the replica kept generating for a client that had left"
        time.sleep(0.5)
    assert _chat(fleet, "Still there?")[0]  # and the channel serves the next request


def test_a_client_that_leaves_a_whole_completion_stops_it_on_the_replica(fleet: Fleet) -> None:
    # Not streamed: its answer begins only once it is done, so the ingress must watch for the
    # client while it waits (it waited, and the replica generated all 1000 tokens for nobody).
    model = fleet.client.models.list().data[0].id
    body = {"model": model, "prompt": "A long tale:", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet.url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=2.0))
    # 1000 tokens take 10 s or more on one thread: a request left running would outlast this.
    deadline = time.monotonic() + 3
    while _running(fleet):
        assert time.monotonic() < deadline, "the replica kept generating for a client that had left"
        time.sleep(0.2)
    assert _chat(fleet, "Still there?")[0]


def test_a_killed_replica_ends_its_streams_with_an_error(fleet: Fleet) -> None:
    model = fleet.client.models.list().data[0].id
    pids = fleet.wait_for_replicas(2, timeout_s=30)
    n = 6
    replica_of: list[str | None] = [None] * n
    events: list[list[str]] = [[] for _ in range(n)]
    started = [threading.Event() for _ in range(n)]

    def stream(i: int) -> None:
        body = {"model": model, "prompt": f"Tale {i}:", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", fleet.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as resp:
            replica_of[i] = resp.headers.get("x-inflight-replica")
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line.removeprefix("data: "))
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    victim = replica_of[0]
    assert victim in pids
    os.kill(pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
    for i in range(n):
        assert events[i][-1] == "[DONE]"
        last = json.loads(events[i][-2])
        if replica_of[i] == victim:
            assert "error" in last, "a stream of the killed replica ended without an error event"
    # New requests go to the survivor at once (Ray Serve then starts a replacement).
    survivor_text, survivor = _chat(fleet, "After the failure: batteries?")
    assert survivor != victim and survivor_text
    assert time.monotonic() - t0 < 150
    # And every pool that reports comes back to idle: no request left running, every KV block free.
    deadline = time.monotonic() + 30
    while True:
        values = fleet.metrics()
        busy = {(name, r): v for (name, r), v in values.items() if v and r is not None
                and name in ("inflight:num_requests_running", "inflight:kv_cache_blocks_used")}
        if not busy and ("inflight:num_requests_running", survivor) in values:
            break
        assert time.monotonic() < deadline, f"pools still busy after the failure: {busy}"
        time.sleep(0.5)
    # Ray Serve replaces the dead replica: a new one reports beside the survivor.
    fleet.wait_for_replicas(2, timeout_s=90, without=victim)


def test_sigterm_drains_the_fleet_and_exits_zero(fleet: Fleet) -> None:
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(90) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(fleet.url + "/health", timeout=2)
