from __future__ import annotations

import functools
import gzip
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from inflight import LLM  # noqa: E402
from inflight.model.loaded import LoadedModel  # noqa: E402

# Varied prompts: short, long, code, non-English, list, math. Chat ones are added in tests.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Le petit prince demanda au renard pourquoi",
    "人工智能的发展历史可以追溯到",
    "List three uses of a paperclip:\n1.",
    "Question: What is 17 times 23? Answer:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his wife. Every morning the woodcutter walked into the forest with his axe, "
    "and every evening he came home with a bundle of wood on his back. One winter the snow fell "
    "so deep that the paths disappeared, and the woodcutter could no longer find his way among "
    "the trees. His wife worried, for their store of bread was running low, and the children of "
    "the village had begun to whisper that wolves had been seen near the old mill. On the third "
    "night of the storm there came a knock at the door, and when the woodcutter opened it he saw",
]


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    return LoadedModel.load(None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def make_llm(loaded: LoadedModel) -> Callable[..., LLM]:
    def make(**options: Any) -> LLM:
        options.setdefault("num_kv_blocks", 512)
        return LLM(loaded=loaded, **options)

    return make


# llama.cpp's vocabulary-only GGUF files (gzipped), with its tokenizer test texts and ids.
VOCABS = Path(__file__).parent / "fixtures" / "gguf-vocab"


@pytest.fixture(scope="session")
def vocab_reader(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """llama.cpp's vocabulary file `name`, unpacked once and read once for the session (by
    gguf-py's reader, as the loader reads: `gguf_reader.read_gguf`): the reader parses a
    128k-token vocabulary string by string (3 s on 2 Zen 4 cores for Llama 3's), and several
    tests read the same files."""
    from inflight.model.gguf_reader import read_gguf

    folder = tmp_path_factory.mktemp("gguf-vocab")

    @functools.cache
    def read(name: str) -> Any:
        path = folder / f"{name}.gguf"
        path.write_bytes(gzip.decompress((VOCABS / f"{name}.gguf.gz").read_bytes()))
        return read_gguf(path)

    return read


@pytest.fixture(scope="session")
def hf_model() -> Any:
    """transformers' model of the same weights, read from its fp32 snapshot (tests/hf_reference.py)."""
    from hf_reference import reference_model

    return reference_model()


def stream_in_background(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[str]]:
    """Starts a streaming POST to `url` on a thread; returns once its first line has arrived,
    with the thread and the list its lines are appended to."""
    import httpx

    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                started.set()
                lines.append(line)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30), "the stream sent nothing"
    return thread, lines


def pytest_report_header() -> str:
    """Which build of the CPU kernels this run tests (tests/test_kernel_builds.py reads it)."""
    from inflight.model.kernels import cpu_kernels, kernel_target

    module = cpu_kernels()
    return f"inflight CPU kernels: {module.isa() if module else 'unavailable'} ({kernel_target()} build)"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The CPU this run used, printed even under -q: figures and tolerances can differ between
    the machines CI lands on (AVX2, AVX-512 on 256- or 512-bit datapaths, AVX512_BF16, AMX)."""
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    shown = [f for f in flags if f in {"avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                                       "amx_bf16", "amx_int8", "avx512_fp16"}]
    terminalreporter.write_line(f"CPU: {name}, {os.cpu_count()} logical cores; {' '.join(shown) or 'no AVX2'}")
