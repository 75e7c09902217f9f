"""The bench's workload specs, with synthetic prompt token ids: the simulator needs only the
lengths, arrival times and which requests share the spec's prefix, and those come from the same
seeded draws as `inflight bench` makes, so both run the same traffic."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from inflight.bench.workload import BenchRequest, WorkloadSpec, generate_requests

# Distinct ids, so prompts share full KV blocks only where the spec shares a prefix.
_NUM_SYNTHETIC_IDS = 1 << 24


class SyntheticCorpus:
    """Stands in for `inflight.bench.corpus.Corpus`: `take` makes one draw from the rng, as the
    real corpus does, and returns a run of consecutive ids from that offset."""

    def take(self, rng: np.random.Generator, num_tokens: int) -> list[int]:
        start = int(rng.integers(_NUM_SYNTHETIC_IDS))
        return [(start + i) % _NUM_SYNTHETIC_IDS for i in range(num_tokens)]

    def decode(self, token_ids: list[int]) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        """A template's own text: a token per 4 characters (English prose's rate), the same ids
        for the same text, above the passages' range."""
        start = _NUM_SYNTHETIC_IDS + zlib.crc32(text.encode()) % _NUM_SYNTHETIC_IDS
        return [start + i for i in range(-(-len(text) // 4))]


def synthetic_requests(spec: WorkloadSpec, base_dir: Path | None = None) -> list[BenchRequest]:
    """The spec's requests (lengths, arrivals, shared prefix) with synthetic token ids."""
    return generate_requests(spec, SyntheticCorpus(), base_dir)  # type: ignore[arg-type]
