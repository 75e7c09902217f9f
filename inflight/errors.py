"""Typed errors: each carries a message fit to show a user as one line."""

from __future__ import annotations


class InflightError(Exception):
    """Base class of every error inflight raises on purpose."""


class ModelLoadError(InflightError):
    """The model could not be found, read or understood."""


class ConfigError(InflightError, ValueError):
    """An engine or request option has an invalid value."""


class InvalidRequestError(InflightError, ValueError):
    """A request can never be served as asked (too long, bad parameters). `param`: the
    `SamplingParams` field (or other request field) at fault, where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(InflightError):
    """The waiting queue is full; the caller should retry later."""


class FleetError(InflightError):
    """The fleet of replicas could not start: Ray, Ray Serve or a replica's constructor failed."""
