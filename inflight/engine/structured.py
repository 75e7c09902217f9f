"""Structured output: grammars compiled by llguidance, and the token masks they put on the logits.

A request's `StructuredOutputs` (a JSON schema, any JSON object, a regex, a choice of strings, or a
Lark or GBNF grammar) is compiled once per distinct constraint against the model's tokenizer
(`GrammarCompiler`), and each request gets its own `Grammar`: that grammar's parser state. Each step
the sampler asks the grammar of every constrained row which token ids it allows next (a bitmask, a
bit per id, filled by llguidance in parallel threads), sets the other logits of those rows only to
-inf (`TokenMasks`), and the engine then advances the grammar by the token chosen. A grammar that is
complete ends its request (finish reason stop). Prompt and output tokens are the model's own, so a
preempted request keeps its grammar's state: recompute re-reads tokens the grammar already took.

llguidance was chosen over xgrammar by measurement (`benchmarks/grammar_engines.py`, figures in
docs/benchmarks.md): both compute a mask in microseconds, but xgrammar requires triton (286 MB)
on Linux, and llguidance requires nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from inflight.errors import InvalidRequestError
from inflight.model.tokenizer import Tokenizer
from inflight.request import Grammar, StructuredOutputs

if TYPE_CHECKING:
    import llguidance

# llguidance is imported where a constraint is first compiled, so that an engine that never
# sees one does not load it.


def _grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for a constraint; raises ValueError for a malformed one."""
    import llguidance

    match spec.kind:
        case "json":
            assert isinstance(spec.json, str)
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json)
        case "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        case "regex":
            assert spec.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        case "choice":
            assert spec.choice is not None
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        case _:
            assert spec.grammar is not None
            return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """Compiles constraints against one tokenizer; the last `cache_size` distinct ones are kept,
    so that a schema sent with every request is compiled once. Thread-safe: the server compiles
    in its handlers' threads (to answer a bad schema with a 400), the engine for offline requests."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 64) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutputs, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer_for_llguidance(self) -> llguidance.LLTokenizer:
        # Built on first use (about 0.7 s for a 49k vocabulary), not by servers that never need it.
        import llguidance.hf  # imports transformers

        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer.hf, n_vocab=self.vocab_size, eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._llg_tokenizer

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """A new `Grammar` at the start of `spec`; raises InvalidRequestError with llguidance's
        message if `spec` does not compile (a malformed schema, regex or grammar)."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.fresh()
        import llguidance

        tokenizer = self._tokenizer_for_llguidance()
        try:
            text = _grammar_text(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"cannot compile the {spec.kind} constraint: {exc}") from None
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"cannot compile the {spec.kind} constraint: {matcher.get_error()}")
        compiled = Grammar(matcher)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
            return compiled.fresh()


_BITS = 32


class TokenMasks:
    """Masks the logits of a step's constrained rows with their grammars' allowed tokens."""

    def __init__(self, device: torch.device, num_threads: int = 2) -> None:
        import llguidance

        self.device = device
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._shifts = torch.arange(_BITS, dtype=torch.int32, device=device)

    def bitmask(self, grammars: Sequence[Grammar], vocab_size: int) -> torch.Tensor:
        """(len(grammars), ceil(vocab_size / 32)) int32 words: bit b of word w allows token 32w + b."""
        words = -(-vocab_size // _BITS)
        mask = torch.zeros((len(grammars), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                               mask.data_ptr(), words * 4, len(grammars))
        for i, g in enumerate(grammars):
            if (token := g.also_allowed) is not None and token < vocab_size:
                bit = token % _BITS
                mask[i, token // _BITS] |= (1 << bit) if bit < _BITS - 1 else -(1 << bit)  # int32: bit 31 is the sign
        return mask

    def apply(self, logits: torch.Tensor, rows: Sequence[int], grammars: Sequence[Grammar]) -> None:
        """Sets, in place, `logits[rows[i]]` to -inf wherever `grammars[i]` disallows the token."""
        vocab = logits.shape[1]
        words = self.bitmask(grammars, vocab).to(self.device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
        index = torch.tensor(list(rows), device=logits.device)
        logits[index] = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
