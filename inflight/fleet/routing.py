"""Which engine replica takes a request: the routing rules, apart from Ray (pure Python).

The same rules run behind Ray Serve (`inflight.fleet.router`) and in the simulator's fleet, so
what `inflight sim --replicas` predicts is what `inflight serve --replicas` does.

Each replica reports a `ReplicaLoad` now and then: its KV blocks free and in all, the tokens
waiting to be prefilled, and the keys of the blocks in its prefix cache (the block manager's
chained hashes, so equal keys mean equal prefixes). Between two reports the router counts what
it sent itself (`Router.on_routed`): each request's prompt tokens less those cached there,
waiting until the request ends (`on_finished`), and its block keys, which that replica will
cache once it prefills them.
Entries older than the newest report by more than `report_lag_s` are dropped, since the report
already shows them.

The policies:

- ``prefix``: the replica whose cache holds the longest prefix of the prompt takes it, unless
  that replica is overloaded (free KV below `min_free_kv` of its pool, or more than
  `max_waiting_tokens` waiting to prefill) or no replica holds even `min_match_blocks` of it;
  then the less loaded of two replicas drawn at random takes it.
- ``pow2``: the less loaded of two random replicas (power of two choices), by the same load.
- ``round-robin``: each replica in turn, blind to load and cache.

Load, from least to most: fewer tokens waiting to prefill (reported plus routed since), then
more free KV blocks, then fewer requests in flight.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from inflight.engine.stats import EngineStats

Policy = Literal["prefix", "pow2", "round-robin"]
POLICIES: tuple[Policy, ...] = ("prefix", "pow2", "round-robin")

R = TypeVar("R", bound=Hashable)  # a replica's id: Ray's ReplicaID, or an index in the simulator


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica reports about itself (`to_dict` travels through Ray's routing stats)."""

    time: float = 0.0  # when it was taken (the reporter's clock, time.time())
    free_blocks: int = 0
    total_blocks: int = 0
    waiting_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    cached: frozenset[int] = frozenset()  # prefix-cache keys

    @classmethod
    def of(cls, stats: EngineStats, cached: Iterable[int], now: float) -> ReplicaLoad:
        """The report of an engine whose snapshot is `stats` and prefix-cache keys `cached`."""
        return cls(time=now, free_blocks=stats.num_kv_blocks_total - stats.num_kv_blocks_used,
                   total_blocks=stats.num_kv_blocks_total, waiting_tokens=stats.num_waiting_tokens,
                   num_running=stats.num_running, num_waiting=stats.num_waiting, cached=frozenset(cached))

    @property
    def free_share(self) -> float:
        return self.free_blocks / self.total_blocks if self.total_blocks else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "free_blocks": self.free_blocks, "total_blocks": self.total_blocks,
                "waiting_tokens": self.waiting_tokens, "num_running": self.num_running,
                "num_waiting": self.num_waiting, "cached": list(self.cached)}

    @classmethod
    def from_dict(cls, stats: dict[str, Any] | None) -> ReplicaLoad | None:
        """None for a replica that has not reported yet (or reported something else)."""
        if not stats or "free_blocks" not in stats:
            return None
        return cls(time=float(stats.get("time", 0.0)), free_blocks=int(stats["free_blocks"]),
                   total_blocks=int(stats.get("total_blocks", 0)), waiting_tokens=int(stats.get("waiting_tokens", 0)),
                   num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
                   cached=frozenset(int(h) for h in stats.get("cached", ())))


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the router knows of a request: its prompt's length and full blocks' keys."""

    num_prompt_tokens: int = 0
    block_hashes: tuple[int, ...] = ()
    block_size: int = 16


@dataclass(frozen=True)
class RouterConfig:
    policy: Policy = "prefix"
    # A replica past either limit is overloaded: the prefix rule passes it by.
    max_waiting_tokens: int = 8192
    min_free_kv: float = 0.05
    min_match_blocks: int = 1  # shorter matches than this count as none
    report_lag_s: float = 1.0  # how long a routed request may take to show in a report
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_waiting_tokens < 0 or not 0.0 <= self.min_free_kv <= 1.0 or self.min_match_blocks < 1:
            raise ValueError("router thresholds: max_waiting_tokens >= 0, 0 <= min_free_kv <= 1, min_match_blocks >= 1")


@dataclass
class _Routed:
    time: float
    hint: RouteHint
    prefill_tokens: int  # what it adds to its replica's queue: the prompt less what was cached there
    key: Hashable | None = None
    finished: bool = False  # no longer waiting; its prefix still counts as cached there


@dataclass
class _View:
    """The router's picture of one replica: its last report and what was routed since."""

    report: ReplicaLoad | None = None
    routed: deque[_Routed] = field(default_factory=deque)
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Decision(Generic[R]):
    """The chosen replica first, then the others, best first; `reason` says which rule chose."""

    ranked: list[R]
    reason: Literal["prefix", "balance", "round-robin"]
    matched_blocks: int = 0


class Router(Generic[R]):
    """One routing rule over a changing set of replicas. Not thread-safe: call it from one
    thread (Ray's router calls it from its event loop, the simulator from its loop)."""

    def __init__(self, config: RouterConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config or RouterConfig()
        self._clock = clock
        self._rng = random.Random(self.config.seed)
        self._views: dict[R, _View] = {}
        self._turn = 0

    # --- what the router learns ---------------------------------------------------------------

    def report(self, replica: R, load: ReplicaLoad | None) -> None:
        """A replica's newest report (None: it has not reported yet)."""
        view = self._views.setdefault(replica, _View())
        if load is None or (view.report is not None and load.time <= view.report.time):
            return
        view.report = load
        horizon = load.time - self.config.report_lag_s
        while view.routed and view.routed[0].time < horizon:
            view.routed.popleft()

    def on_routed(self, replica: R, hint: RouteHint, key: Hashable | None = None) -> None:
        """A request went to `replica`; `key` names it for `on_finished`."""
        cached = self.matched_blocks(replica, hint.block_hashes) * hint.block_size
        view = self._views.setdefault(replica, _View())
        view.routed.append(_Routed(self._clock(), hint, max(0, hint.num_prompt_tokens - cached), key))
        view.in_flight += 1

    def on_finished(self, replica: R, key: Hashable | None = None) -> None:
        """The request `key` (routed to `replica`) has ended: it waits no more."""
        view = self._views.get(replica)
        if view is None:
            return
        if view.in_flight:
            view.in_flight -= 1
        if key is not None:
            for routed in view.routed:
                if routed.key == key:
                    routed.finished = True
                    break

    def withdraw(self, replica: R, key: Hashable) -> None:
        """Takes back `on_routed(replica, ..., key)`: the request went elsewhere after all."""
        view = self._views.get(replica)
        if view is None:
            return
        for routed in view.routed:
            if routed.key == key:
                view.routed.remove(routed)
                view.in_flight = max(0, view.in_flight - 1)
                return

    @property
    def replicas(self) -> list[R]:
        """The replicas the router has heard of (reported, or routed to)."""
        return list(self._views)

    def forget(self, replica: R) -> None:
        """The replica is gone (dead, or scaled down)."""
        self._views.pop(replica, None)

    # --- the estimates the rules use ------------------------------------------------------------

    def waiting_tokens(self, replica: R) -> int:
        view = self._views.get(replica)
        if view is None:
            return 0
        reported = view.report.waiting_tokens if view.report is not None else 0
        return reported + sum(r.prefill_tokens for r in view.routed if not r.finished)

    def is_overloaded(self, replica: R) -> bool:
        view = self._views.get(replica)
        if view is None:
            return False
        if self.waiting_tokens(replica) > self.config.max_waiting_tokens:
            return True
        return view.report is not None and view.report.free_share < self.config.min_free_kv

    def matched_blocks(self, replica: R, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica holds (or soon will)."""
        view = self._views.get(replica)
        if view is None or not hashes:
            return 0
        cached = view.report.cached if view.report is not None else frozenset()
        best = 0
        for routed in view.routed:  # prefixes sent since the report, cached once prefilled
            best = max(best, _common_prefix(routed.hint.block_hashes, hashes))
        n = 0
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return max(best, n)

    def _load_key(self, replica: R) -> tuple[int, int, int]:
        view = self._views.get(replica)
        free = view.report.free_blocks if view is not None and view.report is not None else 0
        in_flight = view.in_flight if view is not None else 0
        return (self.waiting_tokens(replica), -free, in_flight)

    # --- the rule -------------------------------------------------------------------------------

    def choose(self, replicas: Sequence[R], hint: RouteHint | None = None) -> Decision[R]:
        """Ranks the candidate `replicas` for a request (`replicas` must not be empty)."""
        if not replicas:
            raise ValueError("no replicas to choose from")
        candidates = list(replicas)
        if self.config.policy == "round-robin":
            first = self._turn % len(candidates)
            self._turn += 1
            return Decision(candidates[first:] + candidates[:first], "round-robin")
        if self.config.policy == "prefix" and hint is not None and hint.block_hashes:
            matches = {r: self.matched_blocks(r, hint.block_hashes) for r in candidates}
            best = max(matches.values())
            if best >= self.config.min_match_blocks:
                holders = [r for r in candidates if matches[r] == best and not self.is_overloaded(r)]
                if holders:
                    chosen = min(holders, key=self._load_key)
                    rest = sorted((r for r in candidates if r != chosen), key=self._load_key)
                    return Decision([chosen, *rest], "prefix", best)
        return Decision(self._two_choices(candidates), "balance")

    def _two_choices(self, candidates: list[R]) -> list[R]:
        """The less loaded of two drawn at random first, then the rest by load."""
        if len(candidates) <= 2:
            drawn = list(candidates)
            self._rng.shuffle(drawn)  # ties go either way
        else:
            drawn = self._rng.sample(candidates, 2)
        first = min(drawn, key=self._load_key)
        return [first, *sorted((r for r in candidates if r != first), key=self._load_key)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
