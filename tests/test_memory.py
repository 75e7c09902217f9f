"""The memory guard: an engine that would not fit in the memory available is refused before
anything is allocated, with one line that says what would fit; the weights' estimate is held
against what a load really takes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from inflight import LLM
from inflight.errors import ConfigError
from inflight.model.loaded import LoadedModel
from inflight.model.loader import resolve_model, weight_footprint

GIB = 1024 ** 3


@pytest.fixture
def never_loaded(monkeypatch):
    """Fails a test that gets as far as loading the model."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LoadedModel, "load", load)


def refusal(monkeypatch, available: int, **options) -> str:
    monkeypatch.setattr("inflight.engine.memory.available_memory_bytes", lambda device: available)
    with pytest.raises(ConfigError) as info:
        LLM(**options)
    message = str(info.value)
    assert "\n" not in message and "needs about" in message and "GiB is available" in message
    return message


def test_a_pool_too_large_is_refused_with_the_pool_that_would_fit(monkeypatch, never_loaded):
    weights = weight_footprint(resolve_model(None), torch.float32, packed=True, blocks=True).peak
    available = weights + 1 * GIB
    message = refusal(monkeypatch, available, num_kv_blocks=100_000)
    blocks = int(re.search(r"num_kv_blocks=(\d+) \(\d+ tokens\) would fit", message).group(1))
    assert 0 < blocks < 100_000
    # The pool it names fits (the check passes and the model would be loaded), one block more does not.
    with pytest.raises(AssertionError, match="was loaded"):
        LLM(num_kv_blocks=blocks)
    with pytest.raises(ConfigError):
        LLM(num_kv_blocks=blocks + 1)
    # A pool in bytes the same way.
    assert "kv_cache_memory_bytes" in refusal(monkeypatch, available, kv_cache_memory_bytes=4 * GIB)


def test_a_16_bit_kv_pool_fits_twice_the_blocks_and_the_simulators_types_are_refused(monkeypatch, never_loaded):
    """The pool the guard names for kv_cache_dtype float16 is twice fp32's (the same bytes a block
    less); fp8, which only the simulator prices, is refused in one line before anything loads."""
    weights = weight_footprint(resolve_model(None), torch.float32, packed=True, blocks=True).peak
    fits = {}
    for kv in ("auto", "float16"):
        message = refusal(monkeypatch, weights + GIB, num_kv_blocks=100_000, kv_cache_dtype=kv)
        fits[kv] = int(re.search(r"num_kv_blocks=(\d+) \(\d+ tokens\) would fit", message).group(1))
    assert abs(fits["float16"] - 2 * fits["auto"]) <= 2
    with pytest.raises(ConfigError, match="kv_cache_dtype fp8 is priced by `inflight sim` only") as info:
        LLM(kv_cache_dtype="fp8_e4m3")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype 'int4'"):
        LLM(kv_cache_dtype="int4")


def test_a_step_too_large_is_refused_with_the_token_budget_that_would_fit(monkeypatch, never_loaded):
    weights = weight_footprint(resolve_model(None), torch.float32, packed=True, blocks=True).peak
    message = refusal(monkeypatch, weights + GIB // 2, num_kv_blocks=16, max_num_tokens=65536)
    tokens = int(re.search(r"max_num_tokens=(\d+) \(now 65536\) would fit", message).group(1))
    assert 0 < tokens < 65536
    with pytest.raises(AssertionError, match="was loaded"):
        LLM(num_kv_blocks=16, max_num_tokens=tokens, max_batch_size=min(64, tokens))


def test_weights_that_cannot_fit_are_refused_whatever_the_options(monkeypatch, never_loaded):
    message = refusal(monkeypatch, 200 * 1024 ** 2, num_kv_blocks=1)
    assert "the weights alone do not fit" in message


def test_the_command_line_refuses_in_one_line_before_loading_and_before_ray_starts():
    """Real memory, no stand-in: a pool of 10^8 blocks is tens of terabytes for any model."""
    for argv in (["generate", "--num-kv-blocks", "100000000", "hi"],
                 ["serve", "--replicas", "2", "--num-kv-blocks", "100000000", "--port", "1"]):
        done = subprocess.run([sys.executable, "-m", "inflight.cli", *argv], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "needs about" in lines[0] and "would fit" in lines[0], done.stderr
        if argv[0] == "serve":
            assert "each of 2 replicas" in lines[0]


_MEASURE = textwrap.dedent("""
    import json, sys, torch
    from inflight.engine.memory import keep_freed_memory
    from inflight.model.linear import blocks_usable
    from inflight.model.loaded import LoadedModel

    def anonymous():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    keep_freed_memory()  # as the engine runs
    blocks_usable()  # the kernels loaded before the count starts
    before = anonymous()
    model, quantization = sys.argv[1] or None, sys.argv[2]
    loaded = LoadedModel.load(model, torch.float32, torch.device("cpu"), quantization=quantization)
    print(json.dumps({"grown": anonymous() - before}))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize("kind", ["gguf", "hf-bf16", "gguf-int8"])
def test_the_weights_estimate_bounds_what_a_load_takes(tmp_path, kind):
    """In a fresh process, as `LoadedModel.load` builds the model and its tokenizer: the anonymous
    memory it grows by is at most the estimate, and not far below it (the estimate is what is
    refused on). With int8 too: the stored matrices quantized one at a time."""
    import transformers

    from inflight.model.linear import blocks_usable, linear_backend

    int8 = kind.endswith("-int8")
    if int8 and linear_backend(torch.device("cpu"), torch.float32) != "inflight":
        pytest.skip("int8 runs on inflight's own linear backend")
    argv = ["", "int8" if int8 else "none"]
    if kind == "hf-bf16":  # about 73M parameters, stored in bf16
        from inflight.model.tokenizer import Tokenizer

        torch.manual_seed(0)
        Tokenizer.load(resolve_model(None)).hf.save_pretrained(tmp_path)  # the embedded model's, 49,152 entries
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=49152, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, tie_word_embeddings=False)).to(torch.bfloat16)
        model.save_pretrained(tmp_path, safe_serialization=True)
        argv[0] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    grown = json.loads(done.stdout.strip().splitlines()[-1])["grown"]
    packed = linear_backend(torch.device("cpu"), torch.float32) != "torch"
    estimate = weight_footprint(resolve_model(argv[0] or None), torch.float32, packed=packed,
                                blocks=blocks_usable(), int8=int8).peak
    # The estimate is of the load's peak; the growth is measured after it (a directory's stored
    # tensors, freed by then, are part of the one and not the other).
    assert grown <= estimate <= 1.75 * grown, (grown, estimate)


def test_replicas_count_the_packed_weights_kept_on_disk_once(monkeypatch, tmp_path, never_loaded):
    """`serve --replicas N` checks N copies, but a large file's packed matrices kept on disk
    (`packed_cache`) are mapped by every replica from one copy in the page cache: counted once."""
    from inflight.config import EngineConfig
    from inflight.engine.engine import check_engine_fits
    from inflight.engine.memory import plan_memory
    from inflight.model import packed_cache
    from inflight.model.kernels import cpu_kernels
    from inflight.model.linear import blocks_usable

    if not blocks_usable():
        pytest.skip("the packings are the CPU block kernels'")
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(packed_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.delenv("INFLIGHT_PACKED_CACHE", raising=False)
    config = EngineConfig.from_kwargs(None, num_kv_blocks=64)
    source = resolve_model(None)
    total = plan_memory(config, source, torch.float32, torch.device("cpu"), packed=True).total
    kept = 80 * 1024 ** 2  # the packings' bytes, as the file's header states them
    monkeypatch.setattr("inflight.engine.memory.available_memory_bytes", lambda device: kept + 4 * (total - kept) + 1)
    with pytest.raises(ConfigError, match="each of 4 replicas\\)"):  # nothing kept yet: four copies
        check_engine_fits(config, copies=4)
    entry = packed_cache.locate(source, "none", cpu_kernels())
    packed_cache.write(entry, {"model.layers.0.mlp.down_proj.weight": torch.zeros(kept, dtype=torch.uint8)})
    assert packed_cache.kept_bytes(entry) == kept
    check_engine_fits(config, copies=4)  # the kept copy counted once: fits
    with pytest.raises(ConfigError, match="each of 5 replicas, 0.1 of the weights kept on disk and mapped once"):
        check_engine_fits(config, copies=5)
    other = packed_cache.locate(source, "int8", cpu_kernels())  # kept for another form: not this one's
    assert other is not None and packed_cache.kept_bytes(other) == 0
