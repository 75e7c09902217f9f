"""Workload specs: a small seeded YAML file that fixes the traffic of a benchmark.

The same spec and seed always give the same requests: every draw comes from one private
`numpy.random.default_rng(seed)`, in a fixed order (arrivals, prompt lengths, output lengths,
shared-prefix membership, prompt text). A request is a small record: prompt token ids cut from
real text to an exact length, the number of output tokens to force (`max_tokens` with
`ignore_eos`), and its arrival offset in seconds.

    name: mixed
    seed: 0
    num_requests: 90
    arrivals: {kind: poisson, rate: 1.0}
    prompt_len: {kind: lognormal, mean: 256, std: 256, min: 16, max: 1024}
    output_len:
      kind: mixture
      components:
        - {weight: 0.85, kind: lognormal, mean: 48, std: 32, min: 4}
        - {weight: 0.15, kind: uniform, min: 192, max: 384}
    shared_prefix: {fraction: 0.9, num_tokens: 768}   # optional

A spec may instead replay a team's own prompts (`inflight.bench.dataset`): `dataset: {path:
chats.jsonl}` takes every request's prompt (and, where the file gives one, its output length)
from the file, in an order drawn with the spec's seed, arriving as `arrivals` says (or at the
file's own `timestamp`s with `timestamps: true`); `output_len`, if given, is drawn for the records
that state no length. `num_requests` defaults to the number of records (more repeats them).
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import Field, ValidationError, model_validator

from inflight.bench.corpus import Corpus
from inflight.bench.dataset import DatasetError, DatasetFormat, DatasetRecord, read_dataset
from inflight.bench.distributions import (
    Arrivals,
    BurstArrivals,
    LengthDist,
    SpecModel,
    TraceArrivals,
)
from inflight.errors import InflightError


class WorkloadError(InflightError):
    """A workload spec or trace file is missing or invalid."""


class SharedPrefix(SpecModel):
    """A share of requests start with a system prompt of `num_tokens` tokens; for them
    `prompt_len` is the length of the part after it. With `num_prompts` > 1 there are that many
    distinct system prompts, each request drawn to one of them at random (what a fleet's
    prefix-aware router is for)."""

    fraction: float = Field(ge=0, le=1)
    num_tokens: int = Field(ge=1)
    num_prompts: int = Field(1, ge=1)


class PriorityClass(SpecModel):
    """A share of the requests sent with this `priority` (lower is more urgent)."""

    priority: int = Field(ge=-(2**31), le=2**31 - 1)
    share: float = Field(gt=0, le=1)


class DatasetSource(SpecModel):
    """Prompts replayed from a file (`inflight.bench.dataset`); a relative path is taken from the
    spec file's folder."""

    path: str
    format: DatasetFormat = "auto"
    timestamps: bool = Field(False, description="arrive at the records' own timestamps, not the spec's arrivals")


class WorkloadSpec(SpecModel):
    name: str
    description: str = ""
    seed: int = 0
    num_requests: int | None = Field(None, ge=1, description="required unless arrivals is a trace")
    arrivals: Arrivals = Field(default_factory=lambda: BurstArrivals(kind="burst"))
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    shared_prefix: SharedPrefix | None = None
    # Priority classes (their shares summing to 1), each request drawn into one; none: all at 0.
    priorities: list[PriorityClass] | None = Field(None, min_length=1)
    dataset: DatasetSource | None = None
    # Tasks on text of the request's own prompt (copy, edit, continue: what speculative decoding's
    # proposals from the prompt are for): each request takes one (by the seed), its "{text}" filled
    # with prompt_len tokens of the corpus.
    templates: list[str] | None = Field(None, min_length=1)
    # For the simulator's speculative decoding: the chance that a proposed token is kept once those
    # before it were (a property of the workload and the proposer; `inflight bench` measures it).
    acceptance_rate: float | None = Field(None, ge=0, le=1)
    # And the chance that a decoding request's proposer finds a proposal in its own tokens at a step
    # (the text repeats itself there; 1 if unset: always). `inflight bench` measures it too.
    proposal_rate: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _check_sources(self) -> WorkloadSpec:
        if self.priorities is not None:
            total = sum(c.share for c in self.priorities)
            if abs(total - 1) > 1e-6:
                raise ValueError(f"priorities: the shares must sum to 1, got {total:g}")
            if len({c.priority for c in self.priorities}) < len(self.priorities):
                raise ValueError("priorities: each priority once")
        if self.templates is not None and not all("{text}" in t for t in self.templates):
            raise ValueError("templates: each needs a {text} where the corpus passage goes")
        if self.dataset is not None:
            clash = [k for k in ("prompt_len", "shared_prefix", "templates") if getattr(self, k) is not None]
            if clash or isinstance(self.arrivals, TraceArrivals):
                raise ValueError(f"a dataset gives its own prompts; remove {', '.join(clash) or 'the trace arrivals'}")
            return self
        if isinstance(self.arrivals, TraceArrivals):
            if self.prompt_len is not None or self.output_len is not None:
                raise ValueError("a trace gives its own prompt_len and output_len; remove them from the spec")
            return self
        missing = [k for k in ("num_requests", "prompt_len", "output_len") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (needed unless arrivals is a trace)")
        return self

    @property
    def sha256(self) -> str:
        """Fingerprint of the traffic: equal specs (seed included) give equal requests. A dataset
        counts by its contents, not its path (when the file can be read from here)."""
        data = self.model_dump(mode="json")
        if self.dataset is not None:
            try:
                data["dataset"]["path"] = hashlib.sha256(Path(self.dataset.path).read_bytes()).hexdigest()
            except OSError:
                pass
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    prompt: str
    output_len: int
    arrival_s: float
    has_shared_prefix: bool = False
    priority: int = 0
    # A dataset's request goes out as text (its `prompt`, or these chat messages), for the
    # target to tokenize; `prompt_token_ids` are then the bench tokenizer's reading of it.
    messages: tuple[dict[str, str], ...] | None = None
    send_text: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# --- loading ------------------------------------------------------------------------------------


def canonical_specs() -> dict[str, Path]:
    folder = resources.files("inflight.bench") / "specs"
    return {Path(f.name).stem: Path(str(f)) for f in folder.iterdir()
            if f.name.endswith(".yaml") and f.name != "sla.yaml"}


def load_workload(name_or_path: str, **overrides: Any) -> tuple[WorkloadSpec, Path]:
    """A canonical spec by name (`mixed`) or a YAML file by path; `overrides` replace top-level
    fields (`seed=1`, `num_requests=10`). Raises WorkloadError with a one-line message."""
    canonical = canonical_specs()
    path = canonical.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise WorkloadError(f"no workload {name_or_path!r}: give one of {', '.join(sorted(canonical))} "
                            "or the path of a YAML spec")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise WorkloadError(f"cannot read workload spec {path}: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise WorkloadError(f"workload spec {path}: expected a mapping of fields at the top level")
    data.setdefault("name", path.stem)
    data.update({k: v for k, v in overrides.items() if v is not None})
    dataset = data.get("dataset")
    if isinstance(dataset, dict) and isinstance(dataset.get("path"), str):  # from the spec's folder
        data["dataset"] = {**dataset, "path": str((path.parent / dataset["path"]).resolve())}
    return parse_workload(data, source=str(path)), path


def dataset_workload(dataset: str, **overrides: Any) -> tuple[WorkloadSpec, Path]:
    """The workload of `--dataset FILE` without a spec: every record once, all at t=0 unless
    overridden (`num_requests`, `seed`, a rate)."""
    path = Path(dataset).resolve()
    data: dict[str, Any] = {"name": path.stem, "dataset": {"path": str(path)}}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_workload(data, source=dataset), path


def parse_workload(data: dict[str, Any], source: str = "workload spec") -> WorkloadSpec:
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(f"{source}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


# --- generation ---------------------------------------------------------------------------------


def generate_requests(spec: WorkloadSpec, corpus: Corpus, base_dir: Path | None = None) -> list[BenchRequest]:
    """The spec's requests, in arrival order. `base_dir` resolves a relative trace path."""
    rng = np.random.default_rng(spec.seed)
    if spec.dataset is not None:
        return _dataset_requests(spec, spec.dataset, corpus, base_dir, rng)
    if isinstance(spec.arrivals, TraceArrivals):
        offsets, prompt_lens, output_lens = read_trace(spec.arrivals, base_dir, spec.num_requests)
    else:
        assert spec.num_requests and spec.prompt_len and spec.output_len  # checked by the model
        n = spec.num_requests
        offsets = spec.arrivals.offsets(rng, n)
        prompt_lens = spec.prompt_len.sample(rng, n)
        output_lens = spec.output_len.sample(rng, n)
    n = len(offsets)
    prefix = spec.shared_prefix
    with_prefix = rng.random(n) < prefix.fraction if prefix else np.zeros(n, dtype=bool)
    prefixes = [corpus.take(rng, prefix.num_tokens)] if prefix else [[]]
    which = np.zeros(n, dtype=int)
    if prefix and prefix.num_prompts > 1:  # a stream of their own: one prompt leaves the draws as they were
        extra = np.random.default_rng([spec.seed, 2])
        prefixes += [corpus.take(extra, prefix.num_tokens) for _ in range(prefix.num_prompts - 1)]
        which = extra.integers(0, prefix.num_prompts, size=n)
    # Classes from a stream of their own, so that adding them leaves lengths and arrivals as they were.
    priorities = [0] * n
    if spec.priorities:
        classes = np.random.default_rng([spec.seed, 1]).choice(
            len(spec.priorities), size=n, p=[c.share for c in spec.priorities])
        priorities = [spec.priorities[int(k)].priority for k in classes]
    tasks = (np.random.default_rng([spec.seed, 3]).integers(0, len(spec.templates), size=n)
             if spec.templates else np.zeros(n, dtype=int))
    requests = []
    for i in range(n):
        passage = corpus.take(rng, int(prompt_lens[i]))
        if spec.templates:
            pieces = spec.templates[int(tasks[i])].split("{text}")
            filled = corpus.encode(pieces[0])
            for piece in pieces[1:]:
                filled += passage + corpus.encode(piece)
            passage = filled
        ids = (prefixes[which[i]] if with_prefix[i] else []) + passage
        requests.append(BenchRequest(i, ids, corpus.decode(ids), int(output_lens[i]),
                                     float(offsets[i]), bool(with_prefix[i]), priorities[i]))
    return requests


def _dataset_requests(spec: WorkloadSpec, source: DatasetSource, corpus: Corpus, base_dir: Path | None,
                      rng: np.random.Generator) -> list[BenchRequest]:
    """Requests replayed from a dataset: the records in an order drawn from the spec's seed
    (or by their timestamps), each prompt counted by the bench's tokenizer (the chat template for
    messages), each output length as the record states it, or its reference reply's token count,
    or drawn from the spec's `output_len`."""
    path = Path(source.path)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        records = read_dataset(path, source.format)
    except DatasetError as exc:
        raise WorkloadError(str(exc)) from None
    n = spec.num_requests or len(records)
    if source.timestamps:
        untimed = next((r for r in records if r.timestamp is None), None)
        if untimed is not None:
            raise WorkloadError(f"dataset {path} {untimed.where}: no field 'timestamp' (timestamps: true)")
        chosen = sorted(records, key=lambda r: r.timestamp or 0.0)
        chosen = [chosen[i % len(chosen)] for i in range(n)]
        first = chosen[0].timestamp or 0.0
        span = (chosen[-1].timestamp or 0.0) - first + 1.0  # a repeat comes a second after the last
        offsets = np.array([(r.timestamp or 0.0) - first + span * (i // len(records)) for i, r in enumerate(chosen)])
    else:
        order = np.concatenate([rng.permutation(len(records)) for _ in range(-(-n // len(records)))])[:n]
        chosen = [records[int(i)] for i in order]
        assert not isinstance(spec.arrivals, TraceArrivals)  # refused beside a dataset
        offsets = spec.arrivals.offsets(rng, n)
    drawn = spec.output_len.sample(rng, n) if spec.output_len is not None else None
    tokenizer = getattr(corpus, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "encode"):
        raise WorkloadError("a dataset's prompts are counted with the model's tokenizer, and the simulator has "
                            "none: give it a spec with prompt_len and output_len")
    requests = []
    for i, record in enumerate(chosen):
        ids = _record_token_ids(record, tokenizer, path)
        if record.output_len is not None:
            output_len = record.output_len
        elif record.reference is not None:
            output_len = max(1, len(tokenizer.encode(record.reference, add_special_tokens=False)))
        elif drawn is not None:
            output_len = int(drawn[i])
        else:
            raise WorkloadError(f"dataset {path} {record.where}: no field 'max_tokens', and the spec has no "
                                "output_len to draw one from")
        requests.append(BenchRequest(i, ids, record.prompt or "", output_len, float(offsets[i]),
                                     messages=record.messages, send_text=True))
    return requests


def _record_token_ids(record: DatasetRecord, tokenizer: Any, path: Path) -> list[int]:
    if record.messages is None:
        return list(tokenizer.encode(record.prompt or ""))
    if not hasattr(tokenizer, "apply_chat_template"):
        raise WorkloadError(f"dataset {path}: chat records need the model's chat template to count their tokens")
    try:
        return list(tokenizer.apply_chat_template(list(record.messages)))
    except InflightError as exc:
        raise WorkloadError(f"dataset {path} {record.where}: {exc}") from None


def read_trace(trace: TraceArrivals, base_dir: Path | None,
               limit: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, prompt lengths, output lengths) of a CSV or JSONL trace, sorted by time."""
    path = Path(trace.path)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if path.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(text, path)
    else:
        rows = list(csv.DictReader(text.splitlines()))
    parsed = [_trace_row(row, i + 2 if path.suffix not in (".jsonl", ".json") else i + 1, path)
              for i, row in enumerate(rows)]
    if not parsed:
        raise WorkloadError(f"trace {path} has no rows")
    parsed.sort(key=lambda r: r[0])
    parsed = parsed[:limit] if limit else parsed
    times, prompt_lens, output_lens = (np.array(col) for col in zip(*parsed, strict=True))
    return (times - times[0]) * trace.time_scale, prompt_lens.astype(np.int64), output_lens.astype(np.int64)


def _jsonl_rows(text: str, path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"trace {path} line {i}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"trace {path} line {i}: expected an object")
        rows.append(row)
    return rows


def _trace_row(row: dict[str, Any], line: int, path: Path) -> tuple[float, int, int]:
    try:
        t, p, o = float(row["timestamp"]), int(row["prompt_len"]), int(row["output_len"])
    except KeyError as exc:
        raise WorkloadError(f"trace {path} line {line}: missing column {exc.args[0]!r} "
                            "(need timestamp, prompt_len, output_len)") from None
    except (TypeError, ValueError):
        raise WorkloadError(f"trace {path} line {line}: timestamp must be a number and "
                            "prompt_len, output_len integers") from None
    if t < 0 or p < 1 or o < 1:
        raise WorkloadError(f"trace {path} line {line}: need timestamp >= 0, prompt_len >= 1, output_len >= 1")
    return t, p, o


def with_request_rate(spec: WorkloadSpec, rate: float) -> WorkloadSpec:
    """The spec with another arrival rate: `inf` makes a burst, a number on a burst makes Poisson
    arrivals, a gamma process keeps its burstiness."""
    arrivals = spec.arrivals
    if isinstance(arrivals, TraceArrivals) or (spec.dataset is not None and spec.dataset.timestamps):
        raise WorkloadError("a trace fixes its own arrival times; --request-rate does not apply")
    if rate == float("inf"):
        new: dict[str, Any] = {"kind": "burst"}
    elif isinstance(arrivals, BurstArrivals):
        new = {"kind": "poisson", "rate": rate}
    else:
        new = {**arrivals.model_dump(), "rate": rate}
    return parse_workload({**spec.model_dump(), "arrivals": new}, source=f"workload {spec.name}")
