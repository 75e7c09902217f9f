"""`inflight serve`: the OpenAI-compatible HTTP server.

Heavy imports (torch, uvicorn) wait until the command runs, so `inflight --help` stays quick.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
from typing import Any

from inflight.cli import add_engine_options, engine_options
from inflight.errors import ConfigError
from inflight.server.config import ServerConfig

API_KEY_ENV = "INFLIGHT_API_KEY"
_DEFAULTS = ServerConfig()


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, "
                                          "/health and /metrics.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on /v1 (default: ${API_KEY_ENV} if set)")
    g.add_argument("--served-model-name", default=None, help="model name clients must send (default: the file's)")
    g.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                   help="larger request bodies get 413")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests beyond this many waiting get 429 (default: unbounded)")
    g.add_argument("--default-max-tokens", type=int, default=_DEFAULTS.default_max_tokens,
                   help="output cap for requests without max_tokens (never more than the context left)")
    g.add_argument("--shutdown-timeout", type=float, default=_DEFAULTS.shutdown_timeout_s,
                   help="seconds running requests may take to finish after SIGTERM")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (one that renders tools, say)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(p)
    _add_fleet_options(p)
    p.set_defaults(func=_cmd_serve)


def _add_fleet_options(p: argparse.ArgumentParser) -> None:
    from inflight.fleet.routing import POLICIES, RouterConfig

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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The startup warning for a server that anyone on the network could use, else None."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"inflight: WARNING: serving on {host} without an API key: anyone who can reach this port "
            f"can use the model. Set --api-key or ${API_KEY_ENV}, or bind 127.0.0.1.")


def _read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"--chat-template: cannot read {path}: {exc.strerror}") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    config = ServerConfig(
        chat_template=_read_chat_template(args.chat_template),
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    if (warning := exposure_warning(args.host, config.api_key)) is not None:
        print(warning, file=sys.stderr)

    from inflight.config import EngineConfig
    from inflight.engine.engine import LLMEngine
    from inflight.server.launcher import make_server

    options = engine_options(args)
    if args.max_waiting_requests is not None:
        options["max_waiting_requests"] = args.max_waiting_requests
    if args.replicas != 1 or args.min_replicas is not None or args.max_replicas is not None:
        return _serve_fleet(args, options, config)
    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **options))
    server = make_server(engine, config, args.host, args.port, args.log_level)
    # uvicorn re-raises the signal that stopped it once it has shut down, so that the default
    # action ends the process; after a clean drain a SIGTERM should end it with status 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _serve_fleet(args: argparse.Namespace, options: dict[str, Any], config: ServerConfig) -> int:
    """`--replicas N`: the fleet on Ray Serve, until SIGTERM or Ctrl-C; then drains and exits 0."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--replicas needs Ray Serve: pip install 'inflight[fleet]'")
    from inflight.config import EngineConfig
    from inflight.fleet.launch import FleetConfig, deploy, shutdown, start_ray
    from inflight.fleet.routing import RouterConfig

    try:
        router = None if args.router == "ray" else RouterConfig(
            args.router, max_waiting_tokens=args.router_max_waiting_tokens, min_free_kv=args.router_min_free_kv)
    except ValueError as exc:
        raise ConfigError(f"--router: {exc}") from None
    fleet = FleetConfig(replicas=args.replicas, replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
                        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                        target_ongoing_requests=args.target_ongoing_requests, upscale_delay_s=args.upscale_delay,
                        downscale_delay_s=args.downscale_delay, ray_address=args.ray_address, router=router)
    EngineConfig.from_kwargs(args.model, **options)  # a bad option is one CLI line before Ray starts
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
