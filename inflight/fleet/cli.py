"""`inflight serve --replicas N`: the fleet's options on the `serve` command, and its start-up.

`inflight.cli` adds these options to the parser `inflight.server.cli` builds and sends a serve
with more than one replica (or autoscaling bounds) here; Ray is imported only then.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from inflight.errors import ConfigError
from inflight.fleet.routing import POLICIES, RouterConfig
from inflight.options import engine_options
from inflight.server.cli import server_config


def add_fleet_options(p: argparse.ArgumentParser) -> None:
    router = RouterConfig()
    g = p.add_argument_group("fleet (--replicas 2 or more: engine replicas on Ray Serve; see docs/scale-out.md)")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas behind one router (default 1: one process, no Ray)")
    g.add_argument("--router", default=router.policy, choices=[*POLICIES, "ray"],
                   help="prefix: the replica caching the longest prefix of the prompt, unless overloaded; "
                        "pow2: the less loaded (KV, waiting tokens) of two random replicas; round-robin; "
                        "ray: Ray Serve's own router (two random replicas, by requests in flight)")
    g.add_argument("--router-max-waiting-tokens", type=int, default=router.max_waiting_tokens,
                   help="prefix router: a replica with more tokens than this waiting to prefill is overloaded")
    g.add_argument("--router-min-free-kv", type=float, default=router.min_free_kv,
                   help="prefix router: a replica with less than this share of its KV pool free is overloaded")
    g.add_argument("--replica-cpus", type=int, default=None,
                   help="CPUs (and torch threads) per replica (default: this machine's cores shared out)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale down to this many replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="autoscaling: the requests in flight per replica Ray Serve scales to")
    g.add_argument("--upscale-delay", type=float, default=5.0,
                   help="autoscaling: seconds of demand above target before a replica is added")
    g.add_argument("--downscale-delay", type=float, default=30.0,
                   help="autoscaling: seconds of demand below target before a replica is removed")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start Ray in this process, without its dashboard)")


def wants_fleet(args: argparse.Namespace) -> bool:
    return args.replicas != 1 or args.min_replicas is not None or args.max_replicas is not None


def cmd_serve_fleet(args: argparse.Namespace) -> int:
    """The fleet on Ray Serve, until SIGTERM or Ctrl-C; then drains and exits 0."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--replicas needs Ray Serve: pip install 'inflight[fleet]'")
    from inflight.config import EngineConfig
    from inflight.engine.engine import check_engine_fits
    from inflight.fleet.launch import FleetConfig, deploy, shutdown, start_ray

    config, options = server_config(args), engine_options(args)

    try:
        router = None if args.router == "ray" else RouterConfig(
            args.router, max_waiting_tokens=args.router_max_waiting_tokens, min_free_kv=args.router_min_free_kv)
    except ValueError as exc:
        raise ConfigError(f"--router: {exc}") from None
    fleet = FleetConfig(replicas=args.replicas, replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
                        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                        target_ongoing_requests=args.target_ongoing_requests, upscale_delay_s=args.upscale_delay,
                        downscale_delay_s=args.downscale_delay, ray_address=args.ray_address, router=router)
    # A bad option, or replicas that would not fit in this machine's memory, is one CLI line
    # before Ray starts (replicas on a cluster are its machines' business).
    engine_config = EngineConfig.from_kwargs(args.model, **options)
    if args.ray_address is None:
        check_engine_fits(engine_config, copies=max(args.replicas, args.max_replicas or 0))
    stopped: list[int] = []
    previous: dict[int, Any] = {}
    try:
        start_ray(fleet)
        # After Ray's start-up, which installs a SIGTERM handler of its own in this process. A
        # signal during the deploy stops the fleet before it serves; once it serves, uvicorn's
        # handlers take over, and re-raise the signal into these after the drain.
        previous = {sig: signal.signal(sig, lambda sig, _: stopped.append(sig))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        running = deploy(fleet, args.model, options, config, args.host, args.port, args.log_level)
        if not stopped:
            print(f"inflight: serving {args.replicas} replicas on {running.url} (router: {args.router})",
                  file=sys.stderr)
            running.server.run()
        print("inflight: stopping the fleet", file=sys.stderr)
    finally:
        shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
