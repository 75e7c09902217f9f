"""The engine's command-line options, made from one source: the fields of the config dataclasses
that carry help text (`inflight.config.option`). Every CLI that runs an engine (`generate`,
`serve`, `bench`, `sim`, `tune`) adds them with `add_engine_options` and reads them back with
`engine_options`, so a new config field is a new flag everywhere at once."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any

from inflight.config import CacheConfig, EngineConfig, SchedulerConfig

ENGINE_SECTIONS: tuple[type, ...] = (EngineConfig, SchedulerConfig, CacheConfig)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_option_fields() -> list[tuple[dataclasses.Field[Any], type]]:
    """Each engine option's field and its value type (`int` for `int | None`), in CLI order."""
    found = []
    for section in ENGINE_SECTIONS:
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if "help" in f.metadata:
                found.append((f, _value_type(hints[f.name])))
    return found


def engine_option_names() -> set[str]:
    return {f.name for f, _ in engine_option_fields()}


def _value_type(hint: Any) -> type:
    """The command line's type: the hint itself, or the first type of a union other than None
    (`str | dict[str, Any] | None`: text on the command line, a mapping from Python too)."""
    if isinstance(hint, types.UnionType):
        kind: type = next(a for a in typing.get_args(hint) if a is not type(None))
        return kind
    return hint


def add_engine_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Adds every engine option to `parser` (group "engine"), defaults as the configs' own."""
    group = parser.add_argument_group("engine")
    for f, kind in engine_option_fields():
        extra = {k: v for k, v in f.metadata.items() if k != "help"}
        help_text = f.metadata["help"]
        if kind is bool:
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        if issubclass(kind, enum.Enum):
            extra.setdefault("choices", [member.value for member in kind])
            kind, default = str, f.default.value
        else:
            default = f.default
        group.add_argument(flag(f.name), type=kind, default=default, help=help_text, **extra)
    group.add_argument("--slo-from", default=None, metavar="SLA_FILE",
                       help="slo policy: take the targets from an `inflight check` SLA file (its goodput: "
                            "max_ttft_ms and max_tpot_ms, else max_ttft_p99_ms and max_tbt_p99_ms)")
    return group


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's keyword options (as `LLM(**options)` and `EngineConfig.from_kwargs` take
    them) from parsed arguments: every option with a value, `model` apart. `--slo-from` is read
    into `ttft_slo_ms` and `tbt_slo_ms` by the top-level CLI before a command runs."""
    options = {f.name: getattr(args, f.name) for f, _ in engine_option_fields() if f.name != "model"}
    return {name: value for name, value in options.items() if value is not None}
