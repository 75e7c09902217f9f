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

from inflight.errors import ConfigError
from inflight.options import add_engine_options, engine_options
from inflight.server.config import ServerConfig
from inflight.server.reasoning import REASONING_PARSERS

API_KEY_ENV = "INFLIGHT_API_KEY"
_DEFAULTS = ServerConfig()


def _port(text: str) -> int:
    """A TCP port, checked here: the socket layer takes 99999 as 99999 mod 65536 and would serve
    on 34463 while the log says 99999."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `serve` (the single process; `inflight.cli` adds the fleet's options and routes
    `--replicas` to `inflight.fleet`) and returns its parser."""
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, "
                                          "/health and /metrics.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535 (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on /v1 (default: ${API_KEY_ENV} if set)")
    g.add_argument("--served-model-name", default=None, help="model name clients must send (default: the file's)")
    g.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                   help="larger request bodies get 413")
    g.add_argument("--default-max-tokens", type=int, default=_DEFAULTS.default_max_tokens,
                   help="output cap for requests without max_tokens (never more than the context left)")
    g.add_argument("--shutdown-timeout", type=float, default=_DEFAULTS.shutdown_timeout_s,
                   help="seconds running requests may take to finish after SIGTERM")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (one that renders tools, say)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="chat completions' <think> ... </think> sent as the message's reasoning, apart from its "
                        "content (vLLM's option): qwen3 (when the output opens a thought), deepseek_r1 (the "
                        "output thinks until </think>), openai_gptoss (gpt-oss's harmony: its analysis channel)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(p)
    p.set_defaults(func=cmd_serve)
    return p


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


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's options from parsed arguments; warns on stderr of an exposed server."""
    config = ServerConfig(
        chat_template=_read_chat_template(args.chat_template),
        reasoning_parser=args.reasoning_parser,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    if (warning := exposure_warning(args.host, config.api_key)) is not None:
        print(warning, file=sys.stderr)
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    """One process: the engine and its HTTP server, until SIGTERM (drained) or Ctrl-C."""
    from inflight.config import EngineConfig
    from inflight.engine.engine import LLMEngine
    from inflight.server.launcher import make_server

    config = server_config(args)
    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **engine_options(args)))
    server = make_server(engine, config, args.host, args.port, args.log_level)
    # uvicorn re-raises the signal that stopped it once it has shut down, so that the default
    # action ends the process; after a clean drain a SIGTERM should end it with status 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
