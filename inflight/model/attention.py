"""Paged attention: the one interface between the model and where KV lives.

The KV pool of a layer is a pair of tensors `[num_slots, num_kv_heads, head_dim]`; slot
`block_id * block_size + offset` holds one token. The runner hands the backend each step's
plain description (`SeqSlice`s and the slots to write); the backend builds from it, once per
step, the `AttentionMetadata` its own kernels read, and every layer calls
`PagedAttention.forward` with that. A faster kernel replaces this class, not the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    """A request that computes several new tokens this step (a prompt or a chunk of one).

    `block_table` is None when the request has no cached context: its new K/V are all it
    attends to, with a plain causal mask (or, longer than a sliding window, a mask `[num_new,
    num_new]`). Otherwise it lists the blocks of the whole context (cached tokens, then the new
    ones) and each mask is `[num_new, num_blocks * block_size]`. `masks` holds one per attention
    window of the model's layers (None: full attention), None where the plain causal mask is it.
    With ALiBi each is a float mask `[1, num_heads, num_new, context]` instead: each head's bias,
    -inf where a query does not see.
    """

    start: int
    end: int
    block_table: torch.Tensor | None
    masks: dict[int | None, torch.Tensor | None]


@dataclass(slots=True)
class AttentionMetadata:
    """How the packed tokens of one step map onto the paged KV cache.

    The first `num_decode_tokens` packed tokens are single-token decodes, one per request, whose
    contexts are read in one batched call: `decode_block_tables` is `[num_decodes, max_blocks]`
    (padded with block 0) and `decode_masks`, one per attention window of the model's layers
    (None: full attention), `[num_decodes, 1, 1, max_blocks * block_size]` each, mark the
    positions each query sees (with ALiBi, float masks `[num_decodes, num_kv_heads, group_size,
    max_blocks * block_size]`: each head's bias, -inf where it does not see). The remaining tokens
    belong to `prefills`.
    """

    block_size: int
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_masks: dict[int | None, torch.Tensor]
    prefills: list[PrefillSegment]
    prefill_tables: PrefillTables | None = None
    # For a model with short convolutions (LFM2): each packed token's slots of the `conv_kernel`
    # positions its convolution reads, `[num_tokens, conv_kernel]`, oldest first, the token's own
    # last (-1 before the first position); None in a model without them.
    conv_slots: torch.Tensor | None = None
    # `PagedAttention.build_metadata` fills either the gathered path's inputs (`decode_masks`,
    # each segment's `block_table` and `masks`) or the compiled kernels' (`prefill_tables`).


@dataclass(slots=True)
class PrefillTables:
    """All prefill segments of a step for the compiled CPU prefill kernel, one row each:
    `query_starts` (row offsets among the prefill tokens), `query_lens`, `context_starts` (tokens
    already cached before the segment) and `block_tables` `[num_segments, max_blocks]`."""

    query_starts: torch.Tensor
    query_lens: torch.Tensor
    context_starts: torch.Tensor
    block_tables: torch.Tensor


class SeqSlice(NamedTuple):
    """One request's share of a step's packed tokens, as the runner hands it to the backend:
    `num_new_tokens` queries at positions `start..start + num_new_tokens` of a context whose KV
    lives in `block_table`'s blocks."""

    start: int
    num_new_tokens: int
    block_table: list[int]

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


class PagedAttention:
    """Paged attention: writes the step's K/V into their slots, then attends with
    scaled_dot_product_attention over gathered blocks. With `kernels` (the compiled CPU
    kernels of `kernels.py`), fp32 decodes and prefills read the pool in place instead: one
    call per layer for all decodes and one for all prefill segments."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernels: object = None,
                 scale: float | None = None, windows: Sequence[int | None] = (None,),
                 softcap: float | None = None, conv_kernel: int = 0, alibi_slopes: torch.Tensor | None = None) -> None:
        """`scale`: the softmax scale of q.k (None: head_dim ** -0.5). `windows`: the attention
        windows of the model's layers, each layer's given to `forward`: a query attends to the
        last `window` positions only, itself included (sliding-window attention; None: all
        before it). `softcap`: scores become softcap * tanh(score / softcap) (Gemma 2).
        `conv_kernel`: the taps of the model's short convolutions, whose metadata then carries
        `conv_slots` (0: none). `alibi_slopes`: ALiBi's (BLOOM's, MPT's), `[num_heads]` fp32, head
        h's score of key position j for a query at position i plus slope_h * (j - i); None: none."""
        if alibi_slopes is not None and softcap is not None:
            raise ValueError("ALiBi with soft-capped scores is not built")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self._sdpa_scale = scale  # None: SDPA's own 1 / sqrt(head_dim)
        self.windows = tuple(dict.fromkeys(windows))
        self.softcap = softcap
        self.group_size = num_heads // num_kv_heads
        self.kernels = kernels
        self.conv_kernel = conv_kernel
        self.alibi_slopes = alibi_slopes

    def reads_pool_in_place(self, dtype: torch.dtype) -> bool:
        """Whether the compiled kernels serve this dtype: they read the pool through block tables
        and lengths (and windows), so no masks or per-segment gathers are needed."""
        return self.kernels is not None and dtype == torch.float32

    def build_metadata(self, seqs: Sequence[SeqSlice], num_decodes: int, slot_mapping: torch.Tensor,
                       block_size: int, dtype: torch.dtype, device: torch.device) -> AttentionMetadata:
        """What this backend's kernels read for a step whose packed tokens are `seqs`' in order:
        the first `num_decodes` are decodes (one generated token each, read in one batched call),
        the rest prompts or chunks of them, of any length. Only the path that will run is built:
        block tables and lengths for the compiled kernels, masks and per-segment block lists for
        the gathered one."""
        decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
        if any(s.num_new_tokens != 1 for s in decodes):
            raise ValueError("a decode computes exactly one token")
        in_place = self.reads_pool_in_place(dtype)
        decode_tables = context_lens = None
        decode_masks: dict[int | None, torch.Tensor] = {}
        if decodes:
            context_lens = torch.tensor([s.end for s in decodes], device=device)
            num_table = _num_blocks(max(s.end for s in decodes), block_size)
            decode_tables = torch.tensor([_padded(s.block_table, num_table) for s in decodes], device=device)
            if not in_place:  # the gathered path masks the padding; the kernel reads the lengths
                pos = torch.arange(num_table * block_size, device=device).unsqueeze(0)
                for window in self.windows:
                    visible = pos < context_lens.unsqueeze(1)
                    if window is not None:
                        visible &= pos >= context_lens.unsqueeze(1) - window
                    decode_masks[window] = (visible.view(len(decodes), 1, 1, -1) if self.alibi_slopes is None else
                                            self._alibi_mask(visible, context_lens - 1, pos[0]).view(
                                                len(decodes), self.num_kv_heads, self.group_size, -1))

        segments: list[PrefillSegment] = []
        offset = num_decodes
        for s in prefills:
            start, end = offset, offset + s.num_new_tokens
            offset = end
            if in_place:  # the kernel takes every segment from `prefill_tables`
                segments.append(PrefillSegment(start, end, None, {}))
                continue
            blocks = None  # a whole prompt attends to its own new K/V
            context = torch.arange(s.start, s.end, device=device)
            if s.start > 0:
                num_table = _num_blocks(s.end, block_size)
                blocks = torch.tensor(_padded(s.block_table, num_table), device=device)
                context = torch.arange(num_table * block_size, device=device)
            query_pos = torch.arange(s.start, s.end, device=device).unsqueeze(1)
            masks: dict[int | None, torch.Tensor | None] = {}
            for window in self.windows:
                if blocks is None and (window is None or s.num_new_tokens <= window) and self.alibi_slopes is None:
                    masks[window] = None  # plain causal
                    continue
                mask = context.unsqueeze(0) <= query_pos
                if window is not None:
                    mask &= context.unsqueeze(0) > query_pos - window
                masks[window] = mask if self.alibi_slopes is None else \
                    self._alibi_mask(mask, query_pos.squeeze(1), context).transpose(0, 1).unsqueeze(0)
            segments.append(PrefillSegment(start, end, blocks, masks))

        prefill_tables = None
        if prefills and in_place:
            num_table = _num_blocks(max(s.end for s in prefills), block_size)
            prefill_tables = PrefillTables(
                query_starts=torch.tensor([seg.start - num_decodes for seg in segments], device=device),
                query_lens=torch.tensor([s.num_new_tokens for s in prefills], device=device),
                context_starts=torch.tensor([s.start for s in prefills], device=device),
                block_tables=torch.tensor([_padded(s.block_table, num_table) for s in prefills], device=device),
            )
        conv_slots = None
        if self.conv_kernel:
            taps = range(1 - self.conv_kernel, 1)
            conv_slots = torch.tensor(
                [[_slot(s.block_table, p + j, block_size) for j in taps] for s in seqs for p in range(s.start, s.end)],
                dtype=torch.long, device=device).view(-1, self.conv_kernel)
        return AttentionMetadata(
            block_size=block_size,
            slot_mapping=slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_tables=decode_tables,
            decode_context_lens=context_lens,
            decode_masks=decode_masks,
            prefills=segments,
            prefill_tables=prefill_tables,
            conv_slots=conv_slots,
        )

    def _alibi_mask(self, visible: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """`[queries, num_heads, keys]` for `visible` `[queries, keys]`: each head's ALiBi bias of
        each key for each query, -inf where the query does not see it."""
        assert self.alibi_slopes is not None
        distance = (key_pos.unsqueeze(0) - query_pos.unsqueeze(1)).to(self.alibi_slopes.dtype)
        bias = self.alibi_slopes.to(distance.device).view(1, -1, 1) * distance.unsqueeze(1)
        return bias.masked_fill(~visible.unsqueeze(1), float("-inf"))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_stored: bool = False,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: `[num_tokens, num_heads, head_dim]`, k/v: `[num_tokens, num_kv_heads, head_dim]`.
        Returns `[num_tokens, num_heads * head_dim]`. `kv_stored`: the caller has already
        written k/v into their slots (fused with the rotary embedding). `window`: the layer's,
        one of `windows`. `sinks`: the layer's attention sinks `[num_heads]` (gpt-oss), a score
        per head that joins each softmax's sum without a value. The caches may hold a narrower
        type than q (`--kv-cache-dtype`): attention then reads every K and V, the step's own
        too, as the pool holds them."""
        if not kv_stored:
            k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
            v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        num_decodes = meta.num_decode_tokens
        if num_decodes == q.shape[0]:  # a decode-only step: the decode path's result is the output
            decoded = self._decode(q, k_cache, v_cache, meta, window, sinks)
            return decoded.view(q.shape[0], self.num_heads * self.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], k_cache, v_cache, meta, window, sinks)
        tables = meta.prefill_tables
        if tables is not None and self.reads_pool_in_place(q.dtype):
            out[num_decodes:] = self.kernels.paged_prefill_attention(  # type: ignore[attr-defined]
                q[num_decodes:].contiguous(), k_cache, v_cache, tables.block_tables, tables.query_starts,
                tables.query_lens, tables.context_starts, meta.block_size, self.scale, window or 0,
                self.softcap or 0.0, sinks, self.alibi_slopes,
            )
        else:
            for seg in meta.prefills:
                out[seg.start:seg.end] = self._prefill(q, k, v, k_cache, v_cache, seg, meta.block_size, window, sinks)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, block_size: int,
                dtype: torch.dtype) -> torch.Tensor:
        """The K or V of whole blocks, `[*block_table.shape[:-1], num_blocks * block_size, kv, dim]`,
        as `dtype`. Copying whole blocks moves contiguous runs of memory instead of single slots."""
        blocks = cache.view(-1, block_size * self.num_kv_heads * self.head_dim)
        gathered = blocks.index_select(0, block_table.reshape(-1)).to(dtype)
        return gathered.view(*block_table.shape[:-1], -1, self.num_kv_heads, self.head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        if self.reads_pool_in_place(q.dtype):
            return self.kernels.paged_decode_attention(  # type: ignore[attr-defined]
                q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                meta.block_size, self.scale, window or 0, self.softcap or 0.0, sinks, self.alibi_slopes,
            )
        batch = meta.decode_block_tables.shape[0]
        keys = self._gather(k_cache, meta.decode_block_tables, meta.block_size, q.dtype)
        values = self._gather(v_cache, meta.decode_block_tables, meta.block_size, q.dtype)
        # One query per request: the query heads sharing a KV head stand in the "query length"
        # dimension of their group, so GQA needs no repeated K/V.
        grouped_q = q.view(batch, self.num_kv_heads, self.group_size, self.head_dim)
        grouped_sinks = sinks.view(self.num_kv_heads, self.group_size, 1) if sinks is not None else None
        out = self._attend(grouped_q, keys.transpose(1, 2), values.transpose(1, 2), meta.decode_masks[window], False,
                           grouped_sinks)
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seg: PrefillSegment,
        block_size: int,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        query = q[seg.start:seg.end].transpose(0, 1).unsqueeze(0)
        mask = seg.masks[window]
        if seg.block_table is None:  # its own new K/V (as the pool holds them): causal, or windowed by its mask
            keys = k[seg.start:seg.end].to(k_cache.dtype).to(q.dtype)
            values = v[seg.start:seg.end].to(v_cache.dtype).to(q.dtype)
        else:
            keys = self._gather(k_cache, seg.block_table, block_size, q.dtype)
            values = self._gather(v_cache, seg.block_table, block_size, q.dtype)
        out = self._attend(query, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), mask,
                           mask is None, sinks.view(-1, 1, 1) if sinks is not None else None)
        return out[0].transpose(0, 1)

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q.k * scale, masked) . v over `[..., heads, tokens, dim]` (keys and values with
        one head per group of query heads); with `softcap`, the scores are capped first, and with
        `sinks` (a score per query head, shaped to broadcast against `[..., heads, queries, 1]`)
        the softmax's sum takes each head's sink too: neither can SDPA do."""
        gqa = query.shape[-3] != keys.shape[-3]
        if self.softcap is None and sinks is None:
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal,
                                                  scale=self._sdpa_scale, enable_gqa=gqa)
        if gqa:
            group = query.shape[-3] // keys.shape[-3]
            keys, values = keys.repeat_interleave(group, -3), values.repeat_interleave(group, -3)
        scores = query @ keys.transpose(-1, -2) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        if mask is not None:  # (a float mask: ALiBi's bias, -inf where unseen)
            scores = scores + mask if mask.is_floating_point() else scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values
        sink = sinks.float().expand(*scores.shape[:-1], 1)  # one more score per row, without a value
        weights = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1]
        return weights.to(values.dtype) @ values


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi's slopes (Press et al.; BLOOM's, MPT's, llama.cpp's `max_alibi_bias`): for n heads
    and n' the power of two at or above, 2 ** (-max_bias * i / n') for i = 1..n'; where n' > n,
    the even i first, then the odd, the first n of those."""
    padded = 1 << max(0, (num_heads - 1).bit_length())
    slopes = [2.0 ** (-max_bias * i / padded) for i in range(1, padded + 1)]
    if padded != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return torch.tensor(slopes, dtype=torch.float32)


def _num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _padded(table: list[int], length: int) -> list[int]:
    """`table` cut or padded to `length` blocks, with block 0 standing in for those that left a
    sliding window (`NULL_BLOCK`, negative): the kernels never read them, the gathered path masks
    them."""
    return [max(b, 0) for b in table[:length]] + [0] * (length - len(table))


def _slot(table: list[int], position: int, block_size: int) -> int:
    """The pool slot of `position` in a request's `table`; -1 before its first position."""
    if position < 0:
        return -1
    return table[position // block_size] * block_size + position % block_size
