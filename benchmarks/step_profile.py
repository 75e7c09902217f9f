"""Where inflight's step time goes on the burst of 64: scheduling, building inputs, the forward
pass, sampling and output processing, from the engine's own per-step records, plus an optional
torch.profiler table of one decode step with 64 requests.

    .venv/bin/python benchmarks/step_profile.py [--max-num-tokens 512] [--torch-profile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from workloads import build, corpus_token_ids  # noqa: E402

from inflight import LLM, SamplingParams  # noqa: E402
from inflight.model.loaded import LoadedModel  # noqa: E402

PHASES = ("schedule_s", "prepare_s", "forward_s", "sample_s", "process_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--torch-profile", action="store_true", help="also profile one 64-request decode step")
    args = parser.parse_args()

    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    requests = build("burst64", corpus_token_ids(loaded.tokenizer.hf), num_requests=args.requests)
    llm = LLM(loaded=loaded, max_batch_size=64, max_num_tokens=args.max_num_tokens, num_kv_blocks=2048)
    engine = llm.engine
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    engine.step_records.clear()
    for r in requests:
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    profiled = None
    while engine.has_unfinished():
        if args.torch_profile and profiled is None and engine.num_running >= 64 and not engine.num_waiting:
            from torch.profiler import profile

            with profile() as profiled:
                engine.step()
            continue
        engine.step()
    wall = time.perf_counter() - start
    steps = list(engine.step_records)
    generated = sum(s.num_decode_tokens for s in steps) + len(requests)
    print(f"{len(requests)} requests, {len(steps)} steps, {wall:.1f} s, {generated / wall:.1f} generated tok/s "
          f"(max_num_tokens={args.max_num_tokens}, {torch.get_num_threads()} threads)")
    groups = {
        "all steps": steps,
        "decode-only, >= 60 requests": [s for s in steps if s.num_prefill_tokens == 0 and s.num_requests >= 60],
        "decode-only, 1 request": [s for s in steps if s.num_prefill_tokens == 0 and s.num_requests == 1],
        "mixed prefill + decode": [s for s in steps if s.num_prefill_tokens and s.num_decode_tokens],
    }
    print(f"{'steps':<30}{'n':>6}{'step ms':>9}" + "".join(f"{p[:-2]:>10}" for p in PHASES) + f"{'sched+prep':>12}")
    for name, group in groups.items():
        if not group:
            continue
        total = sum(s.duration_s for s in group)
        shares = [sum(getattr(s, p) for s in group) / total for p in PHASES]
        print(f"{name:<30}{len(group):>6}{1000 * total / len(group):>9.1f}"
              + "".join(f"{100 * x:>9.1f}%" for x in shares) + f"{100 * (shares[0] + shares[1]):>11.1f}%")
    if profiled is not None:
        print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    decode = groups["decode-only, >= 60 requests"]
    if decode:
        print(f"decode step p50 {1000 * np.median([s.duration_s for s in decode]):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
