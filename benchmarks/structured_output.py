"""What structured output costs: a burst where a quarter of the requests are constrained by a
JSON schema, against the same burst with none constrained.

    .venv/bin/python benchmarks/structured_output.py [--requests 64] [--max-tokens 64] [--rounds 2]

Every request generates exactly `--max-tokens` tokens (EOS ignored; the schema, a list of
objects with at least 20 items, cannot complete that soon), so the two bursts do the same model work and tokens/s
compares their steps directly. Rounds alternate (none, quarter, quarter, none, ...) in one
process on one engine. Also printed: the sampler's mean time per step (where the masks are
filled and applied), and that every constrained output is a valid prefix of the schema's JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inflight import LLM, SamplingParams
from inflight.model.loaded import LoadedModel
from inflight.request import StructuredOutputs

SCHEMA = {
    "type": "array",
    "minItems": 20,  # more than max_tokens can hold: the grammar never completes, the output runs to max_tokens
    "items": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                       "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    },
}


def burst(llm: LLM, n: int, max_tokens: int, constrained_every: int | None) -> tuple[float, float, int]:
    """Runs the burst; returns (generated tok/s, mean sampler ms per step, constrained requests)."""
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    schema = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    prompts = [[{"role": "user", "content": f"List cities of country number {i} as JSON, with populations."}]
               for i in range(n)]
    params = [schema if constrained_every and i % constrained_every == 0 else plain for i in range(n)]
    llm.engine.step_records.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == n * max_tokens, tokens
    for out, p in zip(outs, params, strict=True):
        if p.structured_outputs is not None:
            assert out.text.lstrip().startswith("["), out.text
    sample_ms = statistics.fmean(r.sample_s for r in llm.engine.step_records) * 1e3
    return tokens / wall, sample_ms, sum(p.structured_outputs is not None for p in params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of bursts, alternated")
    args = parser.parse_args()
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    llm = LLM(loaded=loaded, num_kv_blocks=2048, max_batch_size=args.requests)
    burst(llm, 8, 8, 4)  # warm-up: the kernels, llguidance's tokenizer, the schema's compilation
    results: dict[str, list[tuple[float, float]]] = {"none": [], "quarter": []}
    order = []
    for r in range(args.rounds):
        order += ["none", "quarter"] if r % 2 == 0 else ["quarter", "none"]
    print(f"burst of {args.requests} chat requests, {args.max_tokens} tokens each; torch threads "
          f"{torch.get_num_threads()}")
    for label in order:
        tok_s, sample_ms, constrained = burst(llm, args.requests, args.max_tokens, 4 if label == "quarter" else None)
        results[label].append((tok_s, sample_ms))
        print(f"  {label:8s} ({constrained:2d} constrained)  {tok_s:6.1f} tok/s   sampler {sample_ms:5.2f} ms/step")
    none = statistics.fmean(t for t, _ in results["none"])
    quarter = statistics.fmean(t for t, _ in results["quarter"])
    print(f"quarter constrained / none: {quarter / none:.3f} (tokens/s, mean of {args.rounds} each)")


if __name__ == "__main__":
    main()
