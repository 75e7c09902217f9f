"""What loading a model takes: the load time, the resident peak and the anonymous memory a
fresh process grows by as `LoadedModel.load` builds it (weights, their kernel layout, kept GGUF blocks, the tokenizer),
beside the estimate the memory guard refuses on (`engine.memory.check_memory`), term by term.
Each model loads three times, each in a process of its own: the first builds the GGUF index,
tokenizer and packed-weights caches, the second is the one a user restarting a server sees (a
large file's packed weights mapped from the cache, `packed_cache`), the third packs them again
(`INFLIGHT_PACKED_CACHE=off`); the memory figures are the last two's.

    .venv/bin/python benchmarks/load_memory.py [--model PATH ...] [--quantization int8]
    (default: the embedded model, weights computed as stored)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from inflight.model import packed_cache
from inflight.model.kernels import cpu_kernels
from inflight.model.linear import blocks_usable, linear_backend
from inflight.model.loader import resolve_model, weight_footprint

_LOAD = """
import json, sys, time, torch
from inflight.engine.memory import keep_freed_memory
from inflight.model import packed_cache
from inflight.model.loaded import LoadedModel

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

keep_freed_memory()
before, anon, file, start = status("VmRSS"), status("RssAnon"), status("RssFile"), time.perf_counter()
loaded = LoadedModel.load(sys.argv[2] if len(sys.argv) > 2 else None, torch.float32, torch.device("cpu"),
                          quantization=sys.argv[1])  # held: mapped weights go with the model
seconds, grown, file, peak = (time.perf_counter() - start, status("RssAnon") - anon, status("RssFile") - file,
                              status("VmHWM") - before)
packed_cache.wait()  # a first load's copy is written while its model serves
print(json.dumps({"seconds": seconds, "grown": grown, "file": file, "peak": peak,
                  "kept_after": time.perf_counter() - start}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="a GGUF file or HF directory (repeatable)")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none")
    args = parser.parse_args()
    packed = linear_backend(torch.device("cpu"), torch.float32) != "torch"
    for model in args.model or [None]:
        source = resolve_model(model)
        footprint = weight_footprint(source, torch.float32, packed=packed, blocks=blocks_usable(),
                                     int8=args.quantization == "int8")
        runs = []
        for cache in ("on", "on", "off"):  # the first builds the caches; the last packs again
            env = {**os.environ, **({"INFLIGHT_PACKED_CACHE": "off"} if cache == "off" else {})}
            done = subprocess.run([sys.executable, "-c", _LOAD, args.quantization, *([model] if model else [])],
                                  capture_output=True, text=True, check=True, env=env)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{source.name} ({source.kind}, quantization {args.quantization}, "
              f"{footprint.num_parameters / 1e6:.0f}M parameters, "
              f"file(s) {sum(p.stat().st_size for p in _files(source)) / 1e6:.0f} MB)")
        entry = packed_cache.locate(source, args.quantization, cpu_kernels())
        kept = entry is not None and packed_cache.kept_bytes(entry) > 0  # not where the disk lacked room
        print(f"  load: {runs[0]['seconds']:.1f} s first ("
              + (f"its packed weights on disk {runs[0]['kept_after']:.1f} s after it began" if kept
                 else "no packed weights kept") + f"), {runs[1]['seconds']:.1f} s cached ("
              + (f"packed weights mapped from {entry.path}" if kept and entry else "packed again") + "), "
              f"{runs[2]['seconds']:.1f} s packing again (INFLIGHT_PACKED_CACHE=off)")
        for name, run in (("cached", runs[1]), ("packing again", runs[2])):
            print(f"  {name}: resident peak +{run['peak'] / 1e6:.0f} MB (mapped pages included), anonymous memory "
                  f"after +{run['grown'] / 1e6:.0f} MB ({run['grown'] / footprint.num_parameters:.1f} bytes a "
                  f"weight), file pages mapped after +{run['file'] / 1e6:.0f} MB")
        peak = runs[2]["peak"]
        print(f"  the guard's estimate: {footprint.peak / 1e6:.0f} MB ({footprint.peak / peak:.2f}x the peak)")
        for what, size in footprint.parts:
            print(f"    {size / 1e6:8.0f} MB  {what}")
    return 0


def _files(source):
    return [source.path] if source.kind == "gguf" else sorted(source.path.glob("*.safetensors"))


if __name__ == "__main__":
    raise SystemExit(main())
