"""The paged-attention paths agree: compiled CPU decode kernel, gathered-block PyTorch path,
and a dense reference computed without any paging."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from inflight.engine.memory import huge_page_zeros
from inflight.model.attention import PagedAttention, SeqSlice, alibi_slopes
from inflight.model.kernels import cpu_kernels

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


@contextmanager
def on_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` (the kernels cut their work by them), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def scattered_pool(kv_heads: int, dim: int, num_blocks: int = 40,
                   seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A random K and V pool of `num_blocks` blocks, and the blocks in a random order (to hand out
    as block tables: a context's blocks scattered over the pool)."""
    torch.manual_seed(seed)
    return (torch.randn(num_blocks * BLOCK, kv_heads, dim), torch.randn(num_blocks * BLOCK, kv_heads, dim),
            torch.randperm(num_blocks).tolist())


def dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    slopes: torch.Tensor | None = None) -> torch.Tensor:
    """One query [H, D] against a contiguous context [L, KV, D] (its last `window` positions;
    scores soft-capped by `softcap`, as transformers' Gemma 2 computes them; with `sinks` [H],
    each head's sink a score more in its softmax, weighing no value, as transformers' gpt-oss
    computes them; with ALiBi's `slopes` [H], head h's score of the key d positions back minus
    slopes[h] * d, as transformers' BLOOM computes them), in float64 from the same fp32 inputs so
    that each path's own rounding is what a comparison sees."""
    q, keys, values = q.double(), keys.double(), values.double()
    if window is not None:
        keys, values = keys[-window:], values[-window:]
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    if softcap is None and sinks is None and slopes is None:
        return F.scaled_dot_product_attention(q.unsqueeze(1), k, v).squeeze(1).float()
    scores = (q.unsqueeze(1) @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if slopes is not None:
        scores = scores + slopes.double().view(-1, 1, 1) * torch.arange(1 - k.shape[1], 1, dtype=torch.float64)
    if sinks is not None:
        with_sinks = torch.cat([scores, sinks.double().view(-1, 1, 1)], dim=-1)
        return (torch.softmax(with_sinks, dim=-1)[..., :-1] @ v).squeeze(1).float()
    return (torch.softmax(scores, dim=-1) @ v).squeeze(1).float()


# How far from the float64 reference each path may be. The compiled kernels' arithmetic is ours:
# fp32 rounding only (measured below 2e-6 here). The PyTorch path goes through torch's own batched
# GEMMs, whose precision depends on the CPU they pick a kernel for: on one CI machine a soft-capped
# decode came within 1.05e-4, on this Ice Lake within 1e-6. Paging, masking or capping mistakes
# move outputs by 1e-2 or more, far past either bound.
KERNEL_TOL = {"atol": 1e-5, "rtol": 1e-5}
TORCH_TOL = {"atol": 3e-4, "rtol": 1e-4}


# (window, softcap): full attention, a sliding window that starts inside a block, and Gemma 2's
# soft-capping (scores are ~N(0, 8) here, so a cap of 5 changes them).
ATTENDS = [(None, None), (21, None), (None, 5.0), (9, 5.0)]


# (heads, kv heads, head dim): the model's shape, multi-head, a wide group, the kernel's
# 128-wide specialisation and its generic head-size path.
HEAD_SHAPES = [(HEADS, KV_HEADS, DIM), (4, 4, 64), (8, 1, 64), (4, 2, 128), (6, 3, 40)]


def check_decode(kernel, heads: int, kv_heads: int, dim: int, lens: list[int], window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None,
                 slopes: torch.Tensor | None = None) -> None:
    """The decode path against the dense reference, for requests of these context lengths
    whose blocks are scattered through the pool."""
    k_cache, v_cache, order = scattered_pool(kv_heads, dim, sum(-(-n // BLOCK) for n in lens) + 8, seed=0)
    tables, contexts = [], []
    for n in lens:
        blocks = [order.pop() for _ in range(-(-n // BLOCK))]
        tables.append(blocks)
        slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)], dtype=torch.long)
        contexts.append((k_cache[slots], v_cache[slots]))
    q = torch.randn(len(lens), heads, dim) * 2
    attention = PagedAttention(heads, kv_heads, dim, kernel, windows=[window], softcap=softcap, alibi_slopes=slopes)
    meta = attention.build_metadata([SeqSlice(n - 1, 1, t) for n, t in zip(lens, tables, strict=True)], len(lens),
                                    torch.zeros(0, dtype=torch.long), BLOCK, torch.float32, torch.device("cpu"))
    out = attention._decode(q, k_cache, v_cache, meta, window, sinks)
    for i, (keys, values) in enumerate(contexts):
        expected = dense_reference(q[i], keys, values, window, softcap, sinks, slopes)
        torch.testing.assert_close(out[i], expected, **(KERNEL_TOL if kernel is not None else TORCH_TOL))


@pytest.mark.parametrize("window,softcap", ATTENDS)
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES)
@pytest.mark.parametrize("use_kernel", [False, True])
def test_decode_paths_match_dense_reference(use_kernel, heads, kv_heads, dim, window, softcap):
    kernel = cpu_kernels() if use_kernel else None
    if use_kernel and kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    check_decode(kernel, heads, kv_heads, dim, [1, 15, 16, 17, 130], window, softcap)


@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (6, 3, 40)])
@pytest.mark.parametrize("lens", [[300], [1, 200], [64, 17, 90]], ids=["one", "two", "three"])
def test_decode_kernel_splits_the_contexts_of_few_requests(lens, heads, kv_heads, dim, window):
    """Fewer requests than twice the threads: the kernel splits each context into parts on
    different threads and merges them; the result is the unsplit attention."""
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    with on_threads(2):
        check_decode(kernel, heads, kv_heads, dim, lens, window)


def test_decode_kernel_gives_zeros_for_an_empty_context():
    """A request with no cached token (not produced by the engine, but a valid input) yields
    zeros and leaves its neighbour's result alone, split or not."""
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(8 * BLOCK, KV_HEADS, DIM), torch.randn(8 * BLOCK, KV_HEADS, DIM)
    q = torch.randn(2, HEADS, DIM)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    out = kernel.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([0, 64]), BLOCK, DIM ** -0.5)
    assert torch.equal(out[0], torch.zeros(HEADS, DIM))
    slots = torch.arange(4 * BLOCK, 8 * BLOCK)
    torch.testing.assert_close(out[1], dense_reference(q[1], k_cache[slots], v_cache[slots]), **KERNEL_TOL)


def gathered_prefill(attention: PagedAttention, cached: int, new: int) -> tuple[torch.Tensor, ...]:
    """A request's `new` tokens after `cached` ones in blocks 5 and 2 of a pool, for the PyTorch
    path: (q, the context's keys and values, the K and V pools holding the cached ones, the
    step's metadata)."""
    torch.manual_seed(1)
    k_cache = torch.zeros(8 * BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros(8 * BLOCK, KV_HEADS, DIM)
    blocks = [5, 2]
    keys, values = torch.randn(cached + new, KV_HEADS, DIM), torch.randn(cached + new, KV_HEADS, DIM)
    slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(cached + new)])
    k_cache[slots[:cached]], v_cache[slots[:cached]] = keys[:cached], values[:cached]
    q = torch.randn(new, HEADS, DIM) * 2
    meta = attention.build_metadata([SeqSlice(cached, new, blocks)], 0, slots[cached:], BLOCK, torch.float32,
                                    torch.device("cpu"))
    return q, keys, values, k_cache, v_cache, meta


@pytest.mark.parametrize("window,softcap", ATTENDS)
@pytest.mark.parametrize("cached,new", [(20, 7), (0, 30)], ids=["cached-prefix", "whole-prompt"])
def test_gathered_prefill_matches_dense_reference(cached, new, window, softcap):
    """The PyTorch path: a chunk after cached tokens (their blocks gathered) and a whole prompt
    (its own new K/V), each with every window the layers have."""
    attention = PagedAttention(HEADS, KV_HEADS, DIM, windows=[None, window], softcap=softcap)
    q, keys, values, k_cache, v_cache, meta = gathered_prefill(attention, cached, new)
    for w in (None, window):
        out = attention.forward(q, keys[cached:], values[cached:], k_cache, v_cache, meta, window=w)
        for i in range(new):
            n = cached + i + 1
            expected = dense_reference(q[i], keys[:n], values[:n], w, softcap)
            torch.testing.assert_close(out.view(new, HEADS, DIM)[i], expected, **TORCH_TOL)


@pytest.mark.parametrize("window,softcap", ATTENDS)
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES)
def test_prefill_kernel_matches_dense_reference(heads, kv_heads, dim, window, softcap):
    """Several segments in one call: whole prompts and chunks after cached tokens, lengths
    around the kernel's 16-token tiles, blocks scattered over the pool."""
    segments = [(0, 2), (0, 37), (20, 7), (16, 16), (5, 1), (100, 45)]  # (cached tokens, new tokens)
    check_prefill_kernel(segments, heads, kv_heads, dim, window, softcap, num_blocks=96, seed=2)


def check_prefill_kernel(segments: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, window: int | None,
                         softcap: float | None, num_blocks: int, seed: int, sinks: torch.Tensor | None = None,
                         slopes: torch.Tensor | None = None) -> None:
    """The prefill kernel on `segments` (cached tokens, new tokens), each in blocks scattered over
    a random pool, against the dense reference, row by row."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    k_cache, v_cache, order = scattered_pool(kv_heads, dim, num_blocks, seed)
    tables, slots_of = [], []
    for cached, new in segments:
        blocks = [order.pop() for _ in range(-(-(cached + new) // BLOCK))]
        tables.append(blocks)
        slots_of.append(torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(cached + new)]))
    width = max(len(t) for t in tables)
    lens = [new for _, new in segments]
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    q = torch.randn(sum(lens), heads, dim) * 2
    out = kernels.paged_prefill_attention(
        q, k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables]), starts,
        torch.tensor(lens), torch.tensor([c for c, _ in segments]), BLOCK, dim ** -0.5, window or 0, softcap or 0.0,
        sinks, slopes)
    for (cached, new), start, slots in zip(segments, starts.tolist(), slots_of, strict=True):
        for i in range(new):
            visible = slots[: cached + i + 1]
            expected = dense_reference(q[start + i], k_cache[visible], v_cache[visible], window, softcap, sinks,
                                       slopes)
            torch.testing.assert_close(out[start + i], expected, **KERNEL_TOL)


@pytest.mark.parametrize("window,softcap", [(None, None), (200, None), (None, 5.0), (333, 5.0)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (8, 1, 64), (4, 2, 128)])
@pytest.mark.parametrize("segments", [[(700, 5)], [(300, 1), (451, 3)], [(129, 2)]], ids=["verify", "two", "short"])
@pytest.mark.parametrize("threads", [2, 3])
def test_prefill_kernel_splits_a_long_context_of_few_new_tokens(segments, heads, kv_heads, dim, window, softcap,
                                                                threads):
    """A few new tokens after a long context (a speculative verify) make fewer work items than
    the threads: each item's context is cut into parts on several threads, merged by their
    softmax statistics; every row still attends causally to what it sees, windows included."""
    with on_threads(threads):
        check_prefill_kernel(segments, heads, kv_heads, dim, window, softcap, num_blocks=160, seed=3)


def head_sinks(heads: int) -> torch.Tensor:
    """Attention sinks of the scores' size here (about N(0, 2)): each takes a share of its head's
    weight that ranges from little to most."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(5)) * 3


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (8, 1, 64), (6, 3, 40)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_decode_with_attention_sinks_matches_dense_reference(use_kernel, heads, kv_heads, dim, window):
    """gpt-oss's sinks (a score per head that joins the softmax's sum and weighs no value) in the
    decode paths: contexts of one part, and on two threads contexts cut into parts folded together
    on one thread or after the threads' work, each part's maximum then the fold's."""
    kernel = cpu_kernels() if use_kernel else None
    if use_kernel and kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    check_decode(kernel, heads, kv_heads, dim, [1, 15, 17, 130], window, sinks=head_sinks(heads))
    if kernel is not None:
        with on_threads(2):
            for lens in ([300], [1, 200], [64, 17, 90], [300] * 6):
                check_decode(kernel, heads, kv_heads, dim, lens, window, sinks=head_sinks(heads))


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (8, 1, 64), (6, 3, 40)])
def test_prefill_kernel_with_attention_sinks_matches_dense_reference(heads, kv_heads, dim, window):
    """The sinks in the prefill kernel: whole prompts and chunks, a context past a part (folded
    in the item), and on two threads a few new tokens after a long context (parts folded after)."""
    sinks = head_sinks(heads)
    check_prefill_kernel([(0, 2), (0, 37), (20, 7), (5, 1), (300, 45)], heads, kv_heads, dim, window, None,
                         num_blocks=96, seed=2, sinks=sinks)
    with on_threads(2):
        check_prefill_kernel([(700, 5)], heads, kv_heads, dim, window, None, num_blocks=96, seed=3, sinks=sinks)


@pytest.mark.parametrize("cached,new", [(20, 7), (0, 30)], ids=["cached-prefix", "whole-prompt"])
def test_gathered_prefill_with_attention_sinks_matches_dense_reference(cached, new):
    """The PyTorch path's prefill with sinks: after cached tokens, and a whole prompt."""
    attention = PagedAttention(HEADS, KV_HEADS, DIM, windows=[None])
    sinks = head_sinks(HEADS)
    q, keys, values, k_cache, v_cache, meta = gathered_prefill(attention, cached, new)
    out = attention.forward(q, keys[cached:], values[cached:], k_cache, v_cache, meta, sinks=sinks)
    for i in range(new):
        expected = dense_reference(q[i], keys[:cached + i + 1], values[:cached + i + 1], sinks=sinks)
        torch.testing.assert_close(out.view(new, HEADS, DIM)[i], expected, **TORCH_TOL)


# ALiBi's slopes of BLOOM's and MPT's (a max bias of 8), and larger ones (a max bias of 2: slopes
# 0.5 to 0.89 among 9 heads, most weight on the last few tokens): the bias is in every score.
ALIBI = [8.0, 2.0]


@pytest.mark.parametrize("max_bias", ALIBI)
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (8, 1, 64), (6, 3, 40), (4, 2, 128)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_decode_with_alibi_matches_dense_reference(use_kernel, heads, kv_heads, dim, window, max_bias):
    """ALiBi (BLOOM's, MPT's) in the decode paths: each score biased by the key's distance from
    the query, contexts of one part, and on two threads cut into parts folded on one thread or
    after the threads' work (each part's bias from the same query position)."""
    kernel = cpu_kernels() if use_kernel else None
    if use_kernel and kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    slopes = alibi_slopes(heads, max_bias)
    check_decode(kernel, heads, kv_heads, dim, [1, 15, 17, 130], window, slopes=slopes)
    if kernel is not None:
        with on_threads(2):
            for lens in ([300], [1, 200], [64, 17, 90], [300] * 6):
                check_decode(kernel, heads, kv_heads, dim, lens, window, slopes=slopes)


@pytest.mark.parametrize("max_bias", ALIBI)
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (8, 1, 64), (6, 3, 40), (4, 2, 128)])
def test_prefill_kernel_with_alibi_matches_dense_reference(heads, kv_heads, dim, window, max_bias):
    """ALiBi in the prefill kernel: whole prompts and chunks, each row's bias from its own
    position, a context past a part, and on two threads a few new tokens after a long context."""
    slopes = alibi_slopes(heads, max_bias)
    check_prefill_kernel([(0, 2), (0, 37), (20, 7), (5, 1), (300, 45)], heads, kv_heads, dim, window, None,
                         num_blocks=96, seed=2, slopes=slopes)
    with on_threads(2):
        check_prefill_kernel([(700, 5)], heads, kv_heads, dim, window, None, num_blocks=96, seed=3, slopes=slopes)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["alibi", "alibi-and-sinks"])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("cached,new", [(20, 7), (0, 30)], ids=["cached-prefix", "whole-prompt"])
def test_gathered_prefill_with_alibi_matches_dense_reference(cached, new, window, with_sinks):
    """The PyTorch path's prefill with ALiBi (float masks holding each head's bias): after cached
    tokens, and a whole prompt (no longer the plain causal mask); beside attention sinks too (the
    path that computes the softmax itself adds the float mask)."""
    slopes = alibi_slopes(HEADS, 2.0)
    sinks = head_sinks(HEADS) if with_sinks else None
    attention = PagedAttention(HEADS, KV_HEADS, DIM, windows=[None, window], alibi_slopes=slopes)
    q, keys, values, k_cache, v_cache, meta = gathered_prefill(attention, cached, new)
    for w in (None, window):
        out = attention.forward(q, keys[cached:], values[cached:], k_cache, v_cache, meta, window=w, sinks=sinks)
        for i in range(new):
            expected = dense_reference(q[i], keys[:cached + i + 1], values[:cached + i + 1], w, sinks=sinks,
                                       slopes=slopes)
            torch.testing.assert_close(out.view(new, HEADS, DIM)[i], expected, **TORCH_TOL)


# A request's attention must not depend on who shares its step: the engine promises a request the
# same tokens and logprobs, bit for bit, alone or batched, chunked or not, verifying proposed
# tokens or decoding them one at a time. Companions of a request: none, one, a few of very
# different lengths, as many as the threads, many.
COMPANIONS = [[], [50], [10, 20, 900], [100, 300, 7], [30] * 20]


@pytest.mark.parametrize("window,softcap", ATTENDS)
@pytest.mark.parametrize("length", [40, 200, 700])
@pytest.mark.parametrize("threads", [2, 3])
def test_decode_kernel_gives_a_request_its_own_result_whatever_the_batch(length, window, softcap, threads):
    """One request's decode attention, alone and beside each set of COMPANIONS (in front of them,
    behind them): bit for bit the same (on a given number of threads)."""
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    with on_threads(threads):
        k_cache, v_cache, order = scattered_pool(KV_HEADS, DIM, num_blocks=200, seed=4)
        target = order[: -(-length // BLOCK)]
        q = torch.randn(HEADS, DIM) * 2

        def attend(lengths: list[int], at: int) -> torch.Tensor:
            """The target's result among requests of `lengths` (the target at index `at`), whose
            blocks are taken after the target's."""
            free = iter(order[len(target):])
            tables = [[next(free) for _ in range(-(-n // BLOCK))] for n in lengths]
            lengths, tables = lengths[:at] + [length] + lengths[at:], tables[:at] + [target] + tables[at:]
            width = max(len(t) for t in tables)
            queries = torch.randn(len(lengths), HEADS, DIM) * 2
            queries[at] = q
            out = kernel.paged_decode_attention(queries, k_cache, v_cache,
                                                torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                                                torch.tensor(lengths), BLOCK, DIM ** -0.5, window or 0, softcap or 0.0)
            return out[at]

        alone = attend([], 0)
        slots = torch.tensor([target[t // BLOCK] * BLOCK + t % BLOCK for t in range(length)])
        torch.testing.assert_close(alone, dense_reference(q, k_cache[slots], v_cache[slots], window, softcap),
                                   **KERNEL_TOL)
        for companions in COMPANIONS:
            for at in {0, len(companions)}:
                assert torch.equal(attend(companions, at), alone), (companions, at)


@pytest.mark.parametrize("window,softcap", ATTENDS)
@pytest.mark.parametrize("length", [100, 125, 400, 1000])
@pytest.mark.parametrize("threads", [2, 3])
def test_decode_kernel_gives_a_verifys_rows_what_each_gets_alone(length, window, softcap, threads):
    """A speculative verify: 8 rows of one context, each seeing one token more (125 crosses a block
    boundary), which the kernel reads together; alone, after another such verify, and beside a
    request of the same blocks but a different cut: each row bit for bit its result alone."""
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    with on_threads(threads):
        k_cache, v_cache, order = scattered_pool(KV_HEADS, DIM, num_blocks=160, seed=6)
        table, other = order[:70], order[70:140]
        lengths = [length + i for i in range(8)]
        q = torch.randn(len(lengths), HEADS, DIM) * 2

        def attend(rows: list[tuple[list[int], int, torch.Tensor]]) -> torch.Tensor:
            out = kernel.paged_decode_attention(torch.stack([r[2] for r in rows]), k_cache, v_cache,
                                                torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                                                BLOCK, DIM ** -0.5, window or 0, softcap or 0.0)
            return out

        alone = [attend([(table, n, q[i])])[0] for i, n in enumerate(lengths)]
        verify = [(table, n, q[i]) for i, n in enumerate(lengths)]
        noise = torch.randn(8, HEADS, DIM)
        for rows, at in [(verify, 0), ([(other, 300 + i, noise[i]) for i in range(8)] + verify, 8),
                         (verify + [(table, 20, noise[0])], 0)]:
            out = attend(rows)
            for i in range(len(lengths)):
                assert torch.equal(out[at + i], alone[i]), (at, i)


@pytest.mark.parametrize("window,softcap", [(None, None), (300, None), (None, 5.0)])
@pytest.mark.parametrize("threads", [2, 3])
def test_prefill_kernel_gives_each_row_its_own_result_however_chunked_or_batched(window, softcap, threads):
    """A 700-token prompt's rows, computed as one segment, then in chunks of very different sizes
    (a single token, a few, one that crosses a part's start, the rest), each chunk alone in its call
    or beside other segments: every row bit for bit the same."""
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    with on_threads(threads):
        length = 700
        k_cache, v_cache, order = scattered_pool(KV_HEADS, DIM, num_blocks=120, seed=5)
        prompt = order[: -(-length // BLOCK)]
        others = [order[len(prompt):][i * 4:(i + 1) * 4] for i in range(3)]  # three 64-token contexts
        q = torch.randn(length, HEADS, DIM) * 2

        def rows(chunk: tuple[int, int], companions: int) -> torch.Tensor:
            """The prompt's rows [start, end) computed as one segment of a call, after `companions`
            other segments (chunks of the other contexts)."""
            start, end = chunk
            segments = [(others[i], 40, 9 + 10 * i) for i in range(companions)] + [(prompt, start, end - start)]
            width = max(len(t) for t, _, _ in segments)
            queries = torch.cat([torch.randn(n, HEADS, DIM) for _, _, n in segments[:-1]] + [q[start:end]])
            lens = [n for _, _, n in segments]
            out = kernel.paged_prefill_attention(
                queries, k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t, _, _ in segments]),
                torch.tensor([0, *lens[:-1]]).cumsum(0), torch.tensor(lens), torch.tensor([c for _, c, _ in segments]),
                BLOCK, DIM ** -0.5, window or 0, softcap or 0.0)
            return out[-(end - start):]

        whole = rows((0, length), 0)
        slots = torch.tensor([prompt[t // BLOCK] * BLOCK + t % BLOCK for t in range(length)])
        for i in (0, 255, 256, 699):
            expected = dense_reference(q[i], k_cache[slots[: i + 1]], v_cache[slots[: i + 1]], window, softcap)
            torch.testing.assert_close(whole[i], expected, **KERNEL_TOL)
        for chunk in [(0, 250), (250, 251), (251, 256), (256, 270), (270, 519), (519, 700)]:
            for companions in (0, 1, 3):
                assert torch.equal(rows(chunk, companions), whole[chunk[0]:chunk[1]]), (chunk, companions)


@pytest.mark.parametrize("shape", [(3, 5), (30, 2, 4096, 3, 64)], ids=["tiny", "pool"])
def test_huge_page_pool_is_zeroed_aligned_and_reads_like_any_tensor(shape):
    pool = huge_page_zeros(*shape, dtype=torch.float32)
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    if pool.numel() * 4 >= 2 * 1024 * 1024:
        assert pool.data_ptr() % (2 * 1024 * 1024) == 0
    pool.view(-1)[-1] = 7.0  # the whole view is usable, to its last element
    assert pool.sum() == 7.0


# ---- A 16-bit pool (`--kv-cache-dtype bfloat16|float16`): the kernels widen each value exactly
# as they read it, so their results are the fp32 kernels' over the pool widened up front, bit for
# bit; the KV store rounds to nearest even, as torch's `.to()` does.

KV_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("window,softcap", ATTENDS)
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES)
def test_kernels_on_a_16_bit_pool_equal_fp32_kernels_on_its_values(heads, kv_heads, dim, window, softcap, kv_dtype):
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    k32, v32, order = scattered_pool(kv_heads, dim)
    k16, v16 = k32.to(kv_dtype), v32.to(kv_dtype)
    kw, vw = k16.float(), v16.float()
    lens = [1, 17, 130, 40]
    tables = torch.tensor([order[i * 9:(i + 1) * 9] for i in range(len(lens))])
    q = torch.randn(len(lens), heads, dim) * 2
    for threads in (1, 2):  # unsplit, and contexts split over threads and merged
        args = (tables, torch.tensor(lens), BLOCK, dim ** -0.5, window or 0, softcap or 0.0)
        with on_threads(threads):
            assert torch.equal(kernels.paged_decode_attention(q, k16, v16, *args),
                               kernels.paged_decode_attention(q, kw, vw, *args))
    segments = [(0, 37), (20, 7), (100, 30)]  # (cached tokens, new tokens)
    lens_new = [n for _, n in segments]
    qp = torch.randn(sum(lens_new), heads, dim)
    args = (tables[:3], torch.tensor([0, *lens_new[:-1]]).cumsum(0), torch.tensor(lens_new),
            torch.tensor([c for c, _ in segments]), BLOCK, dim ** -0.5, window or 0, softcap or 0.0)
    assert torch.equal(kernels.paged_prefill_attention(qp, k16, v16, *args),
                       kernels.paged_prefill_attention(qp, kw, vw, *args))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("kv_heads,dim", [(3, 64), (1, 6)], ids=["vectors", "tail"])
def test_kv_store_into_a_16_bit_pool_rounds_as_torch(kv_dtype, kv_heads, dim):
    """The rotary kernel's store: each key and value rounded to nearest even, as `.to()`
    rounds them (a row of 6 values exercises the scalar tail beside the 8-wide conversion)."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    torch.manual_seed(4)
    heads, n = 2 * kv_heads, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim) * 3
    qkv[0, heads * dim] = 1e-6  # below fp16's normal range: a subnormal
    qkv[1, heads * dim] = 70000.0  # past fp16's largest: infinity, as torch rounds it
    positions = torch.arange(n)
    angles = torch.arange(n + 1).unsqueeze(1) * torch.rand(dim)
    cos, sin = angles.cos(), angles.sin()
    k_cache, v_cache = torch.zeros(16, kv_heads, dim, dtype=kv_dtype), torch.zeros(16, kv_heads, dim, dtype=kv_dtype)
    slots = torch.tensor([9, 3, 14, 0, 7])
    rotated = qkv.clone()
    kernels.rotary_qk_(rotated, positions, cos, sin, heads, kv_heads, dim)
    kernels.rotary_qk_(qkv, positions, cos, sin, heads, kv_heads, dim, k_cache, v_cache, slots)
    assert torch.equal(qkv, rotated)  # the activations stay fp32
    k, v = rotated[:, heads * dim:].view(n, 2, kv_heads, dim).unbind(1)
    assert torch.equal(k_cache[slots].view(torch.int16), k.to(kv_dtype).view(torch.int16))
    assert torch.equal(v_cache[slots].view(torch.int16), v.to(kv_dtype).view(torch.int16))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("cached,new", [(20, 7), (0, 30)], ids=["cached-prefix", "whole-prompt"])
def test_paths_on_a_16_bit_pool_read_the_values_it_holds(cached, new, kv_dtype):
    """Prefill and decode through the gathered PyTorch path and the compiled kernels, a 16-bit
    pool: each agrees with the dense reference over the rounded K/V (a whole prompt's own
    new K/V included); the kernels' results are farther from the unrounded one."""
    torch.manual_seed(5)
    blocks = [5, 2, 6]
    keys, values = torch.randn(cached + new + 1, KV_HEADS, DIM), torch.randn(cached + new + 1, KV_HEADS, DIM)
    rounded_k, rounded_v = keys.to(kv_dtype).float(), values.to(kv_dtype).float()
    slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(cached + new + 1)])
    q = torch.randn(new + 1, HEADS, DIM) * 2
    for kernels in (None, cpu_kernels()):
        attention = PagedAttention(HEADS, KV_HEADS, DIM, kernels)
        tol = KERNEL_TOL if kernels is not None else TORCH_TOL
        k_cache = torch.zeros(8 * BLOCK, KV_HEADS, DIM, dtype=kv_dtype)
        v_cache = torch.zeros(8 * BLOCK, KV_HEADS, DIM, dtype=kv_dtype)
        k_cache[slots[:cached]], v_cache[slots[:cached]] = keys[:cached].to(kv_dtype), values[:cached].to(kv_dtype)
        end = cached + new
        meta = attention.build_metadata([SeqSlice(cached, new, blocks)], 0, slots[cached:end], BLOCK,
                                        torch.float32, torch.device("cpu"))
        out = attention.forward(q[:new], keys[cached:end], values[cached:end], k_cache, v_cache, meta)
        meta = attention.build_metadata([SeqSlice(end, 1, blocks)], 1, slots[end:end + 1], BLOCK,
                                        torch.float32, torch.device("cpu"))
        decoded = attention.forward(q[new:], keys[end:], values[end:], k_cache, v_cache, meta)
        for i, row in enumerate([*out.view(new, HEADS, DIM), decoded.view(HEADS, DIM)]):
            n = cached + i + 1
            expected = dense_reference(q[i], rounded_k[:n], rounded_v[:n])
            torch.testing.assert_close(row, expected, **tol)
            if kernels is not None:  # fp32-exact to 2e-6: the rounding (1e-4 and more) shows
                unrounded = dense_reference(q[i], keys[:n], values[:n])
                assert (row - expected).abs().max() < (row - unrounded).abs().max()
