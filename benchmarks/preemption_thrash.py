"""Preemption under KV exhaustion, with and without the thrash guard (and with admission that
reserves every request's whole length, `guaranteed_no_evict`), on the production
scheduler and block manager driven by a stand-in model (each token a function of the request
and its position, so recompute after a preemption must reproduce it exactly).

    .venv/bin/python benchmarks/preemption_thrash.py [--requests 24] [--num-blocks 64]
"""

from __future__ import annotations

import argparse
import sys

from inflight.config import SchedulerConfig
from inflight.engine.block_manager import BlockManager
from inflight.engine.scheduler import Scheduler
from inflight.request import FinishReason, Request, SamplingParams


def fake_token(request: Request) -> int:
    return hash((request.request_id, request.num_tokens)) % 1000 + 10


def run(cooldown_steps: int, args: argparse.Namespace, guaranteed: bool = False) -> dict[str, float]:
    config = SchedulerConfig(max_batch_size=16, max_num_tokens=256, max_model_len=1024,
                             preemption_cooldown_steps=cooldown_steps, guaranteed_no_evict=guaranteed)
    bm = BlockManager(args.num_blocks, args.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(config, bm)
    requests = [Request(f"r{i}", [(i * 7919 + j) % 5000 + 10 for j in range(args.prompt_len)],
                        SamplingParams(max_tokens=args.output_len, ignore_eos=True)) for i in range(args.requests)]
    for r in requests:
        scheduler.add_request(r)
    steps = computed = 0
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        steps += 1
        computed += out.num_scheduled_tokens
        sampled = {s.request.request_id: [fake_token(s.request)] for s in out.scheduled if s.samples_next_token}
        scheduler.update_from_output(out, sampled)
        for s in out.scheduled:
            if s.request.num_output_tokens >= s.request.sampling_params.max_tokens:
                scheduler.finish(s.request, FinishReason.LENGTH)
    assert bm.num_used_blocks == 0
    needed = sum(r.num_tokens - 1 for r in requests)
    return {"preemptions": scheduler.num_preemptions, "worst": max(r.num_preemptions for r in requests),
            "recomputed": computed - needed, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args()
    print(f"{args.requests} requests of {args.prompt_len}+{args.output_len} tokens, "
          f"{args.num_blocks} KV blocks of {args.block_size} tokens")
    print(f"{'preemption_cooldown_steps':<28}{'preemptions':>12}{'worst per request':>19}"
          f"{'recomputed tokens':>19}{'steps':>7}")
    for label, cooldown, guaranteed in ((0, 0, False), (8, 8, False), (32, 32, False), (128, 128, False),
                                        ("guaranteed_no_evict", 32, True)):
        f = run(cooldown, args, guaranteed)
        print(f"{label:<28}{f['preemptions']:>12}{f['worst']:>19}{f['recomputed']:>19}{f['steps']:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
