"""`inflight` command line: generate, serve, bench, check, sim, tune."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from inflight.errors import InflightError
from inflight.options import add_engine_options, engine_options


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

    # Imported when the parser is built, so that importing this module stays cheap.
    from inflight.bench.cli import register as register_bench
    from inflight.fleet.cli import add_fleet_options
    from inflight.server.cli import register as register_server
    from inflight.sim.cli import register as register_sim

    serve = register_server(sub)
    add_fleet_options(serve)
    serve.set_defaults(func=_cmd_serve)
    register_bench(sub)
    register_sim(sub)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    """`serve`: one process, or with `--replicas` (or autoscaling bounds) a fleet on Ray Serve."""
    from inflight.fleet.cli import cmd_serve_fleet, wants_fleet
    from inflight.server.cli import cmd_serve

    return cmd_serve_fleet(args) if wants_fleet(args) else cmd_serve(args)


def _read_slo_from(args: argparse.Namespace) -> None:
    """`--slo-from SLA_FILE`: its targets, where `--ttft-slo-ms` / `--tbt-slo-ms` set none."""
    if getattr(args, "slo_from", None) is None:
        return
    for name, value in slo_targets(args.slo_from).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def main(argv: Sequence[str] | None = None) -> int:
    from inflight.bench.report import record_command_line

    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is not None:  # run from Python: what run files and reports name is this command, not the host's
        record_command_line(["inflight", *argv])
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _read_slo_from(args)
        return int(args.func(args) or 0)
    except InflightError as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
