"""The routing rules of `inflight.fleet.routing` as a Ray Serve request router.

Ray Serve runs one router per deployment handle, in the process that holds the handle (the
fleet's ingress). Each replica's `record_routing_stats` report (its `ReplicaLoad`) reaches it as
`RunningReplica.routing_stats`; the ingress puts each request's `RouteHint` in the call's
`route` keyword. The router answers with ranks of replicas: the chosen one alone, then the rest
by load, so that Ray falls back down the list when the first is at `max_ongoing_requests`.

Requests are matched to routing decisions by their own id (no FIFOMixin): a decision made for
one prompt's prefix must not be spent on another's. A decision counts towards its replica's load
as soon as it is made, so that a burst routed in one go sees its own earlier members; should Ray
send the request elsewhere (the first choice was full), it moves there.

A call with a `to_replica` keyword (the ingress aborting a relayed request) is pinned to that
replica, and counts as no load.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from inflight.fleet.routing import ReplicaLoad, RouteHint, Router, RouterConfig

logger = logging.getLogger("ray.serve")

_MAX_TRACKED = 100_000


def route_hint(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else None


class InflightRequestRouter(RequestRouter):
    """`request_router_kwargs` are the fields of `RouterConfig` (policy and thresholds)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.rule: Router[ReplicaID] = Router(RouterConfig(**kwargs))
        self._seen: dict[ReplicaID, int] = {}  # id() of the stats dict last read, per replica
        # Request id -> the replica it was counted on, until it completes (bounded: a request
        # cancelled before dispatch never completes).
        self._chosen: OrderedDict[str, ReplicaID] = OrderedDict()

    def _read_reports(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            stats = replica.routing_stats
            if self._seen.get(replica.replica_id) != id(stats):
                self._seen[replica.replica_id] = id(stats)
                self.rule.report(replica.replica_id, ReplicaLoad.from_dict(stats))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None and (pin := pending_request.kwargs.get("to_replica")) is not None:
            # Gone: any replica will do, and will say it has no such request.
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin] or candidate_replicas]
        self._read_reports(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        hint = route_hint(pending_request)
        decision = self.rule.choose(list(by_id), hint)
        if pending_request is not None:
            self._count_on(decision.ranked[0], pending_request)
        first, *rest = (by_id[i] for i in decision.ranked)
        return [[first], rest] if rest else [[first]]

    def _count_on(self, replica_id: ReplicaID, pending_request: PendingRequest) -> None:
        key = pending_request.metadata.internal_request_id
        previous = self._chosen.get(key)
        if previous == replica_id:
            return
        if previous is not None:
            self.rule.withdraw(previous, key)
        self._chosen[key] = replica_id
        while len(self._chosen) > _MAX_TRACKED:
            self._chosen.popitem(last=False)
        self.rule.on_routed(replica_id, route_hint(pending_request) or RouteHint(), key)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        if "to_replica" not in pending_request.kwargs:
            self._count_on(replica_id, pending_request)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._chosen.pop(internal_request_id, None) is not None:  # not a pinned call
            self.rule.on_finished(replica_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if not hasattr(self, "rule"):  # before initialize_state
            return
        live = {r.replica_id for r in replicas}
        for gone in [r for r in self.rule.replicas if r not in live]:  # scaled down, or replaced
            self.rule.forget(gone)
            self._seen.pop(gone, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.rule.forget(replica_id)
        self._seen.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)
