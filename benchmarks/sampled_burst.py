"""A burst of sampled requests, as clients send them (temperature, top-p, a seed): generated
tokens/s and the sampler's mean time per step.

    .venv/bin/python benchmarks/sampled_burst.py [--requests 64] [--max-tokens 64] [--top-p 0.95]

To compare two trees, run it in each, alternated (`git worktree add /tmp/old REV`, then
`cd /tmp/old && PYTHONPATH=/tmp/old python /path/to/this/file`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inflight import LLM, SamplingParams
from inflight.model.loaded import LoadedModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    args = parser.parse_args()
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    llm = LLM(loaded=loaded, num_kv_blocks=2048, max_batch_size=args.requests)
    prompts = [[{"role": "user", "content": f"List cities of country number {i} as JSON, with populations."}]
               for i in range(args.requests)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=args.temperature, ignore_eos=True))  # warm-up
    llm.engine.step_records.clear()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=1,
                            ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    sample_ms = statistics.fmean(r.sample_s for r in llm.engine.step_records) * 1e3
    print(f"{args.requests} requests x {args.max_tokens} tokens, temperature {args.temperature}, top-p {args.top_p}: "
          f"{sum(len(o.token_ids) for o in outs) / wall:.1f} tok/s, sampler {sample_ms:.2f} ms/step")


if __name__ == "__main__":
    main()
