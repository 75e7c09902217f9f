"""Optional C++ kernels for CPU, compiled on first use with torch's extension builder and
cached (under $INFLIGHT_CACHE, default ~/.cache/inflight: `kernel-builds/`). Where no compiler
is at hand, or INFLIGHT_CPU_KERNELS=0, callers fall back to the plain-PyTorch path.

The source has three instruction-set branches (AVX-512, AVX2 with FMA, and portable C++ that
the compiler vectorises as it can; the int8 matmul also one for AVX2 with AVX-VNNI); `-march=native`
picks the widest this CPU runs. The other
`TARGETS` build the same machine's code with the wider extensions turned off, so that one machine
can build and test every branch below its own (INFLIGHT_CPU_KERNELS_TARGET; the suite does it in
tests/test_kernel_builds.py)."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

from inflight.errors import ConfigError
from inflight.model import kernel_tuning

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# fast-math lets GCC vectorise the softmax's exp and the dot-product reductions; -fopenmp makes
# at::parallel_for run in parallel (without it the pragma is dropped and the kernel runs on one
# thread). The .so then needs libgomp.so.1, which is the copy torch already loaded, so there is
# still one OpenMP runtime in the process.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp"]


# Extra flags of each build after -march=native; each names the branch it compiles where the
# CPU has that extension (on a CPU without AVX-512, "native" and "avx2" are the same code).
TARGETS: dict[str, list[str]] = {
    "native": [],
    "avx2": ["-mno-avx512f"],  # turns off every AVX-512 subset
    "generic": ["-mno-avx2", "-mno-avx512f"],
    # The AVX2 branch with AVX-VNNI's int8 matmul, vpdpbusd's sums made from AVX2 instructions: for
    # the suite, which tests that kernel's logic on any AVX2 CPU (an AVX-VNNI part builds it natively).
    "avx2_vnni_emulated": ["-mno-avx512f", "-DINFLIGHT_EMULATE_AVX_VNNI"],
}


def _cpu_tag() -> str:
    """A short digest of the CPU's feature flags: the kernel is built with -march=native, so a
    cache directory shared by different machines must not hand one machine's build to another."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def _environment_tag() -> str:
    """A short digest of the headers a build compiles against (torch's and Python's, by path and
    torch's version)."""
    import sysconfig

    import torch
    from torch.utils.cpp_extension import include_paths

    where = [*include_paths(), sysconfig.get_paths()["include"], torch.__version__]
    return hashlib.sha256("\0".join(where).encode()).hexdigest()[:8]


def kernel_target() -> str:
    """The build the engine loads: INFLIGHT_CPU_KERNELS_TARGET, "native" unless set."""
    target = os.environ.get("INFLIGHT_CPU_KERNELS_TARGET", "native").strip().lower() or "native"
    if target not in TARGETS:
        raise ConfigError(f"INFLIGHT_CPU_KERNELS_TARGET={target!r}: give one of {', '.join(TARGETS)}")
    return target


def _cache_root() -> Path:
    return Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))


def _stable_source(text: bytes, digest: str) -> Path:
    """The source (`text`) copied to a path named by its contents ($INFLIGHT_CACHE/kernel-sources):
    the build rules name the source's path, so two checkouts of the same code (a clone beside the
    working tree, CI's fresh one) would otherwise each rebuild the cached module in turn."""
    stable = _cache_root() / "kernel-sources" / digest / SOURCE.name
    if not stable.is_file():
        stable.parent.mkdir(parents=True, exist_ok=True)
        tmp = stable.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(text)
        os.replace(tmp, stable)
    return stable


def load_kernels(target: str = "native") -> ModuleType:
    """Builds (or finds in the cache) the kernels for `target` and loads them; raises if the
    compiler fails. Builds of different targets load side by side."""
    from torch.utils.cpp_extension import load

    # Named by the CPU, the source and the Python environment too: two checkouts of different
    # code (a working tree and a clone of main under test) each keep their own build instead of
    # rebuilding one in turn, which also swapped the library under a process that was loading
    # it; and two environments (each checkout's .venv) compile with their own headers, whose
    # paths are in the build's command, so one name shared by both was compiled again (about a
    # minute) each time the other had built it.
    text = SOURCE.read_bytes()
    digest = hashlib.sha256(text).hexdigest()[:16]
    suffix = "" if target == "native" else f"_{target}"
    name = f"inflight_cpu_kernels_{_cpu_tag()}_{digest[:8]}_{_environment_tag()}{suffix}"
    build_dir = _cache_root() / "kernel-builds" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's builder marks a build in progress with a `lock` file that a process killed while
    # compiling leaves behind, and every later load then waits on it for ever. Builds of one
    # name take this lock first, which the system drops with its holder: whoever holds it is
    # the only builder, so a `lock` file found then is stale.
    with open(build_dir.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return load(
            name=name,
            build_directory=str(build_dir),
            sources=[str(_stable_source(text, digest))],
            extra_cflags=CFLAGS + TARGETS[target],
            extra_ldflags=LDFLAGS,
            verbose=False,
        )


def build_dir_of(module: ModuleType) -> Path:
    """Where a loaded build lives (its cached library's directory), beside its tuning record."""
    return Path(str(module.__file__)).parent


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, or None if it is disabled or cannot be built."""
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        return None
    target = kernel_target()
    try:
        logger.info("loading inflight's CPU kernels (%s build; compiled once, then cached)", target)
        module = load_kernels(target)
    except Exception as exc:  # no compiler, no ninja, an odd platform: the torch path still works
        logger.warning("CPU kernels unavailable (%s); using the PyTorch path",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    tune(module)
    return module


def tune(module: ModuleType) -> None:
    """Sets the build's per-machine choices (`kernel_tuning`); where their timing cannot run (it
    needs about 0.5 GB for a moment), the kernels keep their defaults."""
    try:
        kernel_tuning.apply(module, build_dir_of(module))
    except Exception as exc:
        logger.warning("fp32 matmul tuning skipped (%s); the kernels' defaults are used",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def build() -> None:
    """Builds (or finds) the cached module and says where it is; `scripts/setup.sh` runs this so
    that the first `inflight serve` does not wait for the compiler."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = cpu_kernels()
    where = f"{module.isa()} branch, {module.__file__}" if module else "unavailable (PyTorch fallback paths)"
    print(f"inflight CPU kernels: {where}")
    if module is not None:
        print(f"fp32 matmul tuning for this CPU: {kernel_tuning.describe(build_dir_of(module))}")
