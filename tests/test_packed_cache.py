"""A large GGUF file's packed matrices kept on disk (`packed_cache`): the next load maps them
instead of packing them again, and computes the same tokens; a changed file, another
quantization or an unreadable cache file packs again; the cache can be turned off."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.model import packed_cache
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import Linear, blocks_usable
from inflight.model.loaded import LoadedModel
from inflight.model.loader import resolve_model

pytestmark = pytest.mark.skipif(not blocks_usable(), reason="the packings are the CPU block kernels'")

PROMPTS = ["The capital of France is", "def add(a, b):"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(packed_cache, "MIN_FILE_BYTES", 0)  # the embedded model is small
    monkeypatch.delenv("INFLIGHT_PACKED_CACHE", raising=False)
    return tmp_path / "packed"


def load(model: str | None = None, quantization: str = "none") -> LoadedModel:
    loaded = LoadedModel.load(model, torch.float32, torch.device("cpu"), quantization)
    packed_cache.wait()  # the copy is written beside the serving model
    return loaded


def greedy(loaded: LoadedModel) -> list[list[int]]:
    llm = LLM(loaded=loaded, quantization=loaded.quantization, num_kv_blocks=32)
    return [out.token_ids for out in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))]


def no_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> torch.Tensor:
        raise AssertionError("a matrix was packed again")

    monkeypatch.setattr(Linear, "_pack_blocks", refuse)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_next_load_maps_what_the_first_packed(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                  quantization: str) -> None:
    first = load(quantization=quantization)
    kept = list(cache.glob("*.bin"))
    assert len(kept) == 1
    # every matmul of the 30 layers (q/k/v and gate/up fused) and the LM head
    assert len(first.model.packed) == 30 * 4 + 1
    expected = greedy(first)
    with monkeypatch.context() as patched:
        no_packing(patched)
        second = load(quantization=quantization)
    assert second.model.packed.keys() == first.model.packed.keys()
    for name, packing in first.model.packed.items():
        mapped = second.model.packed[name]
        assert mapped.dtype == (torch.int8 if quantization == "int8" else torch.uint8)
        assert torch.equal(mapped, packing), name
    assert greedy(second) == expected
    assert list(cache.glob("*.bin")) == kept  # read, not written again


def test_a_changed_file_another_form_or_a_bad_cache_file_packs_again(cache: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.gguf"
    shutil.copy(resolve_model(None).path, model)
    first = load(str(model))
    (kept,) = cache.glob("*.bin")
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))  # the file changed
    second = load(str(model))
    (rewritten,) = cache.glob("*.bin")  # the stale one removed
    assert rewritten != kept
    load(str(model), quantization="int8")  # another form: kept beside, not in place of it
    assert len(list(cache.glob("*.bin"))) == 2 and rewritten.exists()
    for damage in (b"", b"INFLPAK1" + (10**6).to_bytes(8, "little") + b"{", rewritten.read_bytes()[:5000]):
        rewritten.write_bytes(damage)
        again = load(str(model))  # ignored, packed, and kept whole again
        assert all(torch.equal(again.model.packed[name], t) for name, t in first.model.packed.items())
    with monkeypatch.context() as patched:
        no_packing(patched)
        assert greedy(load(str(model))) == greedy(second)


def test_the_copies_of_deleted_or_changed_files_are_removed_when_another_is_kept(cache: Path,
                                                                                 tmp_path: Path) -> None:
    """A kept copy no load can map again (its model file deleted, or changed since, in any form)
    is removed when the next copy is written; the copies of files still as they were stay."""
    models = {name: tmp_path / f"{name}.gguf" for name in ("deleted", "changed", "same", "next")}
    for model in models.values():
        shutil.copy(resolve_model(None).path, model)
    kept = {}
    for name in ("deleted", "changed", "same"):
        load(str(models[name]), quantization="int8" if name == "changed" else "none")
        (kept[name],) = set(cache.glob("*.bin")) - set(kept.values())
    foreign = cache / "notes.bin"
    foreign.write_bytes(b"not a packed-weights file")
    models["deleted"].unlink()
    stat = models["changed"].stat()
    os.utime(models["changed"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert all(path.exists() for path in kept.values())  # nothing happens until a copy is written
    load(str(models["next"]))
    assert not kept["deleted"].exists() and not kept["changed"].exists()
    assert kept["same"].exists() and foreign.exists() and len(list(cache.glob("*.bin"))) == 3
    assert not kept["deleted"].with_suffix(".lock").exists()


def test_the_cache_can_be_turned_off_and_small_files_are_not_kept(cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_PACKED_CACHE", "off")
    load()
    assert not list(cache.glob("*.bin"))
    monkeypatch.delenv("INFLIGHT_PACKED_CACHE")
    monkeypatch.setattr(packed_cache, "MIN_FILE_BYTES", resolve_model(None).path.stat().st_size + 1)
    load()
    assert not cache.exists() or not list(cache.glob("*.bin"))


def test_the_copy_is_written_while_the_model_serves(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load returns before its copy is on disk; the copy is whole once written."""
    release = threading.Event()
    real_write = packed_cache.write

    def slow_write(entry: packed_cache.CacheEntry, tensors: dict[str, torch.Tensor]) -> None:
        assert release.wait(60)
        real_write(entry, tensors)

    monkeypatch.setattr(packed_cache, "write", slow_write)
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"), "none")
    assert not list(cache.glob("*.bin"))  # not written yet, and the model answers meanwhile
    expected = greedy(loaded)
    release.set()
    packed_cache.wait()
    assert len(list(cache.glob("*.bin"))) == 1
    monkeypatch.setattr(packed_cache, "write", real_write)
    with monkeypatch.context() as patched:
        no_packing(patched)
        assert greedy(load()) == expected


def test_a_copy_left_half_written_by_a_killed_process_is_removed(cache: Path) -> None:
    cache.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    abandoned = cache / f"tmpab12cd.{gone.pid}.tmp"  # a writer killed mid-way
    writing = cache / f"tmpef34gh.{os.getpid()}.tmp"  # a live process's, still being written
    other = cache / "notes.tmp"
    for path in (abandoned, writing, other):
        path.write_bytes(b"x" * 4096)
    load()
    assert not abandoned.exists() and writing.exists() and other.exists()
    assert len(list(cache.glob("*.bin"))) == 1


def test_one_process_at_a_time_keeps_a_file(cache: Path) -> None:
    """Replicas started together each pack; the one that takes the entry's lock writes, the
    others leave it (no second copy of several GB written beside the first)."""
    entry = packed_cache.locate(resolve_model(None), "none", cpu_kernels())
    assert entry is not None
    cache.mkdir(parents=True)
    with open(entry.path.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process writing it
        load()
        assert not list(cache.glob("*.bin")) and not list(cache.glob("*.tmp"))
    first = load()  # the lock free again: kept
    (kept,) = cache.glob("*.bin")
    written = kept.stat().st_mtime_ns
    packed_cache.write(entry, first.model.packed)  # kept meanwhile by another: left as it is
    assert kept.stat().st_mtime_ns == written
