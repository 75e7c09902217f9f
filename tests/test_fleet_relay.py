"""The relay (`inflight.fleet.relay`): a replica answers many requests of one ingress over one
channel, a step's pieces per batch. The replica's side runs here without Ray: `EngineReplica`'s
request methods over a small Starlette app that streams like the server does (many requests
each send a piece per "step"), and the ingress's `Inbox` fed by the channel's batches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from inflight.fleet.asgi import ForwardedRequest, ResponseStart
from inflight.fleet.relay import END, Failed, Inbox, Outbox, Relayed
from inflight.fleet.replica import EngineReplica

PIECES = 5


class Steps:
    """One engine: each step wakes every request's stream at once, as the loop thread does."""

    def __init__(self) -> None:
        self.tick = asyncio.Condition()
        self.step = 0
        self.closed: list[str] = []

    async def run(self, steps: int) -> None:
        for _ in range(steps):
            await asyncio.sleep(0.01)
            async with self.tick:
                self.step += 1
                self.tick.notify_all()


def _app(steps: Steps) -> Starlette:
    async def stream(request: Request) -> StreamingResponse:
        name = request.query_params["name"]

        async def body() -> AsyncIterator[bytes]:
            try:
                for i in range(PIECES):
                    async with steps.tick:
                        await steps.tick.wait()
                    yield f"data: {name}-{i}\n\n".encode()
            finally:
                steps.closed.append(name)

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", stream)])


def _replica(app: Starlette) -> EngineReplica:
    """The replica's request side, without the engine it would build."""
    replica = EngineReplica.__new__(EngineReplica)
    replica.app = app
    replica.engine = SimpleNamespace(stop=lambda: None)  # type: ignore[assignment]
    replica.replica_id = "r1"
    replica._outboxes = {}
    replica._relayed = {}
    return replica


def _request(name: str) -> ForwardedRequest:
    return ForwardedRequest("GET", "/stream", f"name={name}".encode(), (), b"")


async def _first(gen: AsyncIterator[Any]) -> Any:
    return await gen.__anext__()


def test_one_channel_carries_every_request_a_step_per_batch() -> None:
    async def run() -> None:
        steps = Steps()
        replica = _replica(_app(steps))
        calls = [replica.handle(_request(f"q{i}"), reply_to="ingress", key=f"k{i}") for i in range(4)]
        answers = [await _first(c) for c in calls]
        assert answers == [Relayed("r1", channel=True)] + [Relayed("r1", channel=False)] * 3
        inbox = Inbox()
        queues = {f"k{i}": inbox.expect(f"k{i}") for i in range(4)}
        batches: list[list[tuple[str, Any]]] = []

        async def read_channel() -> None:
            async for batch in calls[0]:
                batches.append(batch)
                inbox.deliver(batch)

        async def wait_out(call: AsyncIterator[Any]) -> list[Any]:
            return [item async for item in call]

        others = [asyncio.create_task(wait_out(c)) for c in calls[1:]]
        channel = asyncio.create_task(read_channel())
        await steps.run(PIECES + 2)
        await asyncio.wait_for(channel, 5)
        assert [await asyncio.wait_for(t, 5) for t in others] == [[], [], []]  # the other calls carry nothing
        for i, queue in enumerate(queues.values()):
            items = [queue.get_nowait() for _ in range(queue.qsize())]
            assert isinstance(items[0], ResponseStart) and items[0].status == 200
            assert ("x-inflight-replica", "r1") in items[0].headers
            assert items[1:] == [f"data: q{i}-{j}\n\n".encode() for j in range(PIECES)] + [END]
        # Each step's four pieces travel together: a batch per step, not a message per piece.
        pieces = [batch for batch in batches if any(isinstance(item, bytes) for _, item in batch)]
        assert len(pieces) <= PIECES + 1
        assert max(sum(isinstance(item, bytes) for _, item in b) for b in pieces) == 4
        # The channel closed with its last request; the next request opens a new one.
        assert replica._outboxes == {} and replica._relayed == {}
        again = replica.handle(_request("later"), reply_to="ingress", key="k9")
        assert await _first(again) == Relayed("r1", channel=True)
        await again.aclose()

    asyncio.run(run())


def test_an_aborted_or_cancelled_request_ends_and_the_channel_goes_on() -> None:
    async def run() -> None:
        steps = Steps()
        replica = _replica(_app(steps))
        channel = replica.handle(_request("a"), reply_to="ingress", key="a")
        other = replica.handle(_request("b"), reply_to="ingress", key="b")
        third = replica.handle(_request("c"), reply_to="ingress", key="c")
        for call in (channel, other, third):
            await _first(call)
        inbox = Inbox()
        got = {k: inbox.expect(k) for k in "abc"}
        waits = [asyncio.create_task(_drain(c)) for c in (other, third)]
        reader = asyncio.create_task(_feed(channel, inbox))
        await steps.run(2)
        # The channel's own request's client leaves: the ingress aborts it by a pinned call.
        assert await replica.abort("ingress", "a") is True
        waits[0].cancel()  # another's client leaves: the ingress cancels that call
        await steps.run(PIECES + 2)
        await asyncio.wait_for(reader, 5)
        assert sorted(steps.closed) == ["a", "b", "c"]  # every app stream was closed
        items = {k: [q.get_nowait() for _ in range(q.qsize())] for k, q in got.items()}
        assert items["a"][-1] == END and len(items["a"]) < PIECES + 2
        assert items["c"][-1] == END and len(items["c"]) == PIECES + 2
        assert await replica.abort("ingress", "a") is False  # gone already
        assert replica._relayed == {}

    asyncio.run(run())


async def _drain(call: AsyncIterator[Any]) -> None:
    async for _ in call:
        pass


async def _feed(channel: AsyncIterator[Any], inbox: Inbox) -> None:
    async for batch in channel:
        inbox.deliver(batch)


def test_outbox_keeps_what_is_put_before_the_channel_reads() -> None:
    async def run() -> None:
        box = Outbox()
        box.open("x")
        box.put("x", b"early")
        box.put("x", END)
        box.close("x")
        assert [b async for b in box.batches()] == [[("x", b"early"), ("x", END)]]
        assert not box.has_channel

    asyncio.run(run())


def test_inbox_routes_by_key_and_fails_one_replicas_requests() -> None:
    inbox = Inbox()
    a, b, c = inbox.expect("a"), inbox.expect("b"), inbox.expect("c")
    inbox.placed("a", "r1")
    inbox.placed("b", "r1")
    inbox.placed("c", "r2")
    inbox.deliver([("a", b"1"), ("gone", b"?"), ("c", b"2")])
    inbox.forget("b")
    inbox.fail_replica("r1", "stopped")
    assert a.get_nowait() == b"1" and a.get_nowait() == Failed("stopped")
    assert b.empty() and c.get_nowait() == b"2" and c.empty()
    assert len(inbox) == 2
