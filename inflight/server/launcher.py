"""Runs the app under uvicorn with a graceful drain on shutdown (SIGTERM, SIGINT)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, NamedTuple, Protocol

import uvicorn
from starlette.types import ASGIApp

from inflight.engine.engine import LLMEngine
from inflight.server.app import build_app
from inflight.server.async_engine import AsyncEngine
from inflight.server.config import ServerConfig

logger = logging.getLogger("uvicorn.error")  # shown with uvicorn's own lifecycle messages

# After the drain, uvicorn waits this long for responses still being written before it
# cancels them; the drain itself is bounded by ServerConfig.shutdown_timeout_s.
_FLUSH_TIMEOUT_S = 5


class Drainable(Protocol):
    """What a server drains before it stops: the engine, or a fleet's ingress."""

    @property
    def num_active(self) -> int: ...

    async def drain(self, timeout_s: float, give_up: Callable[[], bool] = ...) -> int: ...


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains (the engine, or a fleet's ingress) before it stops listening.

    uvicorn's own shutdown closes the listening sockets first, so a client arriving during
    the wait would be refused at the TCP level. Draining first keeps answering: new requests
    get a 503 with an OpenAI error body while the running ones finish (up to the timeout),
    then the rest end with an error. A second Ctrl-C (force exit) cuts the wait short.
    """

    def __init__(self, config: uvicorn.Config, drainable: Drainable, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drainable = drainable
        self._drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drainable.num_active:
            logger.info("Draining: waiting up to %.0f s for %d running requests",
                        self._drain_timeout_s, self.drainable.num_active)
        await self.drainable.drain(self._drain_timeout_s, give_up=lambda: self.force_exit)
        await super().shutdown(sockets)


def make_server(engine: LLMEngine | AsyncEngine, config: ServerConfig, host: str = "127.0.0.1",
                port: int = 8000, log_level: str = "info") -> GracefulServer:
    """A ready-to-run server; call `.run()` (or `.run(sockets=[sock])` with a bound socket)."""
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    return graceful_server(build_app(async_engine, config), async_engine, config, host, port, log_level)


def graceful_server(app: ASGIApp, drainable: Drainable, config: ServerConfig, host: str, port: int,
                    log_level: str, lifespan: Literal["on", "off"] = "on") -> GracefulServer:
    """`app` under uvicorn, draining `drainable` (up to the config's shutdown timeout) before
    it stops listening: one process's server, or a fleet's ingress (`lifespan="off"`)."""
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan=lifespan,
                               timeout_graceful_shutdown=_FLUSH_TIMEOUT_S)
    return GracefulServer(uv_config, drainable, config.shutdown_timeout_s)


class RunningServer(NamedTuple):
    url: str
    server: GracefulServer
    engine: AsyncEngine


@contextmanager
def serve_in_thread(engine: LLMEngine | AsyncEngine, config: ServerConfig, host: str = "127.0.0.1",
                    log_level: str = "warning", start_timeout_s: float = 30.0) -> Iterator[RunningServer]:
    """Runs a server in a background thread on a free port of `host` (for tests, benchmarks
    and notebooks); it shuts down gracefully when the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    server = make_server(async_engine, config, host, port, log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="inflight-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        yield RunningServer(f"http://{host}:{port}", server, async_engine)
    finally:
        server.should_exit = True
        thread.join(config.shutdown_timeout_s + _FLUSH_TIMEOUT_S + 10)
        sock.close()
