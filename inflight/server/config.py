"""The HTTP server's own options (the engine's are in `inflight.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from inflight.errors import ConfigError
from inflight.server.reasoning import REASONING_PARSERS


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class ServerConfig:
    """`served_model_name` defaults to the engine's model name. `default_max_tokens` caps the
    output of a request that gives no max_tokens (it also never exceeds the context left).
    `chat_template` replaces the model's chat template (the text of one, not a path)."""

    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    shutdown_timeout_s: float = 30.0
    # A Jinja chat template used instead of the model's own (vLLM's --chat-template).
    chat_template: str | None = None
    # Chat completions' thinking split from the answer (vLLM's --reasoning-parser; server/reasoning.py).
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        _require(self.api_key is None or bool(self.api_key), "api_key must not be empty")
        _require(self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        _require(self.default_max_tokens >= 1, f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        _require(self.shutdown_timeout_s >= 0, f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        _require(self.chat_template is None or bool(self.chat_template.strip()), "chat_template must not be empty")
        _require(self.reasoning_parser in (None, *REASONING_PARSERS),
                 f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
