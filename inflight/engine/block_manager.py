"""The paged KV pool's bookkeeping: which blocks each request owns, and the prefix cache.

Pure Python (no torch): the runner owns the tensors, this class only hands out block ids.

Prefix caching: a block full of computed tokens is registered under a hash chained over the
whole token prefix up to its end, so equal hashes mean equal KV. Blocks are reference-counted;
a block nobody references goes to the back of the free queue but keeps its hash, so a later
request with the same prefix can take it back. Allocation takes from the front of the queue,
evicting the least recently freed cached block.

Sliding windows: in a model whose every layer attends to its last `sliding_window` positions
only (Mistral v0.1), a block whose tokens no later query can see goes back to the pool as soon as
the request moves past it (vLLM's sliding-window KV manager does the same); its place in the
table becomes `NULL_BLOCK`, so positions keep their blocks' indices.

Parallel sampling (`n` > 1): `fork` gives a new request the blocks of another's prompt, each
referenced once more. The last of them may be partly filled; whichever request first writes
into a block that others still hold gets a private copy (copy on write): `allocate_slots`
swaps it into that request's table and records (source, destination) for the runner, which
copies the KV before the step's forward pass (`take_copies`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from inflight.request import Request

# The parent of a prompt's first block. Not None: before Python 3.12, None hashes by its address,
# which differs between processes.
_ROOT = 0x9E3779B97F4A7C15
# A table entry whose block left the sliding window and went back to the pool.
NULL_BLOCK = -1


def chain_hash(parent: int | None, block_tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: its tokens chained to the key of the block before
    (None for the first). Python hashes ints and tuples of ints the same way in every process,
    so a router in another process computes the same keys (`block_hashes`)."""
    return hash((_ROOT if parent is None else parent, tuple(block_tokens)))


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of every full block of `token_ids`, as the block manager computes them."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: every layer of the model attends to that many last positions, so
        blocks before them are released as requests advance (None: every block is kept)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # prefix hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> blocks already in the cache
        self._num_released: dict[str, int] = {}  # request id -> leading table entries out of the window
        self.peak_used_blocks = 0
        self.num_allocation_failures = 0
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks to copy before the next step

    # --- counters ---------------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def peak_usage(self) -> float:
        return self.peak_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ---------------------------------------------------------------------------

    def _full_block_hashes(self, request: Request) -> list[int]:
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, request.tokens_slice(i * bs, (i + 1) * bs)))
        return hashes

    def cached_block_hashes(self) -> list[int]:
        """The keys of every block in the prefix cache (in use or evictable): what a prefix-aware
        router needs to know of this pool."""
        return list(self._cached)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens. At least one token is always
        left to compute, since the step that computes it produces the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in self._full_block_hashes(request):
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._full_block_hashes(request)
        for i in range(start, num_full):
            block, h = table[i], hashes[i]
            if block != NULL_BLOCK and self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._cached[h] = block
        self._num_registered[rid] = num_full

    # --- allocation -----------------------------------------------------------------------------

    def _shared_write_block(self, request: Request) -> int | None:
        """The index in the request's table of the block its next token goes into, if other
        requests hold that block too (a forked prompt's last block)."""
        table = self._tables.get(request.request_id)
        i = request.num_computed_tokens // self.block_size
        if table is not None and i < len(table) and self._ref_cnt[table[i]] > 1:
            return i
        return None

    def _num_needed(self, request: Request, num_tokens: int, computed_blocks: Sequence[int]) -> tuple[int, int]:
        """(new blocks to take from the free queue, free blocks that the cache hits revive)."""
        have = len(self._tables.get(request.request_id, ())) + len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self._ref_cnt[b] == 0)
        copy = 1 if self._shared_write_block(request) is not None else 0
        return max(0, self.num_blocks_for(num_tokens) - have) + copy, revived

    def can_allocate(self, request: Request, num_tokens: int, computed_blocks: Sequence[int] = (),
                     reserve: int = 0) -> bool:
        """Whether the request's table can grow to hold `num_tokens` tokens with `reserve` free
        blocks left over; counts nothing."""
        need, revived = self._num_needed(request, num_tokens, computed_blocks)
        return need + revived + reserve <= len(self._free)

    def allocate_slots(self, request: Request, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Grows the request's block table (after `computed_blocks`, its prefix-cache hits) to
        hold `num_tokens` tokens. Returns False, changing nothing else, when the pool is short;
        either way, with a sliding window, first releases the blocks the request's next tokens
        can no longer see."""
        self._release_out_of_window(request)
        need, revived = self._num_needed(request, num_tokens, computed_blocks)
        if need + revived > len(self._free):
            self.num_allocation_failures += 1
            return False
        shared = self._shared_write_block(request)
        if shared is not None:  # copy on write
            table = self._tables[request.request_id]
            source, copy = table[shared], self._take_free()
            self._ref_cnt[source] -= 1
            table[shared] = copy
            self._copies.append((source, copy))
            need -= 1
        table = self._tables.setdefault(request.request_id, [])
        for block in computed_blocks:
            if self._ref_cnt[block] == 0:
                del self._free[block]
            self._ref_cnt[block] += 1
            table.append(block)
        if computed_blocks:
            self._num_registered[request.request_id] = len(table)
        for _ in range(need):
            table.append(self._take_free())
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return True

    def _release_out_of_window(self, request: Request) -> None:
        """Returns to the pool the request's blocks wholly before the window of its next token
        (at position `num_computed_tokens`, which sees the last `sliding_window` positions)."""
        if self.sliding_window is None:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        end = min(max(0, first_visible) // self.block_size, len(table))
        for i in range(self._num_released.get(rid, 0), end):
            block = table[i]
            if block != NULL_BLOCK:
                table[i] = NULL_BLOCK
                self._unref(block)
        self._num_released[rid] = max(end, self._num_released.get(rid, 0))

    def _unref(self, block: int) -> None:
        self._ref_cnt[block] -= 1
        if self._ref_cnt[block] == 0:
            self._free[block] = None

    def _take_free(self) -> int:
        """The front of the free queue, its cached hash (if any) evicted, referenced once."""
        block, _ = self._free.popitem(last=False)
        evicted = self._block_hash[block]
        if evicted is not None:
            del self._cached[evicted]
            self._block_hash[block] = None
        self._ref_cnt[block] = 1
        return block

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Gives `child` the parent's blocks that hold its first `num_tokens` tokens, shared."""
        blocks = self._tables[parent.request_id][:self.num_blocks_for(num_tokens)]
        for block in blocks:
            if block != NULL_BLOCK:
                self._ref_cnt[block] += 1
        self._tables[child.request_id] = list(blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past those that hold `num_tokens` tokens (slots of
        proposed tokens that were not kept: never full of computed tokens, so never cached)."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        while len(table) > keep:
            block = table.pop()
            if block != NULL_BLOCK:
                self._unref(block)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies made since the last call, for the runner to carry out."""
        copies, self._copies = self._copies, []
        return copies

    def free(self, request_id: str) -> None:
        """Releases the request's blocks; tail blocks go first in the eviction order, since
        they are the least likely to be shared."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._num_released.pop(request_id, None)
        for block in reversed(table):
            if block != NULL_BLOCK:
                self._unref(block)

    def num_live_tokens(self, requests: Sequence[Request]) -> int:
        """Allocated KV slots that hold a token of one of `requests` (the unfinished ones): each
        request's computed tokens within its table, a block shared by k tables (prefix-cache
        hits and forks, full blocks) counted once. Blocks held for requests not in `requests`
        (the static policy's finished members) hold none."""
        bs = self.block_size
        mine = 0
        for r in requests:
            table = self._tables.get(r.request_id, ())
            released = table.count(NULL_BLOCK) if self.sliding_window is not None else 0
            mine += max(0, min(r.num_computed_tokens, len(table) * bs) - released * bs)
        held = sum(len(t) - (t.count(NULL_BLOCK) if self.sliding_window is not None else 0)
                   for t in self._tables.values())
        return max(0, mine - (held - self.num_used_blocks) * bs)

    def reset_peak(self) -> None:
        self.peak_used_blocks = self.num_used_blocks

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (used by tests)."""
        owners = [0] * self.num_blocks
        for rid, table in self._tables.items():
            held = [b for b in table if b != NULL_BLOCK]
            assert len(set(held)) == len(held), "a block appears twice in one table"
            assert self.sliding_window is not None or len(held) == len(table), "a released block without a window"
            assert table[:len(table) - len(held)] == [NULL_BLOCK] * (len(table) - len(held)), (
                f"{rid}: a released block after a held one")
            for block in held:
                owners[block] += 1
        for block in range(self.num_blocks):
            assert owners[block] == self._ref_cnt[block], (
                f"block {block}: refcount {self._ref_cnt[block]} != owners {owners[block]}")
            assert (self._ref_cnt[block] == 0) == (block in self._free), (
                f"block {block}: free queue disagrees with refcount")
            if owners[block] > 1 and self._block_hash[block] is None:  # forked: at one place in every table
                assert len({t.index(block) for t in self._tables.values() if block in t}) == 1, (
                    f"block {block} shared but neither a cached prefix block nor a forked prompt's")
        for h, block in self._cached.items():
            assert self._block_hash[block] == h
