"""What every peer runner takes in and gives back, as plain JSON, so that a runner can live in
another virtual environment and run as a subprocess (`python RUNNER.py JOB.json RESULT.json`).

Standard library only: the llama.cpp and vLLM environments have nothing of inflight's.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

# Token ids small enough for any vocabulary; the warm-up runs before the clock starts.
WARMUP_PROMPT = [504, 3575, 282, 4649, 314, 260, 1345, 30]


@dataclass(frozen=True)
class PeerRequest:
    """One request of the workload: prompt token ids, the exact number of tokens to generate
    (EOS ignored), and when it arrives, in seconds after the run starts."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float


@dataclass
class PeerRecord:
    """What one request got: its tokens and when each came out (seconds after the start)."""

    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    engine: str
    wall_s: float
    records: list[PeerRecord]
    info: dict[str, Any] = field(default_factory=dict)


def warmup_requests() -> list[PeerRequest]:
    return [PeerRequest(WARMUP_PROMPT, 4, 0.0), PeerRequest(WARMUP_PROMPT[:5], 4, 0.0)]


def write_job(path: str, requests: list[PeerRequest], options: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"requests": [asdict(r) for r in requests], "options": options}, f)


def read_job(path: str) -> tuple[list[PeerRequest], dict[str, Any]]:
    with open(path) as f:
        job = json.load(f)
    return [PeerRequest(**r) for r in job["requests"]], job["options"]


def write_result(path: str, result: RunResult) -> None:
    with open(path, "w") as f:
        json.dump(asdict(result), f)


def read_result(path: str) -> RunResult:
    with open(path) as f:
        raw = json.load(f)
    records = [PeerRecord(**r) for r in raw.pop("records")]
    return RunResult(records=records, **raw)


class Clock:
    """The run's clock: seconds since `start()`, and the requests whose arrival time has come,
    in arrival order. Every runner drives its engine from one, so arrivals mean the same."""

    def __init__(self, requests: list[PeerRequest]) -> None:
        self.requests = requests
        self._pending = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival_s))
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def due(self) -> list[int]:
        """Indices of the requests that have arrived since the last call."""
        now = self.now()
        arrived = []
        while self._pending and self.requests[self._pending[0]].arrival_s <= now:
            arrived.append(self._pending.popleft())
        return arrived

    def seconds_to_next(self) -> float | None:
        """Until the next arrival; None when every request has arrived."""
        if not self._pending:
            return None
        return max(0.0, self.requests[self._pending[0]].arrival_s - self.now())

    def wait_for_next(self) -> None:
        time.sleep(self.seconds_to_next() or 0.0)

    def wall_s(self, records: list[PeerRecord]) -> float:
        """From the start to the last token of any request."""
        return max((r.token_times_s[-1] for r in records if r.token_times_s), default=self.now())
