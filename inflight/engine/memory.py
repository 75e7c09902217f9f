"""Process-wide allocator settings and page-backed buffers for CPU inference."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_configured = False


def keep_freed_memory() -> None:
    """Stops glibc from handing freed tensors back to the kernel.

    By default glibc serves allocations above 128 KiB with fresh mmap()s and unmaps them on
    free, so every step's activations (megabytes each) are page-faulted in anew: on a 2-core
    CPU that made a gather of cached KV blocks 8x slower than the copy itself. Raising the mmap
    and trim thresholds lets freed blocks be reused from the heap. A no-op off glibc.
    """
    global _configured
    if _configured:
        return
    _configured = True
    libc = _libc()
    if libc is None:
        return
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except AttributeError:  # not glibc
        return
    if not ok:
        logger.debug("mallopt refused the allocator settings")


_MADV_HUGEPAGE = 14  # Linux
_HUGE_PAGE = 2 * 1024 * 1024


def huge_page_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory Linux is asked to back with 2 MiB pages.

    The KV pool is read in 12 KiB blocks at random places: with 4 KiB pages nearly every block
    costs TLB misses, and the decode-attention kernel read a scattered pool 1.1-1.2x faster
    from 2 MiB pages (`benchmarks/kernels_bench.py`). The buffer is over-allocated by one huge
    page so that a 2 MiB-aligned view of it can be advised (MADV_HUGEPAGE) before it is first
    touched; the zeroing then faults it in as huge pages where the kernel has them (transparent
    huge pages "always" or "madvise"). Elsewhere, or if madvise fails, it is plain memory.
    """
    numel, itemsize = math.prod(shape), dtype.itemsize
    pad = _HUGE_PAGE // itemsize
    raw = torch.empty(numel + pad, dtype=dtype)
    offset = (-raw.data_ptr() % _HUGE_PAGE) // itemsize
    view = raw.narrow(0, offset, numel)
    libc = _libc()
    if libc is not None and numel * itemsize >= _HUGE_PAGE:
        length = numel * itemsize // _HUGE_PAGE * _HUGE_PAGE
        if libc.madvise(ctypes.c_void_p(view.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused; the buffer keeps normal pages")
    return view.zero_().view(shape)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None
