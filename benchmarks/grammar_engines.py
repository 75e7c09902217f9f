"""llguidance against xgrammar on the embedded model's tokenizer: what each costs to set up, to
compile a constraint, and to compute one token's mask while following a valid output; and what
each needs installed. This is the measurement behind inflight's choice of llguidance.

    .venv/bin/python -m pip install "xgrammar==0.2.9" apache-tvm-ffi --no-deps   # optional, to compare
    .venv/bin/python benchmarks/grammar_engines.py

(`--no-deps`: xgrammar's declared dependencies include triton on Linux, 286 MB, which this
comparison does not need.) Each constraint is compiled cold (caches off), then its mask is
computed before each token of a fixed output that the constraint accepts; the figures are the
median and the largest per-token time.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from inflight.model.loader import load_model_config, resolve_model
from inflight.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
CASES = [  # (name, kind, constraint, an output it accepts)
    ("json schema", "json", SCHEMA, json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"],
                                                "address": {"city": "London", "zip": "12345"}})),
    ("json object", "json_object", None, json.dumps({"k": [1, 2, {"x": None}], "s": "text"})),
    ("regex", "regex", r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
]


def _requires(dist: str) -> str:
    try:
        meta = importlib.metadata.metadata(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    reqs = [r.split(";")[0].strip() for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    files = importlib.metadata.files(dist) or []
    size = sum((f.size or 0) for f in files) / 1e6
    return f"{meta['Version']}, {size:.1f} MB installed, requires: {', '.join(reqs) or 'nothing'}"


def _time_mask(fill: Callable[[], None], accept: Callable[[int], Any], ids: list[int]) -> tuple[float, float]:
    times = []
    for token in ids:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        assert accept(token), token
    return statistics.median(times) * 1e6, max(times) * 1e6


def llguidance_rows(tok: Tokenizer, vocab: int) -> list[str]:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok.hf, n_vocab=vocab, eos_token=sorted(tok.eos_token_ids))
    rows = [f"  tokenizer setup {time.perf_counter() - start:.2f} s"]
    mask = torch.zeros((1, -(-vocab // 32)), dtype=torch.int32)
    for name, kind, constraint, text in CASES:
        start = time.perf_counter()
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(constraint)
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        compile_ms = (time.perf_counter() - start) * 1e3
        ids = tok.encode(text, add_special_tokens=False)
        median, worst = _time_mask(lambda m=matcher: m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4),
                                   matcher.consume_token, ids)
        rows.append(f"  {name:12s} compile {compile_ms:6.2f} ms   mask median {median:6.1f} us, max {worst:7.1f} us"
                    f"  ({len(ids)} tokens)")
    return rows


def xgrammar_rows(tok: Tokenizer, vocab: int) -> list[str]:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        return [f"  not importable ({exc}); install it as the docstring says to compare"]
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab, stop_token_ids=sorted(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    rows = [f"  tokenizer setup {time.perf_counter() - start:.2f} s"]
    mask = xgr.allocate_token_bitmask(1, vocab)
    for name, kind, constraint, text in CASES:
        start = time.perf_counter()
        if kind == "json":
            compiled = compiler.compile_json_schema(json.dumps(constraint))
        elif kind == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_regex(constraint)
        matcher = xgr.GrammarMatcher(compiled)
        compile_ms = (time.perf_counter() - start) * 1e3
        ids = tok.encode(text, add_special_tokens=False)
        median, worst = _time_mask(lambda m=matcher: m.fill_next_token_bitmask(mask, 0), matcher.accept_token, ids)
        rows.append(f"  {name:12s} compile {compile_ms:6.2f} ms   mask median {median:6.1f} us, max {worst:7.1f} us"
                    f"  ({len(ids)} tokens)")
    return rows


def main() -> None:
    source = resolve_model(None)
    config = load_model_config(source)
    tok = Tokenizer.load(source, config.eos_token_ids)
    print(f"tokenizer: {source.name}, vocabulary {config.vocab_size}")
    for dist, rows in (("llguidance", llguidance_rows), ("xgrammar", xgrammar_rows)):
        print(f"{dist}: {_requires(dist)}")
        for row in rows(tok, config.vocab_size):
            print(row)


if __name__ == "__main__":
    main()
