"""Every instruction-set branch of the CPU kernels, on whatever machine the suite runs: the
kernel and decoder-stack tests again against each build below this CPU's own (an AVX-512 machine
tests its AVX2 and portable code too, an AVX2 machine its portable code), and the AVX-512 branch
at least compiled where the CPU cannot run it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from inflight.model import kernels

ROOT = Path(__file__).resolve().parent.parent
# The tests that compare the kernels with PyTorch references and the compiled layers with the
# Python loop, token for token.
KERNEL_TESTS = ["tests/test_linear.py", "tests/test_token_ops.py", "tests/test_attention.py",
                "tests/test_decoder_stack.py", "tests/test_int8.py", "tests/test_gguf_a8.py",
                "tests/test_greedy_head.py", "tests/test_bf16.py", "tests/test_kernel_tuning.py"]
# The emulated AVX-VNNI build differs from the AVX2 one in its integer matmuls alone (the greedy
# screen runs on them).
TARGET_TESTS = {"avx2_vnni_emulated": ["tests/test_int8.py", "tests/test_gguf_a8.py", "tests/test_greedy_head.py"]}


def _branch(extra_flags: list[str]) -> str | None:
    """The branch the compiler would take with these flags (None if it rejects them)."""
    cmd = [os.environ.get("CXX", "c++"), *kernels.CFLAGS, *extra_flags, "-dM", "-E", "-x", "c++", "-"]
    try:
        out = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if "__AVX512F__ " in out:
        return "avx512"
    if "__AVX2__ " in out:  # with AVX-VNNI's int8 matmul where the CPU has it (or it is emulated)
        return "avx2+avx-vnni" if "__AVXVNNI__ " in out or "INFLIGHT_EMULATE_AVX_VNNI " in out else "avx2"
    return "generic"


def _checked_targets() -> dict[str, str]:
    """Target -> branch, for each build below this CPU's native one that the compiler has."""
    native = kernels.cpu_kernels()
    if native is None:
        return {}
    branches = {t: _branch(flags) for t, flags in kernels.TARGETS.items() if t != "native"}
    return {t: b for t, b in branches.items() if b is not None and b != native.isa()}


# Branches the CPU may not run, compiled at least: the flags that select each (in place of
# -march=native), and what the suite says of it.
COMPILE_CHECKS = {"avx512": (["-march=x86-64-v4"], "AVX-512"),
                  "avx2+avx-vnni": (["-march=x86-64-v3", "-mavxvnni"], "AVX-VNNI (vpdpbusd on 256 bits)")}


def _compile_check(branch: str) -> tuple[list[str], Path] | str:
    """The command that compiles `branch` here (where the CPU cannot run it) and the stamp that
    remembers its success, or why there is nothing to check."""
    flags, what = COMPILE_CHECKS[branch]
    native = kernels.cpu_kernels()
    if native is None:
        return "no C++ compiler for the CPU kernels"
    if native.isa() == branch:
        return f"this CPU runs the {what} branch, which the rest of the suite tests"
    if _branch(flags) != branch:
        return f"the compiler here has no {what} target"
    from torch.utils.cpp_extension import include_paths

    compiler = os.environ.get("CXX", "c++")
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    cmd = [compiler, *[f for f in kernels.CFLAGS if not f.startswith("-march")], *flags, "-std=c++17", "-fPIC",
           "-DTORCH_EXTENSION_NAME=inflight_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
           "-c", str(kernels.SOURCE), "-o", os.devnull]
    # A success is remembered for this source, these flags and this compiler, as torch's
    # extension cache remembers a build.
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([kernels.SOURCE.read_text(), *cmd, version]).encode()).hexdigest()[:16]
    return cmd, Path.home() / ".cache" / "inflight" / "compile-checks" / f"{branch}-{key}.ok"


def test_the_native_build_compiles_wherever_a_compiler_runs() -> None:
    """The kernel tests skip where no kernels load (no compiler): a source that fails to compile
    must fail here instead of leaving the suite green on skips."""
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        pytest.skip("INFLIGHT_CPU_KERNELS=0: the kernels are turned off")
    if _branch([]) is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    if kernels.cpu_kernels() is None:  # the build failed: build it again here, for the compiler's message
        kernels.load_kernels(kernels.kernel_target())
    assert kernels.cpu_kernels() is not None


@pytest.fixture(scope="module")
def builds() -> dict[str, subprocess.Popen[str] | str]:
    """Each checked build compiled (or found in the cache) by a process of its own, and the
    compile checks, all started at once: a compile runs on one core, and most of its time
    (most of a minute) is spent parsing torch's headers. scripts/setup.sh has usually compiled
    them already (`prebuild`), and then each process only loads its build from the cache.
    Target (or "BRANCH-check") -> its process, or why not."""
    procs: dict[str, subprocess.Popen[str] | str] = {t: _build(t) for t in _checked_targets()}
    for branch in COMPILE_CHECKS:
        check = _compile_check(branch)
        if isinstance(check, str):
            procs[f"{branch}-check"] = check
        elif not check[1].exists():
            procs[f"{branch}-check"] = subprocess.Popen(check[0], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                        text=True)
    yield procs
    for proc in procs.values():
        if isinstance(proc, subprocess.Popen) and proc.poll() is None:
            proc.kill()
            proc.wait()


def prebuild() -> int:
    """Compiles what this file checks ahead of the suite, all at once (scripts/setup.sh runs it
    beside its other steps): the builds land in the kernel cache and each compile check leaves its
    stamp, so that the tests find them done. A failure here is left for the tests to report."""
    procs = {t: _build(t) for t in _checked_targets()}
    stamps = {}
    for branch in COMPILE_CHECKS:
        check = _compile_check(branch)
        if not isinstance(check, str) and not check[1].exists():
            procs[f"{branch}-check"] = subprocess.Popen(check[0], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                        text=True)
            stamps[f"{branch}-check"] = check[1]
    for name, proc in procs.items():
        done = _finished(proc)
        if done.returncode != 0:
            print(f"setup: the {name} kernel build failed; tests/test_kernel_builds.py will say why", file=sys.stderr)
        elif name in stamps:
            stamps[name].parent.mkdir(parents=True, exist_ok=True)
            stamps[name].touch()
    print(f"inflight CPU kernels checked by the suite: {', '.join(procs) or 'none below this CPU'}")
    return 0


def _build(target: str) -> subprocess.Popen[str]:
    """A process that compiles (or finds in the cache) the `target` build and prints its branch."""
    code = "import sys; from inflight.model.kernels import load_kernels; print(load_kernels(sys.argv[1]).isa())"
    return subprocess.Popen([sys.executable, "-c", code, target], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finished(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out or "", err or "")


def _rerun(target: str) -> subprocess.Popen[str]:
    """The kernel tests against the `target` build, in a process of their own."""
    # INFLIGHT_LINEAR: the portable build's matmul too, which the engine takes only when named,
    # and with it the compiled layers. OMP_WAIT_POLICY: the reruns share the cores, and threads
    # that spin while they wait would take them from each other.
    env = {**os.environ, "INFLIGHT_CPU_KERNELS_TARGET": target, "INFLIGHT_LINEAR": "inflight",
           "OMP_WAIT_POLICY": "PASSIVE"}
    # Less the GIL test and the int8 calibration: the binding that releases the GIL and the fit of
    # an int8 engine's timings are the same code in every branch (the fit measures a branch's speed,
    # not its results), and the portable branch's slow matmuls made them the longest tests of the
    # rerun (17 s of its 46 s on 2 Zen 4 cores, the calibration alone).
    return subprocess.Popen([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-rs",
                             "-k", "not release_the_gil and not int8_calibration",
                             *TARGET_TESTS.get(target, KERNEL_TESTS)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# A checked build's outcome and the rerun of the kernel tests against it (None where it failed).
Rerun = tuple[subprocess.CompletedProcess[str], subprocess.Popen[str] | None]


@pytest.fixture(scope="module")
def reruns(builds: dict[str, subprocess.Popen[str] | str]) -> dict[str, Rerun]:
    """Each checked build's outcome and the rerun of the kernel tests against it (None where the
    build failed), the reruns all started at once: most of a rerun's time is one thread of
    Python between small matmuls, so on 2 cores three reruns side by side took 54 s where one
    after another took 73 s (2 Zen 4 cores)."""
    done: dict[str, Rerun] = {}
    for target in _checked_targets():
        proc = builds[target]
        assert isinstance(proc, subprocess.Popen)
        build = _finished(proc)
        done[target] = (build, _rerun(target) if build.returncode == 0 else None)
    yield done
    for _, run in done.values():
        if run is not None and run.poll() is None:
            run.kill()
            run.wait()


@pytest.mark.parametrize("target", [t for t in kernels.TARGETS if t != "native"])
def test_each_build_passes_the_kernel_tests(target: str, reruns: dict[str, Rerun]) -> None:
    native = kernels.cpu_kernels()
    if native is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    branch = _branch(kernels.TARGETS[target])
    if branch is None:
        pytest.skip(f"the compiler here has no {target} target")
    if branch == native.isa():
        pytest.skip(f"the {target} build is this CPU's native {branch} code, which the rest of the suite tests")
    build, run = reruns[target]
    assert build.returncode == 0, build.stdout[-6000:]  # a build that fails says so here
    assert build.stdout.split()[-1] == branch, build.stdout[-2000:]
    assert run is not None
    out, _ = run.communicate(timeout=900)
    assert f"inflight CPU kernels: {branch} ({target} build)" in out, out[-3000:]
    assert run.returncode == 0, out[-6000:]
    assert " passed" in out and " failed" not in out, out[-3000:]


@pytest.mark.parametrize("branch", list(COMPILE_CHECKS))
def test_the_branches_this_cpu_cannot_run_compile(branch: str, builds: dict[str, subprocess.Popen[str] | str]) -> None:
    """Where the CPU has no AVX-512 (or no AVX-VNNI) that branch cannot run here, but it must
    still build."""
    check = _compile_check(branch)
    if isinstance(check, str):
        pytest.skip(check)
    proc = builds.get(f"{branch}-check")
    if proc is None:  # remembered from an earlier success
        return
    assert isinstance(proc, subprocess.Popen)
    run = _finished(proc)
    assert run.returncode == 0, run.stderr[-6000:]
    check[1].parent.mkdir(parents=True, exist_ok=True)
    check[1].touch()


def test_a_build_killed_while_compiling_does_not_hang_the_next_load() -> None:
    """torch's builder leaves its `lock` file behind when killed mid-compile; the next load
    (here of the cached native build) must not wait on it for ever."""
    if kernels.cpu_kernels() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    build_dir = Path(kernels.cpu_kernels().__file__).parent
    (build_dir / "lock").touch()
    code = "from inflight.model.kernels import load_kernels; print(load_kernels('native').isa())"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == kernels.cpu_kernels().isa()
    assert not (build_dir / "lock").exists()


if __name__ == "__main__":
    sys.exit(prebuild())
