"""What each form of the weights costs in quality, in one table (#35 point 2, #34's block types):
perplexity, the 40-item multiple-choice task of `benchmarks/lm_eval/`, and greedy agreement,
for the same model computed as

- `fp32`: the embedded GGUF with every decoder matrix written out as F32 (its blocks
  dequantized by gguf-py): the reference of every other row;
- `stored`: the file as it ships (Q4_1 blocks read in place; the contract is bit-equality with
  their fp32 dequantization, so this row must equal `fp32`);
- `int8`: `--quantization int8` (W8A8) on the stored file;
- `int8-activations`: `--quantization int8-activations` on the stored file (its Q4_1 blocks times
  activations quantized per row and 32 inputs: llama.cpp's arithmetic);
- `kv-float16`, `kv-bfloat16`: the stored file with its KV pool in 16 bits (`--kv-cache-dtype`);
- `bf16-activations`: the `BF16` row's file (below) with `--quantization bf16-activations` (its
  bf16 matrices times activations rounded to bf16; `vdpbf16ps` on AVX512_BF16);
- `Q8_0`, `Q5_1`, `Q5_0`, `Q4_0`, ...: the decoder matrices quantized again by gguf-py from the
  fp32 weights (so each row shows what its block type loses against the weights it was made
  from); the token embedding (the tied LM head) stays as stored in every row;
- `--gguf PATH`: any other file of the same model (K-quants made by llama.cpp's quantizer).

The figures:

- **perplexity**: exp of the mean negative log-likelihood, teacher-forced through the engine's
  prompt logprobs, over `--tokens` tokens of the public-domain prose in `inflight/data/` in
  `--window`-token windows spread evenly over it (each window's first token is context only);
- **task**: lm-eval's `multiple_choice` scoring of `benchmarks/lm_eval/task.jsonl` (context and
  continuation encoded as lm-eval's `_encode_pair` does, the continuation's summed logprobs;
  `acc` the most likely choice, `acc_norm` per character), as lm-eval's `local-completions`
  computes it against `inflight serve` (tests/test_server.py checks that request shape);
- **greedy**: `--prompts` prompts of 48 corpus tokens, `--max-tokens` greedy tokens each (EOS
  ignored): the share of positions equal to the reference's, and the mean number of tokens
  before the first difference.

    .venv/bin/python benchmarks/quality.py [--variants fp32,stored,int8,int8-activations,Q8_0,Q5_1,Q5_0,Q4_0]
        [--variants stored,kv-float16,kv-bfloat16] [--variants fp32,BF16,bf16-activations]
        [--gguf FILE ...] [--tokens 4096] [--window 512] [--output runs/quality.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inflight.bench.corpus import Corpus
from inflight.engine.llm import LLM
from inflight.model.gguf_copy import retyped_copy
from inflight.model.loader import default_model_path, resolve_model
from inflight.model.tokenizer import Tokenizer
from inflight.request import SamplingParams

HERE = Path(__file__).resolve().parent
TASK = HERE / "lm_eval" / "task.jsonl"
PROMPT_LEN = 48
DEFAULT_VARIANTS = "fp32,stored,int8,int8-activations,Q8_0,Q5_1,Q5_0,Q4_0"


@dataclass
class Variant:
    """One row: a model file and the engine options it runs with."""

    name: str
    model: Path
    options: dict[str, Any] = field(default_factory=dict)


def variants(names: list[str], files: list[str], folder: Path) -> list[Variant]:
    stored = default_model_path()
    rows = []
    for name in names:
        if name == "stored":
            rows.append(Variant(name, stored))
        elif name in ("int8", "int8-activations"):
            rows.append(Variant(name, stored, {"quantization": name}))
        elif name in ("kv-float16", "kv-bfloat16"):
            rows.append(Variant(name, stored, {"kv_cache_dtype": name.removeprefix("kv-")}))
        elif name == "bf16-activations":
            rows.append(Variant(name, retyped_copy(stored, "BF16", folder), {"quantization": name}))
        else:
            rows.append(Variant(name, retyped_copy(stored, "F32" if name == "fp32" else name, folder)))
    rows += [Variant(Path(f).name, Path(f)) for f in files]
    return rows


def perplexity_windows(corpus: Corpus, tokens: int, window: int) -> list[list[int]]:
    """`tokens // window` windows of `window` corpus tokens, evenly spaced over the corpus."""
    count = max(1, tokens // window)
    ids = corpus.token_ids
    stride = (len(ids) - window) // count
    return [ids[i * stride:i * stride + window].tolist() for i in range(count)]


def greedy_prompts(corpus: Corpus, count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_LEN corpus tokens, spaced evenly, half a stride in (away from the
    perplexity windows' starts)."""
    ids = corpus.token_ids
    stride = (len(ids) - PROMPT_LEN) // count
    return [ids[i * stride + stride // 2:i * stride + stride // 2 + PROMPT_LEN].tolist() for i in range(count)]


def nll(llm: LLM, windows: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood of every window token after the first, and their count."""
    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    total = -sum(lp.logprob for out in outs for lp in out.prompt_logprobs or [])
    return total, sum(len(w) - 1 for w in windows)


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's `_encode_pair`: trailing spaces move from context to continuation; the whole is
    encoded once and the context's own encoding says where the continuation starts."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    return whole, len(tokenizer.encode(context, add_special_tokens=False))


def task_choices(llm: LLM, items: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Each item's (acc, acc_norm) pick: the choice of highest summed continuation logprob, and
    of highest per character."""
    pairs = [encode_pair(llm.tokenizer, item["query"], " " + choice) for item in items for choice in item["choices"]]
    outs = llm.generate([ids for ids, _ in pairs], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    scores = iter(sum(lp.logprob for lp in (out.prompt_logprobs or [])[start - 1:])
                  for (_, start), out in zip(pairs, outs, strict=True))
    picks = []
    for item in items:
        ll = [next(scores) for _ in item["choices"]]
        per_char = [v / len(c) for v, c in zip(ll, item["choices"], strict=True)]
        picks.append((int(np.argmax(ll)), int(np.argmax(per_char))))
    return picks


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [list(out.token_ids) for out in outs]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> tuple[float, float]:
    """The share of positions with the reference's token, and the mean run before the first
    difference."""
    same = sum(a == b for r, t in zip(reference, tokens, strict=True) for a, b in zip(r, t, strict=True))
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, t, strict=True)) if a != b), len(r))
                for r, t in zip(reference, tokens, strict=True)]
    return same / max(1, sum(map(len, reference))), float(np.mean(prefixes))


def evaluate(variant: Variant, windows: list[list[int]], items: list[dict[str, Any]], prompts: list[list[int]],
             max_tokens: int, window: int) -> dict[str, Any]:
    start = time.perf_counter()
    llm = LLM(str(variant.model), max_model_len=max(window, 256) + 8, **variant.options)
    loaded_s = time.perf_counter() - start
    total, count = nll(llm, windows)
    picks = task_choices(llm, items)
    row = {"name": variant.name, "model": str(variant.model), "options": variant.options,
           "file_bytes": variant.model.stat().st_size, "load_s": loaded_s,
           "nll_sum": total, "scored_tokens": count, "perplexity": math.exp(total / count),
           "picks": picks, "acc": sum(p[0] == item["gold"] for p, item in zip(picks, items, strict=True)),
           "acc_norm": sum(p[1] == item["gold"] for p, item in zip(picks, items, strict=True)),
           "greedy_tokens": greedy(llm, prompts, max_tokens)}
    del llm
    gc.collect()  # one model's weights and KV pool at a time
    return row


def run(names: list[str], files: list[str], tokens: int, window: int, num_items: int | None, num_prompts: int,
        max_tokens: int) -> dict[str, Any]:
    items = [json.loads(line) for line in TASK.read_text().splitlines()][:num_items]
    rows = []
    with tempfile.TemporaryDirectory(prefix="inflight-quality-") as tmp:
        for variant in variants(names, files, Path(tmp)):
            if not rows:  # the corpus tokenized once: every row is the same model
                corpus = Corpus(Tokenizer.load(resolve_model(str(variant.model))))
                windows = perplexity_windows(corpus, tokens, window)
                prompts = greedy_prompts(corpus, num_prompts)
            rows.append(evaluate(variant, windows, items, prompts, max_tokens, window))
            print(f"  {variant.name}: perplexity {rows[-1]['perplexity']:.4f}", file=sys.stderr, flush=True)
    reference = rows[0]
    for row in rows:
        row["greedy_same"], row["greedy_prefix"] = agreement(reference["greedy_tokens"], row["greedy_tokens"])
        row["perplexity_vs_reference"] = row["perplexity"] / reference["perplexity"] - 1
    return {"reference": reference["name"], "tokens": reference["scored_tokens"], "window": window,
            "items": len(items), "prompts": num_prompts, "max_tokens": max_tokens, "rows": rows}


def table(document: dict[str, Any]) -> str:
    lines = [f"perplexity over {document['tokens']} tokens ({document['window']}-token windows), "
             f"task {document['items']} items, greedy {document['prompts']} x {document['max_tokens']} tokens; "
             f"against {document['reference']}",
             "| weights | file MB | perplexity | vs ref | task acc | acc_norm | greedy same | first diff |",
             "|---|---|---|---|---|---|---|---|"]
    for row in document["rows"]:
        lines.append(f"| {row['name']} | {row['file_bytes'] / 1e6:.0f} | {row['perplexity']:.3f} | "
                     f"{row['perplexity_vs_reference']:+.2%} | {row['acc']}/{document['items']} | "
                     f"{row['acc_norm']}/{document['items']} | {row['greedy_same']:.1%} | "
                     f"{row['greedy_prefix']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="comma-separated: fp32, stored, int8, int8-activations, kv-float16, kv-bfloat16, "
                             "or a gguf-py block type (Q8_0, Q5_1, ...); the first is the reference")
    parser.add_argument("--gguf", action="append", default=[], help="another file of the same model (repeatable)")
    parser.add_argument("--tokens", type=int, default=4096, help="perplexity tokens (a multiple of --window)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--items", type=int, default=None, help="the task's first N items (all 40 by default)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default="runs/quality.json")
    args = parser.parse_args(argv)
    from speculative import cpu_name

    document = run([n for n in args.variants.split(",") if n], args.gguf, args.tokens, args.window, args.items,
                   args.prompts, args.max_tokens)
    document.update(command=" ".join(["benchmarks/quality.py", *(argv if argv is not None else sys.argv[1:])]),
                    cpu=cpu_name())
    print(table(document))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(document, indent=1) + "\n")
    print(f"written: {args.output} ({document['cpu']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
