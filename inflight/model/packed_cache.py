"""A large GGUF model's packed matrices kept on disk, so that the next load maps them instead of
repacking them.

Repacking a file's blocks into the kernels' panels is quick, but it writes the whole packed
model into fresh anonymous memory, and fresh memory is what a load pays for most: on 2 AMD EPYC
Zen 4 cores of a virtual machine, three quarters of an 8B-shaped Q8_0 file's load went to the
kernel zeroing new pages (`perf record`: `clear_page_erms`), the host backing each as the guest
first touched it. So the first load of a file of at least `MIN_FILE_BYTES` writes what it packed
to `$INFLIGHT_CACHE/packed/` (one file per model file and `--quantization`, replaced when the
model file or the kernels' build changes), and later loads map that file read-only: from the page cache
a restart costs a page-table walk instead of a repacking, and processes serving the same model
(`--replicas`) share one copy of the weights in the page cache instead of one each.

The copy is written in a thread of its own (`keep`), so the first load returns once the model
is packed and the engine serves while the copy goes to disk; a process exits only once its copy
is whole, and a copy left half-written by a killed process is removed by the next one written
beside it, as are the copies of model files since deleted or changed (no load maps them again).
`INFLIGHT_PACKED_CACHE=off` turns it off. The cache is only ever a copy of what this
build packs from this file (its key names both), and a file that cannot be read, written or
trusted is ignored: the model is then packed as without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

import torch

from inflight.model.loader import ModelSource, cache_dir

logger = logging.getLogger(__name__)

# Smaller files load in a second or two anyway; a copy of each would only fill the disk (and the
# suite's temporary models would leave one each).
MIN_FILE_BYTES = 512 * 1024 ** 2
_MAGIC = b"INFLPAK1"
_ALIGN = 4096  # each matrix on its own page
_DTYPES = {"uint8": torch.uint8, "int8": torch.int8}


@dataclass(frozen=True)
class CacheEntry:
    """Where one model file's packed matrices are kept, and the key a kept file must carry."""

    path: Path
    key: str


def locate(source: ModelSource, quantization: str, kernels: ModuleType | None) -> CacheEntry | None:
    """The cache entry of `source` as this build packs it with `quantization`; None where the
    cache is off, the source is not a GGUF file, or the file is small."""
    if os.environ.get("INFLIGHT_PACKED_CACHE", "").lower() in ("off", "0", "false", "no") or kernels is None:
        return None
    if source.kind != "gguf":
        return None
    try:
        stat = source.path.stat()
    except OSError:
        return None
    if stat.st_size < MIN_FILE_BYTES:
        return None
    where = str(source.path.resolve())
    key = json.dumps([where, stat.st_size, stat.st_mtime_ns, kernels.__name__, quantization])
    name = f"{_digest(json.dumps([where, quantization]))}-{_digest(key)}.bin"  # one kept per file and form
    return CacheEntry(cache_dir() / "packed" / name, key)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _header(f: BinaryIO, entry: CacheEntry | None = None) -> dict[str, Any]:
    """A kept file's header (its key and, by name, each packing's dtype, offset and bytes), read
    from the start of `f`; ValueError where it is not one or (given `entry`) carries another key."""
    head = f.read(16)
    if head[:8] != _MAGIC:
        raise ValueError("not a packed-weights file")
    header = json.loads(f.read(int.from_bytes(head[8:16], "little")))
    if not isinstance(header, dict) or (entry is not None and header.get("key") != entry.key):
        raise ValueError("kept for another file or build")
    return header


def read(entry: CacheEntry) -> dict[str, torch.Tensor] | None:
    """The packed matrices kept for `entry`, as read-only views of the mapped file (no copy);
    None where there is no such file or it does not carry the entry's key."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        with open(entry.path, "rb") as f:
            header = _header(f, entry)
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # the kernels only read them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for name, (dtype, offset, nbytes) in header["tensors"].items():
                if offset % _ALIGN or offset + nbytes > len(mapped):
                    raise ValueError(f"{name} lies outside the file")
                tensors[name] = torch.frombuffer(mapped, dtype=_DTYPES[dtype], count=nbytes, offset=offset)
    except FileNotFoundError:
        return None
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as exc:  # AttributeError: no prot off Unix
        logger.info("packed weights %s ignored (%s); packing the model again", entry.path, exc)
        return None  # a mapping goes with the views made of it
    # Mapped in now, from the page cache (or read from disk now rather than in the first step).
    for advice in (_MADV_POPULATE_READ, mmap.MADV_WILLNEED):
        try:
            mapped.madvise(advice)
            break
        except OSError:  # before Linux 5.14
            continue
    return tensors


_MADV_POPULATE_READ = 22  # <linux/mman.h>; not in Python 3.11's mmap module


def kept_bytes(entry: CacheEntry) -> int:
    """The bytes of the packings kept for `entry` (what processes loading it map and share), from
    its header alone; 0 where none are kept."""
    try:
        with open(entry.path, "rb") as f:
            return sum(int(nbytes) for _, _, nbytes in _header(f, entry)["tensors"].values())
    except (OSError, KeyError, TypeError, ValueError):
        return 0


_writers: list[threading.Thread] = []


def keep(entry: CacheEntry, tensors: dict[str, torch.Tensor]) -> threading.Thread:
    """`write` in a thread of its own, which the interpreter waits for at exit (so no copy is
    left half-written by a clean exit); `wait` waits for every one started."""
    writer = threading.Thread(target=write, args=(entry, dict(tensors)), name="inflight-packed-cache")
    writer.start()
    _writers.append(writer)
    return writer


def wait() -> None:
    """Returns once every copy `keep` started is written (or given up)."""
    while _writers:
        _writers.pop().join()


def _remove_abandoned(directory: Path) -> None:
    """Removes temporary files whose writer is gone (a process killed while writing)."""
    for tmp in directory.glob("*.tmp"):
        try:
            os.kill(int(tmp.suffixes[-2].removeprefix(".")), 0)
        except (ValueError, IndexError):  # not one of ours
            continue
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                tmp.unlink()
        except PermissionError:  # alive, another user's
            continue


def _source_gone(kept: Path) -> bool:
    """Whether `kept` is a packed-weights file of a model file since deleted or changed: no load
    can use it again (its key names the file's path, size and mtime). A file that is not one of
    ours, or cannot be read, is not."""
    try:
        with open(kept, "rb") as f:
            key = json.loads(_header(f)["key"])  # `locate`'s: [path, size, mtime_ns, build, form]
        where, size, mtime_ns = key[:3]
        source = Path(where)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        stat = source.stat()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns)


def _remove_orphans(directory: Path) -> None:
    """Removes the kept files of model files since deleted or changed, each several GB that no
    load would map again (the copy a changed file's next load writes replaces the one of its own
    form only; a deleted file's copies, and a changed one's other forms, would stay for good)."""
    for kept in directory.glob("*.bin"):
        if _source_gone(kept):
            for path in (kept, kept.with_suffix(".lock")):
                with contextlib.suppress(OSError):
                    path.unlink()
            logger.info("packed weights %s removed: their model file is gone or changed", kept)


def write(entry: CacheEntry, tensors: dict[str, torch.Tensor]) -> None:
    """Keeps `tensors` (1-D uint8 or int8 packings) for the next load: written whole to a
    temporary file, then renamed over the entry, and the files kept for earlier versions of the
    same model file in the same form (quantization) removed. One process at a time writes an
    entry: where another is writing it (replicas started together), or has kept it meanwhile,
    this one leaves it. Skipped, with a log line, where the disk lacks room for it twice over; an
    unwritable cache only costs the next load its time."""
    try:
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        with open(entry.path.with_suffix(".lock"), "w") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("packed weights %s are being kept by another process", entry.path)
                return
            if not kept_bytes(entry):
                _write(entry, tensors)
    except OSError as exc:
        logger.info("packed weights not kept (%s)", exc)


def _write(entry: CacheEntry, tensors: dict[str, torch.Tensor]) -> None:
    tmp, started = None, time.perf_counter()
    try:
        relative, size = {}, 0  # each matrix's place after the header's pages
        for name, t in tensors.items():
            if t.dim() != 1 or t.dtype not in (torch.uint8, torch.int8):
                raise ValueError(f"{name} is not a packing")
            relative[name] = (str(t.dtype).removeprefix("torch."), size, t.numel())
            size += -(-t.numel() // _ALIGN) * _ALIGN
        start = _ALIGN
        while True:  # as many pages as the header takes, its offsets counted in
            table = {name: (dtype, start + at, n) for name, (dtype, at, n) in relative.items()}
            header = json.dumps({"key": entry.key, "tensors": table}).encode()
            if 16 + len(header) <= start:
                break
            start = -(-(16 + len(header)) // _ALIGN) * _ALIGN
        offset = start + size
        _remove_abandoned(entry.path.parent)
        _remove_orphans(entry.path.parent)
        if shutil.disk_usage(entry.path.parent).free < 2 * offset:
            logger.info("packed weights not kept: %s lacks %.1f GB of room", entry.path.parent, 2 * offset / 1e9)
            return
        fd, tmp = tempfile.mkstemp(dir=entry.path.parent, suffix=f".{os.getpid()}.tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + len(header).to_bytes(8, "little") + header)
            for name, t in tensors.items():
                f.seek(table[name][1])
                f.write(t.contiguous().view(torch.uint8).numpy().data)
            f.truncate(offset)
        os.replace(tmp, entry.path)
        tmp = None
        logger.info("packed weights kept in %s (%.1f GB, written in %.1f s)", entry.path, offset / 1e9,
                    time.perf_counter() - started)
        prefix = entry.path.name.split("-")[0]
        for old in entry.path.parent.glob(f"{prefix}-*.bin"):
            if old != entry.path:
                with contextlib.suppress(OSError):
                    old.unlink()
    except (OSError, ValueError) as exc:
        logger.info("packed weights not kept (%s)", exc)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
