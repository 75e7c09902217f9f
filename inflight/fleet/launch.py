"""Starts a fleet: Ray (in-process, or joined), N engine replicas on Ray Serve behind the
inflight router, and the ingress's HTTP server in this process; and stops it again, draining
first: `start_ray`, `deploy`, then `running.server.run()` until a signal, then `shutdown` (as
`inflight serve --replicas` does)."""

from __future__ import annotations

import logging
import math
import os
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from inflight.errors import ConfigError, FleetError
from inflight.fleet.routing import POLICIES, RouterConfig
from inflight.server.config import ServerConfig
from inflight.server.launcher import GracefulServer, graceful_server

logger = logging.getLogger(__name__)

APP_NAME = "inflight"


@dataclass(frozen=True)
class FleetConfig:
    """`replicas` engines (or, with `min_replicas`/`max_replicas`, as many as Ray Serve's
    autoscaler keeps, starting from `replicas`), each on `replica_cpus` CPUs (its torch threads)
    and `replica_gpus` GPUs. `ray_address` None starts Ray in this process; else it joins there."""

    replicas: int = 2
    replica_cpus: int | None = None  # None: this machine's cores shared out
    replica_gpus: float = 0.0
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    max_ongoing_requests: int = 256  # per replica; Ray holds the rest in the router's queue
    ray_address: str | None = None
    router: RouterConfig | None = field(default_factory=RouterConfig)  # None: Ray Serve's own router
    stats_period_s: float = 1.0  # how often replicas report their load and cache to the router
    health_check_period_s: float = 2.0
    object_store_mb: int = 256

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replica_cpus is not None and self.replica_cpus < 1:
            raise ConfigError(f"--replica-cpus must be >= 1, got {self.replica_cpus}")
        if self.replica_gpus < 0:
            raise ConfigError(f"--replica-gpus must be >= 0, got {self.replica_gpus}")
        if self.autoscaling:
            lo, hi = self.min_replicas or 1, self.max_replicas or max(self.replicas, self.min_replicas or 1)
            if not 1 <= lo <= self.replicas <= hi:
                raise ConfigError(f"autoscaling needs 1 <= --min-replicas ({lo}) <= --replicas ({self.replicas}) "
                                  f"<= --max-replicas ({hi})")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ConfigError("--upscale-delay and --downscale-delay must be >= 0")
        if self.target_ongoing_requests <= 0:
            raise ConfigError("--target-ongoing-requests must be > 0")
        if self.max_ongoing_requests < 1:
            raise ConfigError("max_ongoing_requests must be >= 1")
        if self.router is not None and self.router.policy not in POLICIES:
            raise ConfigError(f"--router must be one of {', '.join(POLICIES)} or ray")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        return max(self.replicas, self.max_replicas or 0)

    def cpus_per_replica(self) -> int:
        if self.replica_cpus is not None:
            return self.replica_cpus
        return max(1, (os.cpu_count() or 1) // self.replicas)

    def autoscaling_config(self) -> dict[str, Any] | None:
        if not self.autoscaling:
            return None
        lo = self.min_replicas or 1
        return {"min_replicas": lo, "initial_replicas": self.replicas,
                "max_replicas": self.max_replicas or max(self.replicas, lo),
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "metrics_interval_s": 1.0, "look_back_period_s": 5.0}


@dataclass
class RunningFleet:
    """The deployed replicas, and the ingress's server (not yet running): `server.run()` serves
    until SIGTERM or SIGINT, draining the ingress before it stops listening."""

    url: str
    server: GracefulServer
    config: FleetConfig


def start_ray(fleet: FleetConfig) -> None:
    """Starts Ray in this process, or joins `fleet.ray_address`. Ray installs a SIGTERM handler of
    its own here (it exits at once): a caller that drains on SIGTERM sets its handler after this."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if fleet.ray_address is not None:
        ray.init(address=fleet.ray_address, namespace=APP_NAME, logging_level=logging.WARNING)
        return
    cpus = fleet.cpus_per_replica() * fleet.most_replicas
    gpus = math.ceil(fleet.replica_gpus * fleet.most_replicas)
    ray.init(address="local", namespace=APP_NAME, num_cpus=cpus, num_gpus=gpus or None,
             include_dashboard=False, object_store_memory=fleet.object_store_mb << 20,
             logging_level=logging.WARNING)


def deploy(fleet: FleetConfig, model: str | None, engine_options: dict[str, Any], server: ServerConfig,
           host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> RunningFleet:
    """Starts the replicas on Ray (`start_ray` first); returns once every one is up, with the
    ingress's server ready to run. Ray Serve's own HTTP proxy is not started: the ingress is
    this process's server, so a streamed chunk crosses Ray once."""
    import ray
    from ray import serve
    from ray.serve.config import ProxyLocation

    from inflight.config import EngineConfig
    from inflight.fleet.ingress import FleetIngress, ingress_app
    from inflight.fleet.metrics import MetricsBoard
    from inflight.fleet.replica import EngineReplica
    from inflight.fleet.router import InflightRequestRouter

    block_size = EngineConfig.from_kwargs(model, **engine_options).cache.block_size  # checks the options too
    serve.start(proxy_location=ProxyLocation.Disabled, logging_config={"log_level": "WARNING"})
    # A replica that has not reported for five periods has gone (died, or scaled down).
    board = ray.remote(num_cpus=0)(MetricsBoard).options(name=f"metrics-{uuid.uuid4().hex[:8]}").remote(
        max(5.0, 5 * fleet.stats_period_s))
    cpus = fleet.cpus_per_replica()
    router_config: dict[str, Any] = {"request_routing_stats_period_s": fleet.stats_period_s,
                                     "request_routing_stats_timeout_s": max(5.0, 5 * fleet.stats_period_s)}
    if fleet.router is not None:  # else Ray Serve's default: power of two choices by requests in flight
        router_config.update(request_router_class=InflightRequestRouter, request_router_kwargs=asdict(fleet.router))
    replica_options: dict[str, Any] = {
        "name": "EngineReplica",
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": fleet.replica_gpus,
                              "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cpus)}}},
        "max_ongoing_requests": fleet.max_ongoing_requests,
        "request_router_config": router_config,
        "health_check_period_s": fleet.health_check_period_s,
        "health_check_timeout_s": max(10.0, 5 * fleet.health_check_period_s),
        "graceful_shutdown_timeout_s": server.shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "logging_config": {"log_level": "WARNING"},  # not a line per call
    }
    if fleet.autoscaling:
        replica_options["autoscaling_config"] = fleet.autoscaling_config()
    else:
        replica_options["num_replicas"] = fleet.replicas
    replicas = serve.deployment(**replica_options)(EngineReplica).bind(model, engine_options, server, cpus, board)
    try:
        handle = serve.run(replicas, name=APP_NAME, route_prefix=None)
    except RuntimeError as exc:  # Serve's word for a deployment that failed; the replicas' logs say why
        raise FleetError(f"the fleet did not start: {exc}") from None
    ingress = FleetIngress(handle, model, block_size, server, board, relay=fleet.router is not None)
    http = graceful_server(ingress_app(ingress), ingress, server, host, port, log_level, lifespan="off")
    return RunningFleet(f"http://{host}:{port}", http, fleet)


def shutdown() -> None:
    """Stops Serve (each replica drains what it still runs) and Ray; after the ingress's server
    has drained and stopped."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
