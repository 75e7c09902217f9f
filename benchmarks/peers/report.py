"""Per-engine figures from per-request timings, and the one fixed-width table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from peer_protocol import PeerRequest, RunResult


@dataclass(frozen=True)
class Metrics:
    wall_s: float
    num_generated: int
    gen_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    num_wrong_length: int  # requests that did not get exactly max_tokens tokens
    # Mean share of each output equal to the reference's, up to the first difference.
    same_as_reference: float | None


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def metrics(requests: list[PeerRequest], result: RunResult, reference: RunResult | None) -> Metrics:
    records = result.records
    ttfts = [r.token_times_s[0] - r.arrival_s for r in records if r.token_times_s]
    gaps = [b - a for r in records for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False)]
    num_generated = sum(len(r.token_ids) for r in records)
    same = None
    if reference is not None:
        same = float(np.mean([
            common_prefix(r.token_ids, ref.token_ids) / max(1, q.max_tokens)
            for q, r, ref in zip(requests, records, reference.records, strict=True)
        ]))
    return Metrics(
        wall_s=result.wall_s,
        num_generated=num_generated,
        gen_tok_s=num_generated / result.wall_s if result.wall_s > 0 else float("nan"),
        ttft_p50_s=_pct(ttfts, 50),
        ttft_p99_s=_pct(ttfts, 99),
        tbt_p50_s=_pct(gaps, 50),
        tbt_p99_s=_pct(gaps, 99),
        num_wrong_length=sum(len(r.token_ids) != q.max_tokens
                             for q, r in zip(requests, records, strict=True)),
        same_as_reference=same,
    )


def per_request(requests: list[PeerRequest], result: RunResult,
                reference: RunResult | None) -> list[dict[str, Any]]:
    rows = []
    for i, (q, r) in enumerate(zip(requests, result.records, strict=True)):
        times = r.token_times_s
        rows.append({
            "prompt_len": len(q.prompt_token_ids),
            "max_tokens": q.max_tokens,
            "arrival_s": q.arrival_s,
            "num_generated": len(r.token_ids),
            "ttft_s": times[0] - q.arrival_s if times else None,
            "e2e_s": times[-1] - q.arrival_s if times else None,
            "max_tbt_s": max((b - a for a, b in zip(times, times[1:], strict=False)), default=None),
            "same_prefix": None if reference is None
            else common_prefix(r.token_ids, reference.records[i].token_ids),
        })
    return rows


HEADER = (f"{'workload':<9} {'engine':<34} {'wall s':>8} {'gen tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TBT p99':>8} {'vs (a)':>7} {'ceiling':>8} {'same':>5}")


def table_row(workload: str, label: str, m: Metrics | None, status: str,
              ref_tok_s: float | None, ceiling_tok_s: float) -> str:
    if m is None:
        return f"{workload:<9} {label:<34} {status}"
    ratio = f"{m.gen_tok_s / ref_tok_s:.2f}x" if ref_tok_s else "-"
    same = "-" if m.same_as_reference is None else f"{100 * m.same_as_reference:.0f}%"
    flag = "" if m.num_wrong_length == 0 else f"  ({m.num_wrong_length} requests of the wrong length!)"
    return (f"{workload:<9} {label:<34} {m.wall_s:>8.1f} {m.gen_tok_s:>9.1f} {m.ttft_p50_s:>8.2f}s "
            f"{m.ttft_p99_s:>8.2f}s {1000 * m.tbt_p99_s:>6.0f}ms {ratio:>7} "
            f"{100 * m.gen_tok_s / ceiling_tok_s:>7.1f}% {same:>5}{flag}")
