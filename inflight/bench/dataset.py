"""A team's own prompts as a workload: JSONL of OpenAI requests, or ShareGPT conversations.

Formats (`format: auto` tells them apart by the first record):

- **openai**: one JSON object a line, either a request body (`{"messages": [...]}` for chat,
  `{"prompt": "..."}` for completions) or a line of an OpenAI Batch API input file (`{"custom_id":
  ..., "url": "/v1/chat/completions", "body": {...}}`). Optional per record: `max_tokens`
  (or `max_completion_tokens`, or `output_len`), the output length to force, and `timestamp`
  (seconds), its arrival time when the spec asks for the file's times.
- **sharegpt**: a JSON array (or JSONL) of `{"conversations": [{"from": "human"|"gpt"|"system",
  "value": "..."}]}`. As vLLM's and SGLang's benchmarks take it: the system turns and the first
  human turn are the prompt, the reply after it gives the output length (its tokens counted by
  the bench's tokenizer); a conversation without a human turn and a reply is skipped.

A record's prompt is replayed as text (chat messages to `/v1/chat/completions`, a prompt string to
`/v1/completions`), so the target tokenizes it itself and its `usage` gives the lengths reported.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from inflight.errors import InflightError

log = logging.getLogger(__name__)

DatasetFormat = Literal["auto", "openai", "sharegpt"]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "system": "system"}


class DatasetError(InflightError):
    """A dataset file cannot be read, or one of its records is malformed (the message says where)."""


@dataclass(frozen=True, slots=True)
class DatasetRecord:
    """One request of a dataset: `messages` (chat) or `prompt` (completions); `output_len` as the
    record states it, else `reference` (a reply whose length in tokens is the output length)."""

    where: str  # "line 7" / "record 7": where a message about it points
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    output_len: int | None = None
    reference: str | None = None
    timestamp: float | None = None


def read_dataset(path: Path, fmt: DatasetFormat = "auto") -> list[DatasetRecord]:
    """Every usable record of the file, in file order. Raises DatasetError naming the line (or
    the array's record) and the field of the first malformed one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read dataset {path}: {getattr(exc, 'strerror', None) or exc}") from None
    rows = _rows(text, path)
    if not rows:
        raise DatasetError(f"dataset {path} has no records")
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in rows[0][1] else "openai"
    parse = _sharegpt_record if fmt == "sharegpt" else _openai_record
    records, skipped = [], 0
    for where, row in rows:
        record = parse(row, where, f"dataset {path} {where}")
        if record is None:
            skipped += 1
        else:
            records.append(record)
    if skipped:
        log.warning("dataset %s: skipped %d of %d conversations without a human turn and a reply",
                    path, skipped, len(rows))
    if not records:
        raise DatasetError(f"dataset {path}: no record has a prompt and a reply")
    return records


def _rows(text: str, path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, object) for each record of a JSON array or of JSON lines (blank lines skipped)."""
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"dataset {path} line {exc.lineno}: not JSON ({exc.msg})") from None
        rows = [(f"record {i}", row) for i, row in enumerate(data, start=1)]
    else:
        rows = []
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {i}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"dataset {path} line {i}: not JSON ({exc.msg})") from None
    for where, row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"dataset {path} {where}: expected a JSON object")
    return rows


def _openai_record(row: dict[str, Any], at: str, where: str) -> DatasetRecord:
    """`at`: the record's place in its file ("line 3"); `where`: the same with the file's name."""
    body = row.get("body", row)  # a Batch API line carries the request as its body
    if not isinstance(body, dict):
        raise DatasetError(f"{where}: field 'body' must be an object")
    timestamp = _number(row.get("timestamp", body.get("timestamp")), "timestamp", where)
    output_len = None
    for name in ("max_tokens", "max_completion_tokens", "output_len"):
        if body.get(name, row.get(name)) is not None:
            output_len = _positive_int(body.get(name, row.get(name)), name, where)
            break
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise DatasetError(f"{where}: field 'messages' must be a non-empty list")
        checked = []
        for k, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise DatasetError(f"{where}: field 'messages[{k}]' needs a string 'role' and a string 'content'")
            checked.append({"role": message["role"], "content": message["content"]})
        return DatasetRecord(at, messages=tuple(checked), output_len=output_len, timestamp=timestamp)
    prompt = body.get("prompt")
    if prompt is None:
        raise DatasetError(f"{where}: needs field 'messages' (chat) or 'prompt' (completions)")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: field 'prompt' must be a non-empty string")
    return DatasetRecord(at, prompt=prompt, output_len=output_len, timestamp=timestamp)


def _sharegpt_record(row: dict[str, Any], at: str, where: str) -> DatasetRecord | None:
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise DatasetError(f"{where}: field 'conversations' must be a list")
    messages: list[dict[str, str]] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) \
                or not isinstance(turn.get("value"), str):
            raise DatasetError(f"{where}: field 'conversations[{k}]' needs a string 'from' and a string 'value'")
        role = _ROLES.get(turn["from"].lower())
        if role is None:
            raise DatasetError(f"{where}: field 'conversations[{k}].from': unknown speaker {turn['from']!r}")
        if role == "assistant":
            if any(m["role"] == "user" for m in messages):
                timestamp = _number(row.get("timestamp"), "timestamp", where)
                return DatasetRecord(at, messages=tuple(messages), reference=turn["value"], timestamp=timestamp)
            continue  # a reply before any question: not a prompt
        if role == "user" and any(m["role"] == "user" for m in messages):
            messages = [m for m in messages if m["role"] == "system"]  # two questions in a row: keep the last
        messages.append({"role": role, "content": turn["value"]})
    return None


def _number(value: Any, name: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise DatasetError(f"{where}: field '{name}' must be a number >= 0")
    return float(value)


def _positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DatasetError(f"{where}: field '{name}' must be an integer >= 1")
    return value
