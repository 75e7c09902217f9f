"""Speculation's choices replayed offline on a single stream (#36): what each configuration's
proposals and lengths would cost, priced by step times a measured run recorded, and the bound no
choice of lengths can pass.

A greedy request's tokens are the same with speculation and without (tests/test_speculative.py),
so its output, generated once without speculation, tells at every position what a proposal would
keep. This script generates the `copy-edit` workload's outputs one request at a time (as
`speculative.py`'s single stream does), then replays each `--spec` through this checkout's
`Speculator` (its proposals, the lengths it chooses, what it learns), or through git revision
REV's with `--against REV`, pricing each step by the median time of the measured single stream's
decode steps of as many tokens (`--curve`: a `speculative.py` result file, which records them by
the tokens each step computed; sizes it did not see are interpolated) and each request's prefill
by the measured one's. The Speculator predicts steps as in the engine: by the engine's own
step-time model for the embedded model, corrected by the steps it has seen, each priced by the
curve (`--known-curve`: by the curve itself, as a predictor that knew it would); and, as the
scheduler does, it is asked before each lookup whether any proposal would pay (`pays`). Printed per
configuration: steps, verifying steps, tokens per verifying step, the predicted tok/s ratio to
off, and the same for an oracle that verifies, at each step the configuration proposes, exactly
the tokens the model will keep (at most k): what a perfect choice of lengths would give with
these proposals. No host drift enters: two replays of one configuration give the same figures, so
a change to the lengths' policy is judged here in seconds, then confirmed by `speculative.py
--against REV`, which a drifting host makes noisy.

    .venv/bin/python benchmarks/speculative_replay.py --curve benchmarks/results/speculative-single-zen4-lengths.json \
        [--spec JSON ...] [--against REV] [--known-curve] [--num-requests 12]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inflight import SamplingParams
from inflight.config import SpeculativeConfig
from inflight.perf.cost_model import SeqWork, StepTimeModel
from inflight.request import Request

Output = tuple[list[int], list[int]]  # a request's prompt and its greedy output


@dataclass
class MeasuredCurve:
    """A single stream's decode step time by the tokens it computes (1: a plain step), from the
    measured medians, linear between them and past the last, and its prefill's mean time."""

    sizes: list[int]
    seconds: list[float]
    prefill_s: float

    def __call__(self, tokens: int) -> float:
        if tokens <= self.sizes[-1] or len(self.sizes) < 2:
            return float(np.interp(tokens, self.sizes, self.seconds))
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.sizes[-1] - self.sizes[-2])
        return self.seconds[-1] + slope * (tokens - self.sizes[-1])

    @classmethod
    def from_results(cls, path: Path) -> MeasuredCurve:
        """The single-stream scenario's decode steps of every run of a `speculative.py` result
        file, pooled by size (the median of each run's median, weighted by its steps)."""
        document = json.loads(path.read_text())
        scenario = next((s for s in document["scenarios"] if s["max_concurrency"] == 1), None)
        if scenario is None:
            raise SystemExit(f"{path}: no single-stream scenario")
        medians: dict[int, list[tuple[float, int]]] = {}
        prefills: list[float] = []
        for run in scenario["runs"]:
            for size, step in run["decode_steps_by_tokens"].items():
                medians.setdefault(int(size), []).append((step["median_s"], step["steps"]))
            prefill = run["step_split"]["prefill"]
            if prefill["steps"]:
                prefills.append(prefill["seconds"] / prefill["steps"])
        sizes = sorted(medians)
        seconds = [sum(s * n for s, n in medians[k]) / sum(n for _, n in medians[k]) for k in sizes]
        return cls(sizes, seconds, float(np.mean(prefills)))


class CurveCost:
    """The step-time predictor a Speculator weighs: the measured curve itself."""

    def __init__(self, curve: MeasuredCurve) -> None:
        self.curve = curve

    def step_time(self, batch: Sequence[SeqWork]) -> float:
        return self.curve(sum(w.num_new_tokens for w in batch))


@dataclass
class Replay:
    steps: int = 0
    verifying: int = 0
    kept: int = 0  # proposed tokens kept
    seconds: float = 0.0  # decode steps' (prefills apart)

    @property
    def tokens_per_verify(self) -> float:
        return (self.verifying + self.kept) / self.verifying if self.verifying else 0.0


def kept_prefix(draft: Sequence[int], output: Sequence[int], at: int) -> int:
    kept = 0
    while kept < len(draft) and at + kept < len(output) and draft[kept] == output[at + kept]:
        kept += 1
    return kept


def replay(outputs: Sequence[Output], make: Callable[[], Any], curve: MeasuredCurve) -> tuple[Replay, Replay]:
    """The outputs decoded one request at a time through a fresh Speculator (`make()`), and
    through an oracle verifying exactly the kept tokens of the same proposals: (policy, oracle).
    Each request's first token comes from its prefill and is not a decode step's; each decode
    step's time, the curve's, is what the Speculator measures (`observe_step`)."""
    results = []
    for oracle in (False, True):
        speculator, done = make(), Replay()
        for i, (prompt, output) in enumerate(outputs):
            request = Request(f"replay-{i}", list(prompt),
                              SamplingParams(max_tokens=len(output), temperature=0, ignore_eos=True))
            request.output_token_ids.append(output[0])
            at = 1
            while at < len(output):
                batch = [SeqWork(1, request.num_tokens, 1)]
                full = {request: [0] * speculator.max_length(request)}
                if oracle or speculator.pays(full, batch, budget=1 << 20):  # as the scheduler asks
                    draft = speculator.propose(request)
                else:
                    speculator.declined([request])
                    draft = []
                if oracle:
                    length = kept_prefix(draft, output, at)
                elif draft:
                    length = speculator.lengths({request: draft}, batch, budget=1 << 20)[request]
                else:
                    length = 0
                kept = kept_prefix(draft[:length], output, at)
                if length:
                    speculator.observe(request, length, kept)
                    done.verifying += 1
                    done.kept += kept
                seconds = curve(1 + length)
                speculator.observe_step([SeqWork(1 + length, request.num_tokens + length, 1 + length)], seconds)
                new = min(kept + 1, len(output) - at)
                request.output_token_ids.extend(output[at:at + new])
                done.steps += 1
                done.seconds += seconds
                at += new
            speculator.forget(request)
        results.append(done)
    return results[0], results[1]


def generate_outputs(num_requests: int) -> tuple[list[Output], StepTimeModel]:
    """The `copy-edit` workload's greedy outputs on the embedded model, one request at a time, and
    the step-time model a speculating engine of that model predicts its steps with."""
    import torch

    from inflight import LLM
    from inflight.bench.corpus import Corpus
    from inflight.bench.workload import generate_requests, load_workload
    from inflight.model.loaded import LoadedModel

    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    spec, path = load_workload("copy-edit", num_requests=num_requests)
    requests = generate_requests(spec, Corpus(loaded.tokenizer), path.parent)
    speculator = LLM(loaded=loaded, speculative_config={"method": "ngram"}).engine.speculator
    assert speculator is not None and speculator.curve is not None
    engine = LLM(loaded=loaded).engine
    outputs = []
    for bench in requests:
        prompt = list(bench.prompt_token_ids)
        engine.add_request(prompt, SamplingParams(max_tokens=bench.output_len, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs.append((prompt, list(out.request.output_token_ids)))
    return outputs, speculator.curve.cost_model


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from speculative import DEFAULT_SPECS, config_name, cpu_name, speculator_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curve", type=Path, required=True, help="a speculative.py result file (its single stream)")
    parser.add_argument("--spec", action="append", default=None, help="a --speculative-config replayed (repeatable)")
    parser.add_argument("--against", metavar="REV", default=None, help="also replay with git revision REV's Speculator")
    parser.add_argument("--known-curve", action="store_true",
                        help="the Speculator predicts steps by the measured curve, not the engine's model")
    parser.add_argument("--num-requests", type=int, default=12)
    args = parser.parse_args()
    configs = [json.loads(text) for text in args.spec] if args.spec else list(DEFAULT_SPECS)
    if any(c.get("method") == "draft_model" for c in configs):
        raise SystemExit("speculative_replay.py: a draft model's proposals need the draft; replay n-gram or suffix")
    curve = MeasuredCurve.from_results(args.curve)
    from inflight.engine.speculative import Speculator

    kinds: list[tuple[str, type[Any]]] = [("", Speculator)]
    if args.against:
        kinds.append((f"@{args.against}", speculator_of(args.against)))
    print(f"CPU (here, generating the outputs): {cpu_name()}; step times from {args.curve} "
          f"({json.loads(args.curve.read_text()).get('cpu', '?')}): "
          + ", ".join(f"{n} tokens {1000 * s:.2f} ms" for n, s in zip(curve.sizes, curve.seconds, strict=True))
          + f"; prefill {1000 * curve.prefill_s:.0f} ms")
    outputs, engine_model = generate_outputs(args.num_requests)
    predictor = CurveCost(curve) if args.known_curve else engine_model
    decode_tokens = sum(len(out) - 1 for _, out in outputs)
    prefill = curve.prefill_s * len(outputs)
    off = prefill + decode_tokens * curve(1)
    print(f"{len(outputs)} requests, {decode_tokens} decode steps without speculation: "
          f"predicted {off:.2f} s ({prefill:.2f} s of prefill)")
    for config in configs:
        for suffix, cls in kinds:
            policy, oracle = replay(outputs, lambda c=config, k=cls: k(SpeculativeConfig(**c), predictor), curve)
            for label, r in ((config_name(config) + suffix, policy), ("  oracle lengths", oracle)):
                print(f"  {label:<22} {r.steps:5d} steps, {r.verifying:4d} verifying "
                      f"({r.tokens_per_verify:.2f} tokens each), decode {r.seconds:6.2f} s: "
                      f"{off / (prefill + r.seconds):.3f}x off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
