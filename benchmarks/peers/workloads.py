"""The two workloads of the peer comparison, as token ids every engine receives unchanged.

`burst64`: 64 requests at t=0; prompts uniform in 10..301 tokens cut from real English text,
outputs uniform in 16..255 tokens, fixed (EOS ignored). The default seed puts the totals at
10,508 prompt and 9,716 output tokens, where the issue's reference workload has 10.5k / 9.7k.
`mixed`: the same requests, arriving as a Poisson process instead (`rate` per second).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from peer_protocol import PeerRequest

DEFAULT_SEED = 193
REFERENCE_NUM_REQUESTS = 64
PROMPT_LEN = (10, 301)
OUTPUT_LEN = (16, 255)
REPO = Path(__file__).resolve().parents[2]


def corpus_text() -> str:
    """The public-domain prose in inflight/data/ (or, failing that, the repo's own docs)."""
    files = sorted((REPO / "inflight" / "data").glob("*.txt"))
    if not files:
        files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def corpus_token_ids(hf_tokenizer: object) -> np.ndarray:
    ids = hf_tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    return np.asarray(ids, dtype=np.int64)


def build(name: str, corpus: np.ndarray, num_requests: int = REFERENCE_NUM_REQUESTS,
          output_scale: float = 1.0, rate: float = 2.0, seed: int = DEFAULT_SEED) -> list[PeerRequest]:
    """Lengths are drawn for at least 64 requests and the first `num_requests` kept, so a small
    smoke run is a prefix of the full workload. `output_scale` shrinks outputs (smoke runs)."""
    rng = np.random.default_rng(seed)
    num_drawn = max(num_requests, REFERENCE_NUM_REQUESTS)
    prompt_lens = rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1, size=num_drawn)[:num_requests]
    output_lens = rng.integers(OUTPUT_LEN[0], OUTPUT_LEN[1] + 1, size=num_drawn)[:num_requests]
    offsets = np.random.default_rng(seed + 1).integers(len(corpus), size=num_requests)
    if name == "burst64":
        arrivals = np.zeros(num_requests)
    elif name == "mixed":
        gaps = np.random.default_rng(seed + 2).exponential(1.0 / rate, size=num_requests)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    else:
        raise ValueError(f"unknown workload {name!r}")
    return [
        PeerRequest(
            prompt_token_ids=corpus.take(range(start, start + p), mode="wrap").tolist(),
            max_tokens=max(2, round(int(o) * output_scale)),
            arrival_s=float(t),
        )
        for start, p, o, t in zip(offsets, prompt_lens, output_lens, arrivals, strict=True)
    ]


def summary(requests: list[PeerRequest]) -> dict[str, float]:
    return {
        "num_requests": len(requests),
        "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "num_output_tokens": sum(r.max_tokens for r in requests),
        "last_arrival_s": max(r.arrival_s for r in requests),
    }
