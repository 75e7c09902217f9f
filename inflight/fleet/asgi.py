"""One HTTP request carried across processes to an ASGI app, and its response carried back.

The ingress forwards a request as plain data (`ForwardedRequest`); the replica runs it through
its own copy of the single-process app (`call_app`), so that every endpoint, error and stream
behaves exactly as `inflight serve` does in one process. The response comes back as a
`ResponseStart`, then pieces of its body, each as soon as the app sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

# Hop-by-hop and length headers describe one connection, not the message: each side sets its own.
_NOT_FORWARDED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[str, str], ...]

    @property
    def media_type(self) -> str:
        return next((v for k, v in self.headers if k == "content-type"), "").split(";")[0].strip()


def forwardable(headers: list[tuple[bytes, bytes]] | list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The end-to-end headers, names in lower case."""
    out = []
    for name, value in headers:
        k = name.decode("latin-1") if isinstance(name, bytes) else name
        v = value.decode("latin-1") if isinstance(value, bytes) else value
        if k.lower() not in _NOT_FORWARDED:
            out.append((k.lower(), v))
    return tuple(out)


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Runs `request` through `app`; yields the response's start, then its body in pieces (the
    pieces ready at once are joined). When the caller stops early (its client left), the app
    sees `http.disconnect`, as it would from a real connection, and cleans up."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "root_path": "", "query_string": request.query_string,
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]
        + [(b"content-length", str(len(request.body)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.ensure_future(run())
    backlog: list[Message | None] = []  # taken from the queue while joining pieces, not yet handled
    try:
        while True:
            message = backlog.pop() if backlog else await messages.get()
            if message is None:  # the app returned without finishing its response
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], forwardable(message.get("headers", [])))
                continue
            if message["type"] != "http.response.body":
                continue
            piece, more = bytearray(message.get("body", b"")), message.get("more_body", False)
            while more and not messages.empty():  # join what is already waiting
                nxt = messages.get_nowait()
                if nxt is None or nxt["type"] != "http.response.body":
                    backlog.append(nxt)
                    break
                piece += nxt.get("body", b"")
                more = nxt.get("more_body", False)
            if piece:
                yield bytes(piece)
            if not more:
                return
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        if not task.done():
            task.cancel()
