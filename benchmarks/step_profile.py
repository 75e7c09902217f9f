"""Where inflight's step time goes on the burst of 64: scheduling, building inputs, the forward
pass, sampling and output processing, from the engine's own per-step records; the weight-matmul
rate of the decode-only steps against an fp32 GEMM peak timed in the same run; a single stream
alone (one request, a 300-token prompt, 64 decode steps); the steps grouped by size, each
group's time against the ceiling's; and, with `--components`, the forward pass of one 64-request
decode step, one prefill step and one single-request decode step split into weight matmuls (by
output width), attention and token-wise ops (torch.profiler ranges; those three steps are left
out of the per-step figures). `--verify` adds the same split of a speculative verify: a single
stream copying its prompt's passage with n-gram proposals (k = 4, or `--verify-k`, all verified),
one step that verifies k proposed tokens beside one plain decode step of the same stream without
speculation.

    .venv/bin/python benchmarks/step_profile.py [--max-num-tokens 512] [--components] [--verify [--verify-k 4]]
        [--quantization int8] [--kv-cache-dtype float16]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import ceiling  # noqa: E402
from workloads import build, corpus_token_ids  # noqa: E402

from inflight import LLM, SamplingParams  # noqa: E402
from inflight.model import linear  # noqa: E402
from inflight.model.loaded import LoadedModel  # noqa: E402

PHASES = ("schedule_s", "prepare_s", "forward_s", "sample_s", "process_s")


def instrument(loaded: LoadedModel) -> None:
    """Wraps the model's components in profiler ranges (a few microseconds each)."""
    from torch.profiler import record_function

    def wrap(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        setattr(obj, name, timed)

    model = loaded.model
    for op in ("rms_norm", "add_rms_norm_", "rotary", "silu_and_mul"):
        wrap(model.ops, op, f"token ops: {op}")
    wrap(model.attention, "forward", "attention")
    call: Callable[..., torch.Tensor] = linear.Linear.__call__

    def linear_call(self: linear.Linear, x: torch.Tensor) -> torch.Tensor:
        with record_function(f"matmul -> {self.out_features}"):
            return call(self, x)

    linear.Linear.__call__ = linear_call  # type: ignore[method-assign]


def print_components(title: str, prof: Any, step: Any) -> None:
    rows = [(e.key, e.cpu_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.key.startswith(("token ops", "matmul", "attention"))]
    forward_ms = 1000 * step.forward_s
    print(f"\n{title}: {step.num_decode_tokens} decodes + {step.num_prefill_tokens} prefill tokens, "
          f"step {1000 * step.duration_s:.1f} ms, forward {forward_ms:.1f} ms")
    for key, ms, count in sorted(rows, key=lambda r: -r[1]):
        print(f"  {key:<28}{ms:>8.2f} ms  {100 * ms / forward_ms:>5.1f}%  x{count}")
    rest = forward_ms - sum(ms for _, ms, _ in rows)
    print(f"  {'rest of the forward pass':<28}{rest:>8.2f} ms  {100 * rest / forward_ms:>5.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--components", action="store_true",
                        help="also split one 64-request decode step, one prefill step and one "
                             "single-request decode step into components")
    parser.add_argument("--verify", action="store_true",
                        help="also split a single stream's step verifying 4 proposed tokens, beside a plain one")
    parser.add_argument("--verify-k", type=int, default=4, help="the proposed tokens that step verifies")
    parser.add_argument("--quantization", default="none",
                        choices=("none", "int8", "int8-activations", "bf16-activations"),
                        help="the weights' arithmetic (default: as stored, fp32)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="the KV pool's element type (default: the model's, fp32)")
    args = parser.parse_args()

    gemm = ceiling.measure_gemm(reps=5)
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"), quantization=args.quantization)
    if args.components or args.verify:
        instrument(loaded)
    requests = build("burst64", corpus_token_ids(loaded.tokenizer.hf), num_requests=args.requests)
    llm = LLM(loaded=loaded, quantization=args.quantization, max_batch_size=64, max_num_tokens=args.max_num_tokens,
              num_kv_blocks=2048, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    engine.step_records.clear()
    for r in requests:
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    profiles: dict[str, tuple[Any, Any]] = {}
    while engine.has_unfinished():
        want = None
        if args.components:
            if "prefill" not in profiles and engine.num_waiting and engine.num_running >= 16:
                want = "prefill"
            elif "decode" not in profiles and engine.num_running >= 64 and not engine.num_waiting:
                want = "decode"
            elif "single-request decode" not in profiles and engine.num_running == 1 and not engine.num_waiting:
                want = "single-request decode"
        if want is None:
            engine.step()
            continue
        from torch.profiler import profile

        with profile() as prof:
            engine.step()
        profiles[want] = (prof, engine.step_records[-1])
    wall = time.perf_counter() - start
    profiled = {id(step) for _, step in profiles.values()}  # slowed by the profiler: left out below
    steps = [s for s in engine.step_records if id(s) not in profiled]
    generated = sum(s.num_decode_tokens for s in engine.step_records) + len(requests)
    print(f"{len(requests)} requests, {len(engine.step_records)} steps, {wall:.1f} s, "
          f"{generated / wall:.1f} generated tok/s "
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
    decode = groups["decode-only, >= 60 requests"]
    if decode:
        cfg = loaded.model.config
        flop = ceiling.workload_flop(cfg, [])
        per_token = 2 * (flop["body_params"] + flop["lm_head_params"])
        rate = sum(per_token * s.num_decode_tokens for s in decode) / sum(s.duration_s for s in decode) / 1e9
        print(f"decode-only steps with >= 60 requests: p50 {1000 * np.median([s.duration_s for s in decode]):.1f} ms; "
              f"weight matmuls at {rate:.0f} GFLOP/s over the whole step = {100 * rate / gemm['peak_gflops']:.0f}% "
              f"of the GEMM peak timed in this run ({gemm['peak_gflops']:.0f} GFLOP/s)")
    by_size(steps, loaded.model.config, max(gemm["peak_gflops"], ceiling.measure_gemm(reps=5)["peak_gflops"]))
    single = groups["decode-only, 1 request"]
    if single:
        print(f"decode-only steps with 1 request: p50 {1000 * np.median([s.duration_s for s in single]):.1f} ms "
              f"= {1 / np.median([s.duration_s for s in single]):.0f} tok/s for a single stream")
    single_stream(engine, corpus_token_ids(loaded.tokenizer.hf))
    for name, (prof, step) in profiles.items():
        print_components(f"one {name} step", prof, step)
    if args.verify:
        verify_components(loaded, args.quantization, corpus_token_ids(loaded.tokenizer.hf), args.verify_k)
    return 0


def verify_components(loaded: LoadedModel, quantization: str, corpus: np.ndarray, k: int = 4) -> None:
    """A single stream asked to copy a passage of its prompt: one step verifying k n-gram
    proposals, and one plain decode step of the same request without speculation, each split
    into components (the stream's first step of each kind past 32 generated tokens)."""
    from torch.profiler import profile

    passage = corpus[:200].tolist()
    prompt = passage + passage[:40]  # the model goes on copying: the n-gram lookup proposes the rest
    ngram = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
    for title, spec in (("plain decode", None), (f"verifying {k} proposed tokens", ngram)):
        llm = LLM(loaded=loaded, quantization=quantization, num_kv_blocks=256,
                  **({"speculative_config": spec} if spec else {}))
        engine = llm.engine
        engine.add_request(prompt, SamplingParams(max_tokens=96, temperature=0, ignore_eos=True))
        found = None
        while engine.has_unfinished():
            generated = sum(s.num_decode_tokens + s.num_accepted_tokens for s in engine.step_records)
            if found is None and generated >= 32:
                with profile() as prof:
                    engine.step()
                step = engine.step_records[-1]
                if step.num_spec_tokens == (k if spec else 0):
                    found = (prof, step)
            else:
                engine.step()
        if found is None:
            print(f"\na single stream's step {title}: none seen (the stream stopped copying)")
            continue
        print_components(f"a single stream's step {title} (context {found[1].work[0].context_len})", *found)


def by_size(steps: list[Any], config: Any, peak_gflops: float) -> None:
    """The burst's steps grouped by size, each group's time against the ceiling's time for the
    same tokens (their weight-matmul FLOPs at the GEMM peak, the higher of those timed before
    and after the burst, as peers.py takes it)."""
    flop = ceiling.workload_flop(config, [])
    groups: dict[str, list[float]] = {}
    for s in steps:
        n = s.num_decode_tokens
        name = ("with prefill" if s.num_prefill_tokens else "decode, 60+ requests" if n >= 60 else
                "decode, 32-59" if n >= 32 else "decode, 16-31" if n >= 16 else
                "decode, 4-15" if n >= 4 else "decode, 1-3")
        ideal = (2 * (flop["body_params"] * (s.num_prefill_tokens + n) + flop["lm_head_params"] * n)
                 / (peak_gflops * 1e9))
        group = groups.setdefault(name, [0, 0.0, 0.0])
        group[0] += 1
        group[1] += s.duration_s
        group[2] += ideal
    print(f"\nsteps by size against the ceiling (GEMM peak {peak_gflops:.0f} GFLOP/s)")
    print(f"{'steps':<24}{'n':>5}{'time s':>9}{'ceiling s':>11}{'share':>7}")
    for name, (n, seconds, ideal) in groups.items():
        print(f"{name:<24}{n:>5}{seconds:>9.2f}{ideal:>11.2f}{ideal / seconds:>7.2f}")
    total, ideal = sum(g[1] for g in groups.values()), sum(g[2] for g in groups.values())
    print(f"{'all':<24}{sum(g[0] for g in groups.values()):>5}{total:>9.2f}{ideal:>11.2f}{ideal / total:>7.2f}\n")


def single_stream(engine: Any, corpus: np.ndarray, prompt_len: int = 300, decode_steps: int = 64) -> None:
    """One request alone on the engine, as a single user's stream: the p50 of its decode steps."""
    engine.step_records.clear()
    engine.add_request(corpus[:prompt_len].tolist(),
                       SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    durations = [s.duration_s for s in engine.step_records if s.num_prefill_tokens == 0]
    p50 = float(np.median(durations))
    print(f"a single stream alone ({prompt_len}-token prompt, {len(durations)} decode steps): "
          f"p50 {1000 * p50:.1f} ms = {1 / p50:.0f} tok/s")


if __name__ == "__main__":
    sys.exit(main())
