"""A MoE model's routed experts as stored: a Qwen3-MoE-shaped GGUF file (8 layers, hidden 1024,
32 experts of 512 a layer, 4 per token: 415M weights, 404M of them in experts; seeded random
weights, quantized by gguf-py, Q8_0 by default) loaded as the engine loads it on CPU, by this
checkout and by git revision REV in a worktree of its own, alternated, each load in a fresh
process: the memory guard's estimate, the load's time, the resident size after it and its peak,
and the forward pass of 1, 4 and 64 rows (median of 15 after 3 warm-ups).

    .venv/bin/python benchmarks/moe_experts.py --against REV [--type Q8_0] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_MEASURE = """
import sys, time, torch
from inflight.engine.block_manager import BlockManager
from inflight.engine.runner import ModelRunner
from inflight.engine.sampler import Sampler
from inflight.engine.scheduler import ScheduledRequest
from inflight.model.llama import LlamaModel
from inflight.model.loader import (load_blocks, load_checkpoint, load_embedding, release_file_pages, resolve_model,
                                   weight_footprint)
from inflight.request import Request, SamplingParams

source = resolve_model(sys.argv[1])
estimate = weight_footprint(source, torch.float32, packed=True, blocks=True).peak
start = time.perf_counter()
config, shapes = load_checkpoint(source, torch.float32, keep_blocks=True)
model = LlamaModel(config, shapes, torch.device("cpu"), gguf_blocks=load_blocks(source, config),
                   embedding=load_embedding(source, config))
del shapes
release_file_pages(source)
load = time.perf_counter() - start
with open("/proc/self/status") as f:  # VmHWM: this process's peak (ru_maxrss keeps the parent's across exec)
    status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith(("VmRSS", "VmHWM"))}
rss, peak = status["VmRSS"], status["VmHWM"]
runner = ModelRunner(model, 64, 16, Sampler(torch.device("cpu")))
steps = []
for rows in (1, 4, 64):
    blocks = BlockManager(64, 16)
    request = Request("r", list(range(5, 5 + rows)), SamplingParams())
    blocks.allocate_slots(request, rows)
    inputs = runner.prepare([ScheduledRequest(request, 0, rows, blocks.block_table("r"))])
    times = []
    for i in range(18):
        t = time.perf_counter()
        model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_meta, torch.tensor([rows - 1]))
        if i >= 3:
            times.append(time.perf_counter() - t)
    steps.append(sorted(times)[len(times) // 2] * 1000)
print(f"estimate {estimate / 1e9:.2f} GB, load {load:.1f} s, resident {rss / 1e9:.2f} GB (peak {peak / 1e9:.2f}), "
      f"forward 1 / 4 / 64 rows {steps[0]:.1f} / {steps[1]:.1f} / {steps[2]:.1f} ms")
"""


def make_file(path: Path, kind: str) -> None:
    """The Qwen3-MoE-shaped file: written in f32 as llama.cpp lays it out, then quantized."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from test_loading import requantized, write_gguf_from_hf

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=2048, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=512, norm_topk_prob=True, tie_word_embeddings=False)
    f32 = path.with_suffix(".f32.gguf")
    write_gguf_from_hf(f32, "qwen3_moe", transformers.Qwen3MoeForCausalLM(config).eval())
    requantized(f32, path, kind)
    f32.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REV", required=True, help="the git revision to compare with")
    parser.add_argument("--type", default="Q8_0", help="the experts' and matrices' GGUF type (gguf-py quantizes it)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"qwen3moe-415m-{args.type}.gguf"
        make_file(path, args.type)
        print(f"{path.name}: {path.stat().st_size / 1e6:.0f} MB")
        other = Path(tmp) / "against"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(other), args.against],
                       check=True)
        try:
            for _ in range(args.rounds):
                for label, tree in ((args.against, other), ("this checkout", ROOT)):
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], env=env, cwd=tree, check=True,
                                         capture_output=True, text=True).stdout.strip()
                    print(f"{label}: {out}")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
