"""Responses carried from a replica to the ingress a step at a time, not a chunk at a time.

A Ray Serve streaming call costs about a millisecond of CPU per item it carries (both ends
together, on this project's 2-core test machine), and a replica that streams one chunk per
request per step sends hundreds of items a second. So a replica sends each ingress every piece
that is ready as one batch, over one of that ingress's calls: the *channel*.

- The ingress names each request (`key`) and says who it is (`reply_to`).
- The first such request a replica takes while it has no channel to that ingress becomes the
  channel. Its call first answers `Relayed(channel=True)`, then carries batches of
  `(key, item)` for every request of that ingress on this replica, its own included.
- Any other request's call answers `Relayed(channel=False)` and stays open, carrying nothing,
  until its request ends. Ray Serve therefore still sees one ongoing call per request, which
  its autoscaler and `max_ongoing_requests` count.
- The channel closes once no request of its ingress is left on the replica. The next request
  opens a new one.
- Each request's items are its `ResponseStart`, its body pieces, then `END`.

The replica side is `Outbox`; the ingress side is `Inbox`. Neither imports Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Relayed:
    """A relayed call's first answer: where the request runs, and whether this call carries
    the channel."""

    replica_id: str
    channel: bool


@dataclass(frozen=True, slots=True)
class Failed:
    """Put in a request's inbox when its replica is gone."""

    reason: str


END = "end"  # the last item of each request
_SETTLE_ROUNDS = 8  # loop turns a batch waits for more pieces, while more keep arriving


@dataclass(eq=False)
class Outbox:
    """The pieces a replica owes one ingress, and which of its requests are still running."""

    keys: set[str] = field(default_factory=set)
    items: list[tuple[str, Any]] = field(default_factory=list)
    has_channel: bool = False
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def open(self, key: str) -> None:
        self.keys.add(key)

    def put(self, key: str, item: Any) -> None:
        self.items.append((key, item))
        self._wake.set()

    def close(self, key: str) -> None:
        """The request has ended (its `END` is already put)."""
        self.keys.discard(key)
        self._wake.set()

    async def batches(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """The channel's batches: every item ready, after the loop has settled, so that the
        pieces of one engine step (sent by many requests within a turn or two) travel together.
        Ends once no request is left and all is sent; `has_channel` is cleared in the same turn,
        so a request that comes later opens a new channel."""
        try:
            while True:
                while not self.items:
                    if not self.keys:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                seen = -1
                for _ in range(_SETTLE_ROUNDS):
                    if len(self.items) == seen:
                        break
                    seen = len(self.items)
                    await asyncio.sleep(0)
                batch, self.items = self.items, []
                yield batch
        finally:
            self.has_channel = False


class Inbox:
    """The ingress's side: a queue per request it has sent, fed by the channels' batches."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._placed: dict[str, set[str]] = {}  # replica id -> its keys here

    def expect(self, key: str) -> asyncio.Queue[Any]:
        """Registers `key` before its call is made: its channel may deliver before the call answers."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[key] = queue
        return queue

    def placed(self, key: str, replica_id: str) -> None:
        if key in self._queues:
            self._placed.setdefault(replica_id, set()).add(key)

    def forget(self, key: str) -> None:
        self._queues.pop(key, None)
        for keys in self._placed.values():
            keys.discard(key)

    def deliver(self, batch: list[tuple[str, Any]]) -> None:
        """Items for requests the ingress has forgotten (their clients left) are dropped."""
        for key, item in batch:
            if (queue := self._queues.get(key)) is not None:
                queue.put_nowait(item)

    def fail(self, key: str, reason: str) -> None:
        if (queue := self._queues.get(key)) is not None:
            queue.put_nowait(Failed(reason))

    def fail_replica(self, replica_id: str, reason: str) -> None:
        for key in self._placed.pop(replica_id, set()):
            self.fail(key, reason)

    def __len__(self) -> int:
        return len(self._queues)
