"""Turns a scheduler's plain-data step into tensors, runs the model and samples.

The only place where requests meet tensors: it owns the KV pool, packs the step's tokens, and
hands the attention backend the step's plain description, from which the backend builds, once
per step, the `AttentionMetadata` that every layer shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from inflight.engine.memory import huge_page_zeros, keep_freed_memory
from inflight.engine.sampler import Sampler
from inflight.engine.scheduler import ScheduledRequest, SchedulerOutput
from inflight.model.attention import AttentionMetadata, SeqSlice
from inflight.model.llama import LlamaModel
from inflight.request import Request, TokenLogprobs


class RunnerTimings(NamedTuple):
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class StepInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor  # the sampled rows first, then `prompt_rows`' rows
    sample_requests: list[Request]
    # Per sampled request, the proposed tokens it verifies: its rows are 1 + len(draft).
    drafts: list[list[int]]
    # Per request that wants prompt logprobs: (the first prompt position whose successor's
    # logprob this step computes, how many), for the rows after the sampled ones.
    prompt_rows: list[tuple[Request, int, int]]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, sampler: Sampler,
                 kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the pool's element type (None: the model's); a 16-bit pool beside fp32
        activations holds each K and V value rounded to nearest, widened as attention reads it."""
        cfg = model.config
        if model.device.type == "cpu":
            keep_freed_memory()
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = sampler
        # Zeroed, not empty: padded reads of unused slots must stay finite. The attending layers'
        # K and V (latent attention's one row, read as both), and beside them each short
        # convolution's input (LFM2's layers that convolve: one `hidden_size` row a token), in the
        # same blocks: a block id holds its tokens in both.
        slots = num_blocks * block_size
        conv = cfg.conv_layers or (False,) * cfg.num_layers
        self.kv_dtype = kv_dtype or model.dtype
        self.kv_cache = self._zeros((cfg.num_attention_layers, cfg.kv_rows, slots, cfg.num_kv_heads, cfg.head_dim))
        self.conv_cache = self._zeros((sum(conv), slots, cfg.hidden_size)) if any(conv) else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            if conv[i]:  # (its "V" is never read)
                assert self.conv_cache is not None
                own = self.conv_cache[sum(conv[:i])]
                self.kv_caches.append((own, own))
            else:
                at = i - sum(conv[:i])
                self.kv_caches.append((self.kv_cache[at, 0], self.kv_cache[at, -1]))
        # Test hook for fault injection: called with the step before the forward pass.
        self.before_forward: Callable[[SchedulerOutput], None] | None = None
        self.last_timings = RunnerTimings()
        self.last_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.last_prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return huge_page_zeros(*shape, dtype=self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
        return model.config.pool_values_per_token * block_size * (kv_dtype or model.dtype).itemsize

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Runs one step; returns the new tokens of each request that reached its last token (one,
        or with proposed tokens verified, those kept and one more)."""
        if self.before_forward is not None:
            self.before_forward(out)
        start = time.perf_counter()
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        inputs = self.prepare(out.scheduled)
        prepared = time.perf_counter()
        model = self.model
        normed = model.final_hidden(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_meta, inputs.logits_indices
        )
        requests, drafts = inputs.sample_requests, inputs.drafts
        rows, num_rows = [], 0  # each request's rows: its last known token's, then each proposal's
        for draft in drafts:
            rows.append(range(num_rows, num_rows + 1 + len(draft)))
            num_rows += 1 + len(draft)
        # Requests that want only their logits' argmax take it from the model's greedy head; the
        # others' rows, then the prompt rows, go through the fp32 head.
        screening = model.greedy_head is not None
        screened: list[int] = []
        kept: list[int] = []
        for i, request in enumerate(requests):
            (screened if screening and self.sampler.argmax_only(request) else kept).append(i)
        best: list[int] = []
        if screened:
            device = normed.device
            wanted = [r for i in kept for r in rows[i]] + list(range(num_rows, len(normed)))
            logits = (model.logits(normed.index_select(0, torch.tensor(wanted, dtype=torch.long, device=device)))
                      if wanted else normed.new_empty((0, model.lm_head.out_features)))
            greedy = torch.tensor([r for i in screened for r in rows[i]], dtype=torch.long, device=device)
            best = model.greedy_tokens(normed.index_select(0, greedy)).tolist()
        else:
            logits = model.logits(normed)
        forwarded = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in requests]
        at = 0
        for i in screened:
            tokens[i] = Sampler.kept_greedy(drafts[i], best[at:at + len(rows[i])])
            at += len(rows[i])
        kept_rows = sum(len(rows[i]) for i in kept)
        self.last_logprobs = {}
        if kept:
            kept_requests, kept_drafts = [requests[i] for i in kept], [drafts[i] for i in kept]
            sampled = self.sampler.sample(logits[:kept_rows], kept_requests, kept_drafts)
            for i, t in zip(kept, sampled, strict=True):
                tokens[i] = t
            self.last_logprobs = self.sampler.logprobs(logits[:kept_rows], kept_requests, sampled, kept_drafts)
        self.last_prompt_logprobs = self._prompt_logprobs(logits[kept_rows:], inputs.prompt_rows)
        self.last_timings = RunnerTimings(prepared - start, forwarded - prepared, time.perf_counter() - forwarded)
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies whole KV blocks, every layer's K and V and every convolution's inputs (copy on
        write of forked samples)."""
        source = torch.tensor([s for s, _ in copies], device=self.device)
        destination = torch.tensor([d for _, d in copies], device=self.device)
        kv = self.kv_cache
        blocks = kv.view(*kv.shape[:2], self.num_blocks, self.block_size, *kv.shape[3:])
        blocks[:, :, destination] = blocks[:, :, source]
        if self.conv_cache is not None:
            conv = self.conv_cache.view(self.conv_cache.shape[0], self.num_blocks, self.block_size, -1)
            conv[:, destination] = conv[:, source]

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        # Decodes first, so that they form one contiguous run read by one batched call. A request
        # verifying proposed tokens joins them as one decode per token (each attends to the KV up to
        # its own position, all written before attention runs): its rows are computed exactly as
        # decoding them one step at a time would, bit for bit.
        decodes = [s for s in scheduled if s.is_decode or s.spec_token_ids]
        ordered = decodes + [s for s in scheduled if not (s.is_decode or s.spec_token_ids)]
        device = self.device

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sample_requests: list[Request] = []
        drafts: list[list[int]] = []
        prompt_indices: list[int] = []
        prompt_rows: list[tuple[Request, int, int]] = []
        bs = self.block_size
        for s in ordered:
            table = s.block_table
            row = len(input_ids)  # of position s.start
            draft = s.spec_token_ids
            input_ids.extend(s.request.tokens_slice(s.start, s.end - len(draft)))
            input_ids.extend(draft)
            positions.extend(range(s.start, s.end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(s.start, s.end))
            if s.samples_next_token:
                logits_indices.extend(range(len(input_ids) - 1 - len(draft), len(input_ids)))
                sample_requests.append(s.request)
                drafts.append(draft)
            if s.request.needs_prompt_logits:
                # Position q's logits give prompt token q + 1's logprob; those not yet recorded.
                first = max(s.start, len(s.request.prompt_logprobs))
                end = min(s.end, s.request.num_prompt_tokens - 1)
                if end > first:
                    prompt_indices.extend(range(row + first - s.start, row + end - s.start))
                    prompt_rows.append((s.request, first, end - first))
        seqs = [SeqSlice(s.start + j, 1, s.block_table) for s in decodes for j in range(s.num_new_tokens)]
        seqs += [SeqSlice(s.start, s.num_new_tokens, s.block_table) for s in ordered[len(decodes):]]
        meta = self.model.attention.build_metadata(
            seqs, sum(s.num_new_tokens for s in decodes),
            torch.tensor(slot_mapping, device=device), bs, self.model.dtype, device)
        return StepInputs(
            input_ids=torch.tensor(input_ids, device=device),
            positions=torch.tensor(positions, device=device),
            attn_meta=meta,
            logits_indices=torch.tensor(logits_indices + prompt_indices, dtype=torch.long, device=device),
            sample_requests=sample_requests,
            drafts=drafts,
            prompt_rows=prompt_rows,
        )

    def greedy_last(self, pieces: Sequence[tuple[Sequence[int], int, list[int]]]) -> list[int]:
        """The greedy token after the last token of each piece, in order: (token ids, the position
        of the first, the block table their KV is written to). A draft model's step: its catch-up
        with a request's tokens, then one proposed token at a time. The argmax of the logits, from
        the model's greedy head where it has one."""
        normed = self._last_hidden(pieces)
        if self.model.greedy_head is not None:
            return self.model.greedy_tokens(normed).tolist()
        return self.model.logits(normed).argmax(dim=-1).tolist()

    def _last_hidden(self, pieces: Sequence[tuple[Sequence[int], int, list[int]]]) -> torch.Tensor:
        """The LM head's input at the last token of each piece (`greedy_last`), in order."""
        order = sorted(range(len(pieces)), key=lambda i: len(pieces[i][0]) != 1)  # decodes first
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        last = [0] * len(pieces)
        bs = self.block_size
        for i in order:
            tokens, start, table = pieces[i]
            input_ids.extend(tokens)
            last[i] = len(input_ids) - 1
            positions.extend(range(start, start + len(tokens)))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + len(tokens)))
        seqs = [SeqSlice(pieces[i][1], len(pieces[i][0]), pieces[i][2]) for i in order]
        device = self.device
        meta = self.model.attention.build_metadata(
            seqs, sum(len(pieces[i][0]) == 1 for i in order), torch.tensor(slot_mapping, device=device), bs,
            self.model.dtype, device)
        return self.model.final_hidden(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                                       self.kv_caches, meta, torch.tensor(last, dtype=torch.long, device=device))

    def _prompt_logprobs(self, logits: torch.Tensor,
                         rows: list[tuple[Request, int, int]]) -> dict[str, list[TokenLogprobs]]:
        out: dict[str, list[TokenLogprobs]] = {}
        offset = 0
        for request, first, count in rows:
            targets = request.prompt_token_ids[first + 1:first + 1 + count]
            k = request.sampling_params.prompt_logprobs or 0
            out[request.request_id] = self.sampler.token_logprobs(logits[offset:offset + count], targets, k)
            offset += count
        return out

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
