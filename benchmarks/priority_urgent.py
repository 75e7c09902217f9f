"""Urgent requests arriving at a full batch, under FCFS and under the priority policy.

    .venv/bin/python benchmarks/priority_urgent.py [--background 64] [--urgent 8] [--background-tokens 256]

`--background` long, low-priority streams (priority 5) fill the batch (`max_batch_size` equal
to their number); once all of them decode, `--urgent` short requests (priority 0, 32 tokens)
arrive. Printed per policy: the urgent requests' time to first token (median and max) and
their end-to-end time, the background's generated tokens/s, and the preemptions. Under FCFS
(which must see priority 0 everywhere) the urgent requests wait for slots to free.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inflight import LLM, SamplingParams
from inflight.model.loaded import LoadedModel


def run(loaded: LoadedModel, policy: str, args: argparse.Namespace) -> None:
    llm = LLM(loaded=loaded, scheduling_policy=policy, max_batch_size=args.background, num_kv_blocks=4096)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    low = 5 if policy == "priority" else 0
    background = [engine.add_request(torch.randint(100, 40000, (64,), generator=gen).tolist(),
                                     SamplingParams(max_tokens=args.background_tokens, temperature=0, ignore_eos=True),
                                     priority=low)
                  for _ in range(args.background)]
    while not all(r.num_output_tokens > 0 for r in background):
        engine.step()
    start = time.perf_counter()
    before = sum(r.num_output_tokens for r in background)
    urgent = [engine.add_request(torch.randint(100, 40000, (64,), generator=gen).tolist(),
                                 SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
              for _ in range(args.urgent)]
    while not all(r.is_finished for r in urgent):
        engine.step()
    ttft = [r.timings.ttft_s for r in urgent]
    e2e = [r.timings.finished - r.timings.arrival for r in urgent]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    made = sum(r.num_output_tokens for r in background) - before
    print(f"  {policy:10s} urgent TTFT median {statistics.median(ttft):6.2f} s, max {max(ttft):6.2f} s; "
          f"end to end median {statistics.median(e2e):6.2f} s; background {made / wall:6.1f} tok/s after the "
          f"arrival; {engine.scheduler.num_preemptions} preemptions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--background", type=int, default=64)
    parser.add_argument("--urgent", type=int, default=8)
    parser.add_argument("--background-tokens", type=int, default=256)
    args = parser.parse_args()
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    print(f"{args.background} background streams of {args.background_tokens} tokens fill the batch; "
          f"{args.urgent} urgent requests of 32 tokens arrive ({torch.get_num_threads()} threads)")
    for policy in ("continuous", "priority"):
        run(loaded, policy, args)


if __name__ == "__main__":
    main()
