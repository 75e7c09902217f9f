"""Speculative decoding's draft model: a smaller model with the target's tokenizer proposes each
request's next tokens, greedily, one forward pass of its own per proposed token, in batches.

The draft runs on a KV pool and block manager of its own (as many blocks as the target's, each
smaller by the model's size), holding each drafting request's tokens as far as they are known to
it. Each step it catches up with what the target accepted since (usually one or two tokens, the
whole prompt the first time), then proposes: the first token from the catch-up's last position,
each further one from the one before. The KV it wrote for proposals the target then rejected is
overwritten by the next catch-up, which starts where the draft's tokens and the request's part.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from inflight.engine.block_manager import BlockManager
from inflight.engine.runner import ModelRunner
from inflight.engine.sampler import Sampler
from inflight.engine.speculative import StepCurve, draft_passes
from inflight.errors import ConfigError
from inflight.model.loaded import LoadedModel
from inflight.perf.cost_model import SeqWork, StepTimeModel
from inflight.request import Request


def check_draft(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuses a draft whose proposals the target could not read: another vocabulary."""
    if draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
        raise ConfigError(f"speculative_config: the draft model {draft.name} has another tokenizer than "
                          f"{target.name}; a draft must share the target's vocabulary")


class DraftModel:
    """Proposes greedy tokens from a draft model (`Speculator.drafter`); says what proposing
    costs (`cost`), from the cost model of the draft refitted to its own measured passes."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, target_vocab_size: int,
                 cost_model: StepTimeModel | None = None, kv_dtype: torch.dtype | None = None) -> None:
        self.loaded = loaded
        model = loaded.model
        self.runner = ModelRunner(model, num_blocks, block_size, Sampler(model.device), kv_dtype)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.curve = StepCurve(cost_model) if cost_model is not None else None
        self.vocab_size = target_vocab_size
        # Request id -> (how many of its tokens the draft held at its last proposal, the proposed
        # tokens it then computed after them), least recently drafting first.
        self._held: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        self.last_s = 0.0

    def held_tokens(self, request: Request) -> int:
        """How many of the request's tokens the draft's KV holds (proposals the target kept count)."""
        num_real, proposed = self._held.get(request.request_id, (0, []))
        tokens = request.num_tokens
        kept = 0
        while kept < len(proposed) and num_real + kept < tokens \
                and request.tokens_slice(num_real + kept, num_real + kept + 1)[0] == proposed[kept]:
            kept += 1
        return min(num_real + kept, tokens - 1)

    def cost(self, lengths: Sequence[tuple[Request, int]]) -> float:
        """Predicted seconds to propose `lengths` tokens of each request. A request the draft does
        not hold yet counts one token for its catch-up, not its prompt: that prefill is paid once
        and repaid by every later step's proposals."""
        curve = self.curve
        if curve is None:
            return 0.0
        return sum(curve(work) for work in draft_passes(lengths, self._catch_up))

    def _catch_up(self, request: Request) -> int:
        return request.num_tokens - self.held_tokens(request) if request.request_id in self._held else 1

    def propose(self, wanted: dict[Request, int]) -> dict[Request, list[int]]:
        """Up to `wanted[r]` greedy tokens of each request, fewer where the draft's pool is short."""
        began = time.perf_counter()
        pieces: list[tuple[list[int], int, list[int]]] = []
        active: list[tuple[Request, int]] = []
        for request, n in wanted.items():
            if n <= 0 or not self._room(request, request.num_tokens + n - 1, wanted):
                continue
            held = self.held_tokens(request)
            pieces.append((request.tokens_slice(held, request.num_tokens), held,
                           self.block_manager.block_table(request.request_id)))
            active.append((request, n))
            self._held[request.request_id] = (request.num_tokens, [])
            self._held.move_to_end(request.request_id)
        proposals: dict[Request, list[int]] = {request: [] for request, _ in active}
        while pieces:
            start = time.perf_counter()
            tokens = self.runner.greedy_last(pieces)
            if self.curve is not None:
                self.curve.observe([SeqWork(len(ids), first + len(ids), 1) for ids, first, _ in pieces],
                                   time.perf_counter() - start)
            pieces, going = [], []
            for (request, n), token in zip(active, tokens, strict=True):
                draft = proposals[request]
                if token >= self.vocab_size:  # a draft's padded vocabulary: not a token of the target's
                    continue
                draft.append(token)
                if len(draft) < n:
                    position = request.num_tokens + len(draft) - 1
                    pieces.append(([token], position, self.block_manager.block_table(request.request_id)))
                    going.append((request, n))
                    self._held[request.request_id][1].append(token)
            active = going
        self.last_s = time.perf_counter() - began
        return {request: draft for request, draft in proposals.items() if draft}

    def _room(self, request: Request, num_tokens: int, keep: dict[Request, int]) -> bool:
        """Grows the request's block table to `num_tokens`, giving back the blocks of the requests
        that drafted least recently (not those drafting now) while the pool is short."""
        bm = self.block_manager
        keep_ids = {r.request_id for r in keep}
        while not bm.allocate_slots(request, num_tokens):
            victim = next((rid for rid in self._held if rid not in keep_ids), None)
            if victim is None:
                return False
            self.forget(victim)
        return True

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self.block_manager.free(request_id)
