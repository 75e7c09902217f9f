"""Optional C++ kernels for CPU, compiled on first use with torch's extension builder and
cached (in $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Where no compiler is at
hand, or INFLIGHT_CPU_KERNELS=0, callers fall back to the plain-PyTorch path."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# fast-math lets GCC vectorise the softmax's exp and the dot-product reductions; -fopenmp makes
# at::parallel_for run in parallel (without it the pragma is dropped and the kernel runs on one
# thread). The .so then needs libgomp.so.1, which is the copy torch already loaded, so there is
# still one OpenMP runtime in the process.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp"]


def _cpu_tag() -> str:
    """A short digest of the CPU's feature flags: the kernel is built with -march=native, so a
    cache directory shared by different machines must not hand one machine's build to another."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, or None if it is disabled or cannot be built."""
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading inflight's CPU kernels (compiled once, then cached)")
        return load(
            name=f"inflight_cpu_kernels_{_cpu_tag()}",
            sources=[str(_SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, an odd platform: the torch path still works
        logger.warning("CPU kernels unavailable (%s); using the PyTorch path",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def build() -> None:
    """Builds (or finds) the cached module and says where it is; `scripts/setup.sh` runs this so
    that the first `inflight serve` does not wait for the compiler."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = cpu_kernels()
    print(f"inflight CPU kernels: {module.__file__ if module else 'unavailable (PyTorch fallback paths)'}")
