"""One engine replica of the fleet: a Ray Serve deployment around the single-process server.

Each replica builds its own engine and its own copy of the single-process app, and runs every
forwarded request through that app (`inflight.fleet.asgi`), so a replica answers exactly as
`inflight serve` does alone. A request that says whom to reply to is answered over that
ingress's channel, a step's pieces at a time (`inflight.fleet.relay`); one that does not (the
ingress under Ray Serve's own router, which cannot pin a call to a replica) streams its own
pieces back. Besides requests it answers Ray Serve's two questions:
`record_routing_stats` (its load and prefix-cache keys, for the router; it also hands its
Prometheus text to the fleet's metrics board) and `check_health`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch
from ray import serve

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.fleet.asgi import ForwardedRequest, ResponseStart, call_app
from inflight.fleet.relay import END, Outbox, Relayed
from inflight.fleet.routing import ReplicaLoad, RouteHint
from inflight.server.app import build_app
from inflight.server.async_engine import AsyncEngine
from inflight.server.config import ServerConfig

logger = logging.getLogger("ray.serve")


class EngineReplica:
    def __init__(self, model: str | None, engine_options: dict[str, Any], server_config: ServerConfig,
                 threads: int, board: Any = None) -> None:
        torch.set_num_threads(max(1, threads))
        self.engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model, **engine_options)))
        # The app's lifespan would start the engine; here the replica's life is the app's.
        self.app = build_app(self.engine, server_config)
        self.engine.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._board = board  # the MetricsBoard actor, or None
        self._where = {"pid": str(os.getpid()), "node": ray.get_runtime_context().get_node_id()[:12]}
        self._outboxes: dict[str, Outbox] = {}  # ingress id -> what is owed to it
        self._relayed: dict[tuple[str, str], asyncio.Task[None]] = {}  # (ingress id, key) -> its request

    async def _answers(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer; it says which replica answered (`x-inflight-replica`)."""
        async for item in call_app(self.app, request):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, (*item.headers, ("x-inflight-replica", self.replica_id)))
            yield item

    async def handle(self, request: ForwardedRequest, route: RouteHint | None = None, reply_to: str | None = None,
                     key: str = "") -> AsyncIterator[Any]:
        """`route` is the router's (what it knew of the request); the app needs nothing of it.
        Without `reply_to`, yields the answer itself; with it, `Relayed`, then (if this call is
        the channel) batches for that ingress, else nothing until the request ends."""
        if reply_to is None:
            async for item in self._answers(request):
                yield item
            return
        box = self._outboxes.setdefault(reply_to, Outbox())
        box.open(key)
        task = asyncio.create_task(self._relay(request, box, key))
        self._relayed[reply_to, key] = task
        task.add_done_callback(lambda _: self._relayed.pop((reply_to, key), None))
        if box.has_channel:
            yield Relayed(self.replica_id, channel=False)
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:  # the ingress cancelled the call: its client left
                task.cancel()
                raise
            return
        box.has_channel = True
        yield Relayed(self.replica_id, channel=True)
        async for batch in box.batches():
            yield batch
        if not box.keys and not box.has_channel:
            self._outboxes.pop(reply_to, None)

    async def _relay(self, request: ForwardedRequest, box: Outbox, key: str) -> None:
        try:
            async for item in self._answers(request):
                box.put(key, item)
        finally:
            box.put(key, END)
            box.close(key)

    async def abort(self, reply_to: str, key: str, to_replica: str | None = None) -> bool:
        """Ends a relayed request whose client has left (the ingress pins this call here with
        `to_replica`); False if it is not running here."""
        task = self._relayed.get((reply_to, key))
        if task is None:
            return False
        task.cancel()
        return True

    async def record_routing_stats(self) -> dict[str, Any]:
        load = ReplicaLoad.of(self.engine.stats, await self.engine.cached_block_hashes(), time.time())
        if self._board is not None:
            self._board.report.remote(self.replica_id, self.app.state.metrics.render(), self._where)
        return load.to_dict()

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError("the engine loop has stopped")

    def __del__(self) -> None:
        # Ray Serve calls this at a graceful stop, once the ongoing requests have finished (or
        # graceful_shutdown_timeout_s has passed): what is left ends with an error.
        self.engine.stop()
