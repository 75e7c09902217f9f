"""Turns a scheduler's plain-data step into tensors, runs the model and samples.

The only place where requests meet tensors: it owns the KV pool and builds, once per step, the
packed inputs and the `AttentionMetadata` that every layer shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from inflight.engine.memory import huge_page_zeros, keep_freed_memory
from inflight.engine.sampler import Sampler
from inflight.engine.scheduler import ScheduledRequest, SchedulerOutput
from inflight.model.attention import AttentionMetadata, PrefillSegment, PrefillTables
from inflight.model.llama import LlamaModel
from inflight.request import Request


class RunnerTimings(NamedTuple):
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class StepInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, sampler: Sampler) -> None:
        cfg = model.config
        if model.device.type == "cpu":
            keep_freed_memory()
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = sampler
        # Zeroed, not empty: padded reads of unused slots must stay finite.
        shape = (cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = huge_page_zeros(*shape, dtype=model.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        # Test hook for fault injection: called with the step before the forward pass.
        self.before_forward: Callable[[SchedulerOutput], None] | None = None
        self.last_timings = RunnerTimings()

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
        cfg = model.config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * model.dtype.itemsize

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Runs one step; returns the new token of each request that reached its last token."""
        if self.before_forward is not None:
            self.before_forward(out)
        start = time.perf_counter()
        inputs = self.prepare(out.scheduled)
        prepared = time.perf_counter()
        logits = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_meta, inputs.logits_indices
        )
        forwarded = time.perf_counter()
        tokens = self.sampler(logits, inputs.sample_requests) if inputs.sample_requests else []
        self.last_timings = RunnerTimings(prepared - start, forwarded - prepared, time.perf_counter() - forwarded)
        return {r.request_id: t for r, t in zip(inputs.sample_requests, tokens, strict=True)}

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        # Decodes first, so that they form one contiguous run read by one batched call.
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        device = self.device

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sample_requests: list[Request] = []
        bs = self.block_size
        for s in ordered:
            table = s.block_table
            input_ids.extend(s.request.tokens_slice(s.start, s.end))
            positions.extend(range(s.start, s.end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(s.start, s.end))
            if s.samples_next_token:
                logits_indices.append(len(input_ids) - 1)
                sample_requests.append(s.request)

        # Build only what the attention path of this model reads.
        in_place = self.model.attention.reads_pool_in_place(self.model.dtype)
        decode_tables = decode_mask = context_lens = None
        if decodes:
            context_lens = torch.tensor([s.end for s in decodes], device=device)
            num_table = self.num_blocks_for(max(s.end for s in decodes))
            decode_tables = torch.tensor([_padded(s.block_table, num_table) for s in decodes], device=device)
            if not in_place:  # the gathered path masks the padding; the kernel reads the lengths
                pos = torch.arange(num_table * bs, device=device)
                decode_mask = (pos.unsqueeze(0) < context_lens.unsqueeze(1)).view(len(decodes), 1, 1, -1)

        segments: list[PrefillSegment] = []
        offset = len(decodes)
        for s in prefills:
            start, end = offset, offset + s.num_new_tokens
            offset = end
            if s.start == 0 or in_place:  # the kernel takes every segment from `prefill_tables`
                segments.append(PrefillSegment(start, end, None, None))
                continue
            num_table = self.num_blocks_for(s.end)
            blocks = torch.tensor(s.block_table[:num_table], device=device)
            context = torch.arange(num_table * bs, device=device)
            query_pos = torch.arange(s.start, s.end, device=device)
            mask = context.unsqueeze(0) <= query_pos.unsqueeze(1)
            segments.append(PrefillSegment(start, end, blocks, mask))

        prefill_tables = None
        if prefills and in_place:
            num_table = self.num_blocks_for(max(s.end for s in prefills))
            prefill_tables = PrefillTables(
                query_starts=torch.tensor([seg.start - len(decodes) for seg in segments], device=device),
                query_lens=torch.tensor([s.num_new_tokens for s in prefills], device=device),
                context_starts=torch.tensor([s.start for s in prefills], device=device),
                block_tables=torch.tensor([_padded(s.block_table, num_table) for s in prefills], device=device),
            )
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.tensor(slot_mapping, device=device),
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=context_lens,
            decode_mask=decode_mask,
            prefills=segments,
            prefill_tables=prefill_tables,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, device=device),
            positions=torch.tensor(positions, device=device),
            attn_meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            sample_requests=sample_requests,
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _padded(table: list[int], length: int) -> list[int]:
    return table[:length] + [0] * (length - len(table))
