"""Speculative decoding against none, in one process on one loaded model (#36):

- single stream: the `copy-edit` workload (copy, edit or continue a passage of the prompt), one
  request at a time;
- Poisson arrivals of `copy-edit` at three rates between idle and saturation;
- burst-64 at saturation: the `burst` workload (corpus text, few repeats) cut to 64 requests,
  all at once, and `copy-edit` likewise.

In each of `--rounds` rounds every configuration (off, ngram, suffix; `--spec JSON`, repeated,
replaces the speculating ones) runs the scenario at once, the engines taking turns step by step,
each on a clock that runs only during its own turns (`run_lockstep`: a host whose speed drifts
slows them alike). `--whole-runs` runs them one after the other instead, in the order off, ngram,
suffix, suffix, ngram, off, ... (what drift biases: `drift_check.py`). Printed per scenario: output
tok/s of each run, each configuration's ratio to the `off` run of its round (under arrivals slower
than the engine tok/s follows the arrivals, so also the TPOT ratio: how much faster each stream
ran), TPOT and TTFT p99, the share of proposal lookups that found one (the text repeating itself),
the acceptance rate (proposed tokens kept), tokens per verifying step, and
the engine's own time on speculation (choosing lengths, looking up proposals, recording what was
kept: wall time outside the model) as a share of the run's: at saturation, where no proposal
pays, that share is what speculation can cost, free of the machine's run-to-run noise. Under
each run, where its step time went: steps computing prompt tokens, plain decode steps and steps
verifying proposed tokens, each kind's share and time a step (a single stream's speed-up is
bound by the first, which speculation does not shorten, and set by what the last cost against
the second); under a single stream's speculating runs, the median time of its decode steps by
the tokens each computed (1: a plain step; 1 + k: k proposed tokens verified), the cost curve
the adaptive length weighs.
Written to `--out` (JSON).

`--draft-layers N` adds a draft-model configuration: the embedded model cut to its first N of 30
layers, or to those listed (`0-3,26-29`: LayerSkip's self-speculation without its training), with
its own embedding, final norm and LM head (Q4_1 blocks copied as they are; a GGUF written to a
temporary folder with gguf-py), proposing `--draft-k` tokens, for the mechanics and the cost
of a draft model's passes on this CPU (such a cut model agrees with the full one less often than a
trained draft would).

`--quantization` runs every configuration on the model so loaded (`int8`, `int8-activations`,
`bf16-activations`: the arithmetic a user may choose), speculation off included.

`--against REV` adds, for each speculating configuration, the same configuration (`name@REV`)
whose lengths and proposals come from git revision REV's `inflight/engine/speculative.py` (its
`Speculator`, over this checkout's engine and model), in the same lockstep rounds: how a change to
the speculation's choices is measured on a host whose speed drifts (the speculation counterpart of
`kernels_bench.py --against`). REV's module must fit this checkout's engine (its interface as of
`d976ab7`, `Speculator.pays`).

    .venv/bin/python benchmarks/speculative.py [--rounds 2] [--spec JSON ...] [--draft-layers N]
        [--only NAME] [--quick] [--quantization none] [--whole-runs] [--against REV]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from inflight.bench.corpus import Corpus
from inflight.bench.runs import RunPlan, run_in_process, run_lockstep
from inflight.bench.timeline import Timeline
from inflight.bench.workload import generate_requests, load_workload, with_request_rate
from inflight.engine import engine as engine_module
from inflight.engine.speculative import Speculator
from inflight.model.loaded import LoadedModel

DEFAULT_SPECS = [{"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix", "num_speculative_tokens": 8}]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def config_name(config: dict[str, Any]) -> str:
    """ngram4, suffix8, draft4 (the embedded model drafting for itself), draft6L4 (a cut model),
    with "-fixed" where the lengths are not chosen (adaptive false) and "-option=value" for any
    other option set (ngram8-prompt_lookup_min=1)."""
    method = config.get("method", "ngram")
    name = "draft" if method == "draft_model" else method
    model = str(config.get("model", ""))
    if "embedded-layers-" in model:
        name += f"{model.rsplit('-', 1)[-1].removesuffix('.gguf').count('_') + 1}L"
    name += str(config.get("num_speculative_tokens", 4))
    name += "-fixed" if config.get("adaptive") is False else ""
    # Any other option set, so that two configurations never share a name (their rows would merge).
    named = {"method", "num_speculative_tokens", "model", "adaptive"}
    return name + "".join(f"-{key}={config[key]}" for key in sorted(config) if key not in named)


def layer_spec(text: str) -> list[int]:
    """"0-3,26-29" -> [0, 1, 2, 3, 26, 27, 28, 29]; "6" -> the first 6 layers."""
    if text.isdigit():
        return list(range(int(text)))
    layers: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers += range(int(first), int(last or first) + 1)
    return layers


def truncated_draft(layers: list[int], folder: Path) -> Path:
    """The embedded GGUF with only the blocks `layers` (renumbered in order): metadata and
    tensors copied as stored (quantized blocks unchanged), `block_count` set to their number."""
    from inflight.model.gguf_copy import rewrite_gguf
    from inflight.model.loader import default_model_path

    renumber = {old: new for new, old in enumerate(layers)}

    def tensors(reader: Any) -> Iterator[tuple[str, Any, Any]]:
        for tensor in reader.tensors:
            name = tensor.name
            if name.startswith("blk."):
                _, index, rest = name.split(".", 2)
                if int(index) not in renumber:
                    continue
                name = f"blk.{renumber[int(index)]}.{rest}"
            yield name, tensor.data, tensor.tensor_type

    path = folder / f"embedded-layers-{'_'.join(map(str, layers))}.gguf"
    return rewrite_gguf(default_model_path(), path, {"block_count": len(layers)}, tensors)


def speculator_of(rev: str) -> type[Speculator]:
    """The `Speculator` class of git revision `rev`'s inflight/engine/speculative.py, loaded as a
    module of its own beside this checkout's. A revision before `Speculator.declined` gets one
    that does nothing (what its engine did in such a step); one whose `declined` takes no
    requests, one that passes them over."""
    root = Path(__file__).resolve().parent.parent
    path = "inflight/engine/speculative.py"
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType(f"inflight_speculative_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    theirs: type[Speculator] = module.Speculator
    own = getattr(theirs, "declined", None)
    if own is None:
        theirs.declined = lambda self, requests=(): None  # type: ignore[attr-defined]
    elif len(inspect.signature(own).parameters) == 1:
        theirs.declined = lambda self, requests=(): own(self)  # type: ignore[method-assign]
    return theirs


@contextlib.contextmanager
def speculators(plans: Sequence[RunPlan], against: type[Speculator] | None) -> Iterator[None]:
    """While the plans' engines are built, in order: each speculating engine's `Speculator` is
    this checkout's, or `against` where its label names a revision (`ngram8@REV`)."""
    if against is None:
        yield
        return
    queue = [against if "@" in plan.label else Speculator for plan in plans if "speculative_config" in plan.overrides]

    def make(*args: Any, **kwargs: Any) -> Speculator:
        return queue.pop(0)(*args, **kwargs)

    engine_module.Speculator = make  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        engine_module.Speculator = Speculator  # type: ignore[misc]
    assert not queue, "every speculating engine built"


def step_split(timeline: Timeline | None) -> dict[str, dict[str, float]]:
    """A run's step time by kind of step: steps computing prompt tokens (`prefill`, decodes beside
    them included), steps decoding one token a request (`plain`), and steps verifying proposed
    tokens (`verifying`): each kind's steps, seconds, and share of all steps' time."""
    kinds: dict[str, list[float]] = {"prefill": [], "plain": [], "verifying": []}
    for step in timeline.steps if timeline is not None else []:
        kind = "prefill" if step.num_prefill_tokens else "verifying" if step.num_spec_tokens else "plain"
        kinds[kind].append(step.duration_s)
    total = sum(sum(durations) for durations in kinds.values()) or 1.0
    return {kind: {"steps": len(durations), "seconds": sum(durations), "share": sum(durations) / total}
            for kind, durations in kinds.items()}


def decode_steps_by_tokens(timeline: Timeline | None) -> dict[int, dict[str, float]]:
    """A run's steps without prompt tokens by the tokens they computed (decodes and proposed
    tokens verified): each size's steps and median seconds. With one request, how a step's time
    grows with the proposed tokens it verifies: the curve the adaptive length weighs."""
    sizes: dict[int, list[float]] = {}
    for step in timeline.steps if timeline is not None else []:
        if not step.num_prefill_tokens:
            sizes.setdefault(step.num_decode_tokens + step.num_spec_tokens, []).append(step.duration_s)
    return {n: {"steps": len(durations), "median_s": statistics.median(durations)}
            for n, durations in sorted(sizes.items())}


def scenarios(quick: bool) -> list[tuple[str, str, dict[str, Any], int | None]]:
    """(name, workload, overrides, max concurrency)."""
    n = 4 if quick else None
    return [
        ("single stream, copy-edit", "copy-edit", {"num_requests": n or 12}, 1),
        *[(f"Poisson {rate} req/s, copy-edit", "copy-edit", {"num_requests": n or 16, "rate": rate}, None)
          for rate in (0.5, 1.0, 2.0)],
        ("burst-64, copy-edit", "copy-edit", {"num_requests": n or 64}, None),
        ("burst-64, burst (corpus text)", "burst", {"num_requests": n or 64}, None),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spec", action="append", default=None, help="a --speculative-config compared (repeatable)")
    parser.add_argument("--quick", action="store_true", help="4 requests a scenario (a check that it runs)")
    parser.add_argument("--only", default=None, help="run the scenarios whose name contains this")
    parser.add_argument("--draft-layers", default=None,
                        help="also compare a draft model: the embedded model's first N layers, or those listed "
                             "(0-3,26-29)")
    parser.add_argument("--draft-k", type=int, default=4, help="the draft model's num_speculative_tokens")
    parser.add_argument("--quantization", default="none", help="the loaded model's arithmetic, every run alike")
    parser.add_argument("--whole-runs", action="store_true",
                        help="each configuration's run alone, one after the other (the order above), not in lockstep")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="also run each speculating configuration with git revision REV's Speculator")
    parser.add_argument("--out", default="benchmarks/results/speculative.json")
    args = parser.parse_args()
    configs = [json.loads(text) for text in args.spec] if args.spec else list(DEFAULT_SPECS)
    names = [config_name(c) for c in configs]
    if args.draft_layers is not None:
        folder = Path(tempfile.mkdtemp(prefix="inflight-draft-"))
        draft = truncated_draft(layer_spec(args.draft_layers), folder)
        configs.append({"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.draft_k})
        names.append(config_name(configs[-1]))
    against = speculator_of(args.against) if args.against else None
    if args.against:  # each speculating configuration again, with the revision's Speculator
        names += [f"{name}@{args.against}" for name in names]
        configs += configs
    torch.set_num_threads(torch.get_num_threads())
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"), quantization=args.quantization)
    corpus = Corpus(loaded.tokenizer)
    # Each round's runs in the order off, the configurations; every other round the reverse, so
    # that whole runs on a host drifting one way over the minutes favour no configuration.
    plans = []
    for i in range(args.rounds):
        round_plans = [RunPlan(f"off#{i + 1}", {}),
                       *(RunPlan(f"{name}#{i + 1}", {"speculative_config": c})
                         for name, c in zip(names, configs, strict=True))]
        plans += round_plans if i % 2 == 0 else round_plans[::-1]
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, quantization {args.quantization}; compared: "
          + "; ".join(f"{n} = {json.dumps(c)}" for n, c in zip(names, configs, strict=True)))
    document: dict[str, Any] = {"cpu": cpu_name(), "threads": torch.get_num_threads(),
                                "quantization": args.quantization, "lockstep": not args.whole_runs,
                                "speculative_configs": dict(zip(names, configs, strict=True)), "against": args.against,
                                "command": " ".join(sys.argv),
                                "date": time.strftime("%Y-%m-%d"), "scenarios": []}
    for name, workload, overrides, concurrency in scenarios(args.quick):
        if args.only and args.only not in name:
            continue
        rate = overrides.pop("rate", None)
        spec, path = load_workload(workload, **overrides)
        if rate is not None:
            spec = with_request_rate(spec, rate)
        requests = generate_requests(spec, corpus, path.parent)
        options = {"max_batch_size": 64, "quantization": args.quantization}
        if args.whole_runs:
            with speculators(plans, against):
                runs = run_in_process(None, options, plans, requests, max_concurrency=concurrency, progress=False,
                                      loaded=loaded)
        else:  # a round's engines take turns step by step: the host's drift hits all alike
            width = 1 + len(configs)
            runs = []
            for start in range(0, len(plans), width):
                with speculators(plans[start:start + width], against):
                    runs += run_lockstep(None, options, plans[start:start + width], requests,
                                         max_concurrency=concurrency, loaded=loaded)
        rows: list[dict[str, Any]] = []
        for run in runs:
            m = run.metrics
            rows.append({"label": run.label, "output_tok_s": m.output_throughput, "tpot_mean_ms": m.tpot_ms.mean,
                         "ttft_p99_ms": m.ttft_ms.p99, "e2e_p50_ms": m.e2e_ms.p50,
                         "acceptance_perc": m.spec_acceptance_perc,
                         "tokens_per_draft_step": m.spec_tokens_per_draft, "proposal_perc": m.spec_proposal_perc,
                         "completed": m.num_completed,
                         "spec_overhead_perc": m.spec_overhead_perc,
                         "step_split": step_split(run.capture.timeline),
                         "decode_steps_by_tokens": decode_steps_by_tokens(run.capture.timeline)})
        # Each configuration's ratios to the off run of its round: tok/s, and off/on TPOT (under
        # arrivals slower than the engine, tok/s follows the arrivals: latency tells instead).
        by_label = {row["label"]: row for row in rows}
        ratios: dict[str, list[float]] = {n: [] for n in names}
        tpot_ratios: dict[str, list[float]] = {n: [] for n in names}
        for i in range(1, args.rounds + 1):
            off = by_label[f"off#{i}"]
            for n in names:
                on = by_label[f"{n}#{i}"]
                ratios[n].append(on["output_tok_s"] / off["output_tok_s"])
                tpot_ratios[n].append(off["tpot_mean_ms"] / on["tpot_mean_ms"])
        print(f"\n== {name} ({len(requests)} requests) ==")
        width = max(len(row["label"]) for row in rows)
        for row in rows:
            acceptance = "-" if row["acceptance_perc"] is None else f"{row['acceptance_perc']:.1f}%"
            per_step = "-" if row["tokens_per_draft_step"] is None else f"{row['tokens_per_draft_step']:.2f}"
            found = "-" if row["proposal_perc"] is None else f"{row['proposal_perc']:.0f}%"
            overhead = "-" if not row["spec_overhead_perc"] else f"{row['spec_overhead_perc']:.2f}%"
            print(f"  {row['label']:>{width}}: {row['output_tok_s']:7.1f} tok/s  TPOT {row['tpot_mean_ms']:6.1f} ms  "
                  f"TTFT p99 {row['ttft_p99_ms']:7.0f} ms  found {found:>4}  accepted {acceptance:>6}  "
                  f"tokens/draft step {per_step}  "
                  f"speculation's own time {overhead}")
            print(" " * (width + 4) + "steps: " + ", ".join(
                f"{kind} {100 * k['share']:.0f}% ({k['steps']} at {1000 * k['seconds'] / k['steps']:.1f} ms)"
                for kind, k in row["step_split"].items() if k["steps"]))
            if concurrency == 1 and row["acceptance_perc"] is not None:  # one stream: its verify cost curve
                print(" " * (width + 4) + "decode steps by tokens: " + ", ".join(
                    f"{n} {1000 * k['median_s']:.1f} ms ({k['steps']})"
                    for n, k in row["decode_steps_by_tokens"].items()))
        for n in names:
            print(f"  {n} against off: output tok/s " + ", ".join(f"{r:.2f}x" for r in ratios[n])
                  + ";  TPOT (each stream's speed-up) " + ", ".join(f"{r:.2f}x" for r in tpot_ratios[n]))
        document["scenarios"].append({"name": name, "workload": workload, "num_requests": len(requests),
                                      "max_concurrency": concurrency, "request_rate": rate, "runs": rows,
                                      "tok_s_ratios_to_off": ratios, "tpot_speedups": tpot_ratios})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
