"""KV blocks and prefill work of n samples of one prompt against n separate requests for it.

    .venv/bin/python benchmarks/parallel_sampling.py [--n 8] [--prompt-len 512] [--max-tokens 64]

With `n`, the prompt is prefilled once and its KV blocks are forked (each sample computes only
the prompt's last token itself, into a private copy of the last block); the separate requests,
sent together, each prefill the whole prompt (with prefix caching on, they arrive in one step,
before any of their blocks is cached). Figures: peak KV blocks in use, prefill tokens computed,
wall time.
"""

from __future__ import annotations

import argparse
import time

import torch

from inflight import LLM, SamplingParams
from inflight.model.loaded import LoadedModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{args.n} samples of a {args.prompt_len}-token prompt, {args.max_tokens} tokens each, 16-token blocks")
    for label, prompts, params in (
        ("n samples", [prompt], [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, n=args.n,
                                                ignore_eos=True)]),
        ("separate requests", [prompt] * args.n, [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=s,
                                                                 ignore_eos=True) for s in range(args.n)]),
    ):
        llm = LLM(loaded=loaded, num_kv_blocks=4096, max_batch_size=64, max_num_tokens=8192)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        engine = llm.engine
        prefill = sum(r.num_prefill_tokens for r in engine.step_records)
        assert len(outs) == args.n and engine.block_manager.num_used_blocks == 0
        print(f"  {label:18s} peak {engine.block_manager.peak_used_blocks:4d} KV blocks, "
              f"{prefill:5d} prefill tokens, {wall:5.1f} s")


if __name__ == "__main__":
    main()
