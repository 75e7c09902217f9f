"""Decode steps through the compiled loop over the decoder layers (`DecoderStack`) against the
model's Python loop, which calls the same kernels one by one: for each batch size, one engine
with that many requests (300-token prompts) decoding, the two ways taking turns, a median of
five steps each per round.

    .venv/bin/python benchmarks/layers_ab.py [--requests 64,16,4,1] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inflight import LLM, SamplingParams
from inflight.model.loaded import LoadedModel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="64,48,16,4,1", help="batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()

    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    model = loaded.model
    stack = model.decoder_stack
    if stack is None:
        print("the compiled layers do not serve this model here (no CPU kernels, or INFLIGHT_LINEAR)")
        return 1
    print(f"{torch.get_num_threads()} threads")
    try:
        for batch in (int(n) for n in args.requests.split(",")):
            engine = LLM(loaded=loaded, max_batch_size=max(batch, 1), max_num_tokens=2048, num_kv_blocks=2048).engine
            gen = torch.Generator().manual_seed(0)
            params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
            for _ in range(batch):
                engine.add_request(torch.randint(100, 40000, (300,), generator=gen).tolist(), params)
            while not engine.step_records or engine.step_records[-1].num_prefill_tokens:
                engine.step()
            times: dict[str, list[float]] = {"compiled": [], "python": []}
            for r in range(args.rounds):
                for way in ("compiled", "python") if r % 2 == 0 else ("python", "compiled"):
                    model.decoder_stack = stack if way == "compiled" else None
                    steps = []
                    for _ in range(5):
                        start = time.perf_counter()
                        engine.step()
                        steps.append(time.perf_counter() - start)
                    times[way].append(statistics.median(steps))
            ratios = [p / c for p, c in zip(times["python"], times["compiled"], strict=True)]
            print(f"{batch:3d} requests decoding: compiled layers "
                  f"{1000 * statistics.median(times['compiled']):6.1f} ms "
                  f"a step, Python loop {1000 * statistics.median(times['python']):6.1f} ms; compiled "
                  f"{statistics.median(ratios):.3f}x, faster in {sum(x > 1 for x in ratios)} of {args.rounds} rounds")
    finally:
        model.decoder_stack = stack
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
