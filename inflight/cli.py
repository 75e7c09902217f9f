"""`inflight` command line: generate, serve, bench, check, sim, tune."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from inflight.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from inflight.errors import InflightError

_CACHE = CacheConfig()
_SCHED = SchedulerConfig()


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--max-batch-size", type=int, default=_SCHED.max_batch_size)
    g.add_argument("--max-num-tokens", type=int, default=_SCHED.max_num_tokens,
                   help="token budget of one step, prefill and decode together")
    g.add_argument("--max-model-len", type=int, default=_SCHED.max_model_len)
    g.add_argument("--scheduling-policy", default=_SCHED.scheduling_policy.value,
                   choices=[p.value for p in SchedulingPolicy])
    g.add_argument("--priority-max-bypass", type=int, default=_SCHED.priority_max_bypass,
                   help="priority policy: a waiting request overtaken this many times by more urgent ones is "
                        "served next (aging)")
    g.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="slo policy: the TTFT target (orders waiting requests by deadline)")
    g.add_argument("--tbt-slo-ms", type=float, default=None,
                   help="slo policy: the TBT target (sets each step's token budget)")
    g.add_argument("--slo-from", default=None, metavar="SLA_FILE",
                   help="slo policy: take the targets from an `inflight check` SLA file (its goodput: "
                        "max_ttft_ms and max_tpot_ms, else max_ttft_p99_ms and max_tbt_p99_ms)")
    g.add_argument("--reject-late", action="store_true",
                   help="slo policy: refuse (429) a request that would miss its TTFT target on arrival")
    g.add_argument("--slo-cost-profile", default=_SCHED.slo_cost_profile,
                   help="slo policy: hardware profile (name or JSON) that predicts step times; refitted online")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=_SCHED.enable_chunked_prefill)
    g.add_argument("--guaranteed-no-evict", action="store_true",
                   help="admit a request only if the KV cache holds it to its max_tokens beside every running "
                        "request's maximum (TensorRT-LLM's GUARANTEED_NO_EVICT): no KV preemption, fewer at once")
    g.add_argument("--block-size", type=int, default=_CACHE.block_size)
    g.add_argument("--kv-cache-memory-fraction", type=float, default=_CACHE.kv_cache_memory_fraction,
                   help="KV pool size as a fraction of the memory available at start")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV pool size in bytes (overrides --kv-cache-memory-fraction)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides both)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_CACHE.enable_prefix_caching)
    g.add_argument("--seed", type=int, default=0)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's keyword options (as `LLM(**options)` takes them) from parsed arguments."""
    names = ["dtype", "device", "max_batch_size", "max_num_tokens", "max_model_len", "scheduling_policy",
             "priority_max_bypass", "ttft_slo_ms", "tbt_slo_ms", "slo_cost_profile",
             "enable_chunked_prefill", "block_size", "kv_cache_memory_fraction", "kv_cache_memory_bytes",
             "num_kv_blocks", "enable_prefix_caching", "seed"]
    options = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    for flag in ("reject_late", "guaranteed_no_evict"):
        if getattr(args, flag, False):
            options[flag] = True
    if getattr(args, "slo_from", None) is not None:
        options.update({k: v for k, v in slo_targets(args.slo_from).items() if options.get(k) is None})
    return options


def slo_targets(path: str) -> dict[str, float]:
    """The SLO policy's targets from an SLA file: its per-request goodput limits, else its p99s."""
    from inflight.bench.sla import load_sla

    sla = load_sla(path)
    good = sla.goodput
    ttft = good.max_ttft_ms if good is not None and good.max_ttft_ms is not None else sla.max_ttft_p99_ms
    tbt = good.max_tpot_ms if good is not None and good.max_tpot_ms is not None else sla.max_tbt_p99_ms
    found = {k: v for k, v in (("ttft_slo_ms", ttft), ("tbt_slo_ms", tbt)) if v is not None}
    if not found:
        raise InflightError(f"--slo-from {path}: the SLA file sets no TTFT or TBT limit")
    return found


def _cmd_generate(args: argparse.Namespace) -> int:
    from inflight.config import EngineConfig
    from inflight.engine.engine import LLMEngine
    from inflight.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **engine_options(args)))
    if args.chat:
        request = engine.add_request(params=params, messages=[{"role": "user", "content": args.prompt}])
    else:
        request = engine.add_request(args.prompt, params)
    if not args.chat:
        sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise InflightError(out.error)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    t = request.timings
    if args.verbose and t.ttft_s is not None and t.first_token is not None and t.finished is not None:
        n = request.num_output_tokens
        decode_s = t.finished - t.first_token
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
        print(f"[{n} tokens, finish={request.finish_reason.value if request.finish_reason else '?'}, "
              f"TTFT {t.ttft_s * 1000:.0f} ms, {rate:.1f} tok/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_options(gen)
    gen.set_defaults(func=_cmd_generate)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list[Any]:
    # Imported when the parser is built, so that importing this module stays cheap.
    from inflight.bench.cli import register as register_bench
    from inflight.server.cli import register as register_server
    from inflight.sim.cli import register as register_sim

    return [register_server, register_bench, register_sim]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except InflightError as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
