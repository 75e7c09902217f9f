"""The CUDA path's whole check in one run: numerics against transformers, then throughput
against the GPU's limits and against transformers' static batches.

    python benchmarks/gpu_check.py --out DIR                       # on the GPU: bf16 and fp32
    python benchmarks/gpu_check.py --device cpu --tiny --out DIR   # the same flow on CPU, tiny
                                                                   # (tests/test_gpu_check.py)

It writes DIR/gpu_check.json (every figure, every check with its tolerance and verdict) and
prints a summary; it exits 1 if a numerics check failed.

The model. No checkpoint travels (the embedded GGUF is over the 64 MiB a device call carries),
so the check builds Llama models of known shapes with seeded random weights (transformers' own
initialisation), saves each as a Hugging Face directory (config.json, model.safetensors and a
word-level tokenizer over the vocabulary) and loads it the way a user's would be loaded:
`LLM(model=DIR)`, through inflight's safetensors loader. Shapes: `smollm2-135m` (SmolLM2-135M's:
30 layers, hidden 576, 9 query and 3 KV heads, vocabulary 49,152, tied embeddings) for the
numerics and the first throughput rows, `llama-1b` (Llama 3.2 1B's: 16 layers, hidden 2048, 32
and 8 heads, vocabulary 128,256) for throughput; `tiny` (2 layers, hidden 64) with --tiny.

The checks, in order:
1. inflight imports with what the machine has plus the wheels below, server included.
2. Logits against transformers on the same weights, in fp32 and in bf16, over prompts of 1 to
   300 tokens: each prompt alone, all packed in one step, in chunks with cached context, on a
   shuffled block pool, and decode steps of all prompts batched (teacher-forced). Tolerances:
   fp32, max |difference| <= 2e-3 (summation order only); bf16, inflight's max error against
   transformers-fp32 <= 2 x transformers-bf16's own error against it + 0.02.
3. Greedy tokens in fp32 identical to transformers' `generate`, or diverging only where
   transformers' top two logits are within the fp32 tolerance of each other (a tie).
4. Throughput in bf16: the burst of 64 (benchmarks/peers' burst64 lengths: 10,508 prompt and
   9,716 output tokens, ids drawn from the vocabulary) and a 256-request burst drawn the same
   way: generated tokens/s, TTFT, TBT, steps/s; a decode-only step of 64 and of 256 requests at
   ~512 tokens of context: step time and the HBM bandwidth it achieves (weights + KV bytes read
   per step / step time) against the H200's 4.8 TB/s; transformers' `generate` in static
   batches on the same requests (each request's own output length counted as useful), and the
   ratio.

Packages the GPU machine lacks, carried as wheels (`scripts/gpu_wheels.sh` downloads them into
.whl/ for Python 3.12 on x86-64): gguf, pydantic, pydantic-core, annotated-types,
typing-inspection, fastapi, starlette, uvicorn. Everything else it needs is there (torch with
CUDA, transformers, safetensors, tokenizers, numpy, httpx, pyyaml, jinja2, prometheus-client,
tqdm, click, h11, anyio).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True),
}
FP32_ATOL = 2e-3
BF16_FACTOR, BF16_SLACK = 2.0, 0.02
H200_HBM_BYTES_S = 4.8e12
INFLIGHT_MODULES = ("inflight", "inflight.engine.engine", "inflight.server.app", "inflight.cli", "inflight.bench.local")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json (and the models built)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny shape and small bursts (the CPU smoke run)")
    p.add_argument("--models-dir", help="where to save the built models (default: OUT/models)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---- 1. imports -----------------------------------------------------------------------------

def check_imports() -> dict[str, Any]:
    missing = {}
    for name in INFLIGHT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing[name] = str(exc)
    return {"modules": list(INFLIGHT_MODULES), "failed": missing, "ok": not missing}


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "device": str(device),
                           "processor": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


# ---- the model ------------------------------------------------------------------------------

def build_model_dir(shape: str, root: Path, seed: int) -> Path:
    """A Hugging Face directory of a Llama model of `shape` with seeded random weights and a
    word-level tokenizer whose every token is one id of the vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models

    path = root / shape
    if (path / "config.json").is_file():
        return path
    dims = SHAPES[shape]
    config = transformers.LlamaConfig(**dims, max_position_embeddings=4096, rms_norm_eps=1e-5,
                                      bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config)
    model.eval().save_pretrained(path, safe_serialization=True)
    vocab = {f"<t{i}>": i for i in range(dims["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>",
                                                eos_token="<t2>")
    fast.save_pretrained(path)
    del model
    return path


def hf_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def prompts_for(vocab: int, lengths: list[int], extra: int, seed: int) -> list[list[int]]:
    """Token ids of each prompt followed by `extra` continuation tokens (fed teacher-forced)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n + extra,), generator=gen).tolist() for n in lengths]


# ---- 2. logits ------------------------------------------------------------------------------

class StepDriver:
    """Runs the model on hand-made steps through the runner and the block manager, returning the
    logits of every row (the runner orders decodes first; so does `rows`)."""

    def __init__(self, model: Any, num_blocks: int, block_size: int, shuffle_pool: bool = False) -> None:
        from inflight.engine.block_manager import BlockManager
        from inflight.engine.runner import ModelRunner
        from inflight.engine.sampler import Sampler

        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size, Sampler(model.device))
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        if shuffle_pool:  # one-block fillers over the whole pool, freed in random order
            self._scatter(num_blocks, block_size)

    def _scatter(self, num_blocks: int, block_size: int) -> None:
        from inflight.request import Request, SamplingParams

        ids = [f"filler{i}" for i in range(num_blocks)]
        for rid in ids:
            assert self.bm.allocate_slots(Request(rid, [5] * block_size, SamplingParams()), block_size)
        random.Random(0).shuffle(ids)
        for rid in ids:
            self.bm.free(rid)

    def step(self, items: list[tuple[Any, int, int]]) -> list[torch.Tensor]:
        """items: (request, start, num_new_tokens); returns each item's logits rows, in `items`' order."""
        from inflight.engine.scheduler import ScheduledRequest

        scheduled = []
        for req, start, n in items:
            assert self.bm.allocate_slots(req, start + n), "pool too small for the check"
            scheduled.append(ScheduledRequest(req, start, n, self.bm.block_table(req.request_id)))
        inputs = self.runner.prepare(scheduled)
        ordered = [s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode]
        total = sum(s.num_new_tokens for s in ordered)
        logits = self.model.forward(inputs.input_ids, inputs.positions, self.runner.kv_caches, inputs.attn_meta,
                                    torch.arange(total, device=inputs.input_ids.device))
        rows, offset = {}, 0
        for s in ordered:
            rows[id(s)] = logits[offset:offset + s.num_new_tokens].float()
            offset += s.num_new_tokens
        return [rows[id(s)] for s in scheduled]

    def free(self, req: Any) -> None:
        self.bm.free(req.request_id)


def inflight_cases(model: Any, seqs: list[list[int]], num_prompt: list[int], block_size: int) -> dict[str, list]:
    """Each case's logits per prompt, `[positions, vocab]`, at the positions it computes."""
    from inflight.request import Request, SamplingParams

    longest = max(len(s) for s in seqs)
    num_blocks = len(seqs) * (-(-longest // block_size)) + 4

    def request(i: int, tag: str, upto: int) -> Any:
        req = Request(f"{tag}{i}", seqs[i][:num_prompt[i]], SamplingParams())
        req.output_token_ids = seqs[i][num_prompt[i]:upto]
        return req

    cases: dict[str, list] = {}
    driver = StepDriver(model, num_blocks, block_size)
    alone = []
    for i in range(len(seqs)):  # each prompt alone in its step
        req = request(i, "alone", num_prompt[i])
        alone.append((0, driver.step([(req, 0, num_prompt[i])])[0]))
        driver.free(req)
    cases["alone"] = alone

    for label, shuffle in (("packed", False), ("shuffled_pool", True)):
        driver = StepDriver(model, num_blocks, block_size, shuffle_pool=shuffle)
        reqs = [request(i, label, num_prompt[i]) for i in range(len(seqs))]
        out = driver.step([(r, 0, num_prompt[i]) for i, r in enumerate(reqs)])
        cases[label] = [(0, o) for o in out]
        if label == "packed":  # then every prompt's continuation as decode steps of all prompts at once
            decoded: list[list[torch.Tensor]] = [[] for _ in seqs]
            for k in range(min(len(s) - n for s, n in zip(seqs, num_prompt, strict=True))):
                for i, r in enumerate(reqs):
                    r.output_token_ids = seqs[i][num_prompt[i]:num_prompt[i] + k + 1]
                rows = driver.step([(r, num_prompt[i] + k, 1) for i, r in enumerate(reqs)])
                for i, row in enumerate(rows):
                    decoded[i].append(row)
            cases["decode_batched"] = [(num_prompt[i], torch.cat(d)) for i, d in enumerate(decoded)]
        for r in reqs:
            driver.free(r)

    driver = StepDriver(model, num_blocks, block_size)  # chunks of every prompt in the same steps
    reqs = [request(i, "chunk", num_prompt[i]) for i in range(len(seqs))]
    chunked: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    chunk = max(2, max(num_prompt) // 3)
    while any(d < n for d, n in zip(done, num_prompt, strict=True)):
        items = [(r, done[i], min(chunk, num_prompt[i] - done[i]))
                 for i, r in enumerate(reqs) if done[i] < num_prompt[i]]
        for (r, start, n), rows in zip(items, driver.step(items), strict=True):
            i = reqs.index(r)
            chunked[i].append(rows)
            done[i] = start + n
    cases["chunked"] = [(0, torch.cat(c)) for c in chunked]
    return cases


def numerics(path: Path, device: torch.device, lengths: list[int], extra: int, block_size: int,
             seed: int) -> dict[str, Any]:
    from inflight import LLM

    cfg = json.loads((path / "config.json").read_text())
    seqs = prompts_for(cfg["vocab_size"], lengths, extra, seed)
    reference: dict[str, list[torch.Tensor]] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = hf_model(path, dtype, device)
        with torch.inference_mode():
            reference[name] = [hf(input_ids=torch.tensor([s], device=device)).logits[0].float() for s in seqs]
        del hf
    result: dict[str, Any] = {"prompt_lengths": lengths, "decode_steps": extra, "block_size": block_size,
                              "fp32_atol": FP32_ATOL,
                              "bf16_rule": f"<= {BF16_FACTOR} x transformers-bf16 + {BF16_SLACK}"}
    ok = True
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        llm = LLM(model=str(path), dtype=dtype, device=str(device), block_size=block_size, num_kv_blocks=8)
        model = llm.engine.model
        for case, rows in inflight_cases(model, seqs, lengths, block_size).items():
            err = max(float((got - reference["fp32"][i][start:start + len(got)]).abs().max())
                      for i, (start, got) in enumerate(rows))
            entry: dict[str, Any] = {"max_abs_err_vs_hf_fp32": err}
            if name == "fp32":
                entry["ok"] = err <= FP32_ATOL
            else:
                hf_err = max(float((reference["bf16"][i][start:start + len(got)]
                                    - reference["fp32"][i][start:start + len(got)]).abs().max())
                             for i, (start, got) in enumerate(rows))
                entry["hf_bf16_err_vs_hf_fp32"] = hf_err
                entry["ok"] = err <= BF16_FACTOR * hf_err + BF16_SLACK
            ok &= entry["ok"]
            result[f"{name}/{case}"] = entry
        del llm, model
    result["ok"] = ok
    return result


# ---- 3. greedy tokens -----------------------------------------------------------------------

def greedy(path: Path, device: torch.device, lengths: list[int], num_tokens: int, seed: int) -> dict[str, Any]:
    from inflight import LLM, SamplingParams

    cfg = json.loads((path / "config.json").read_text())
    prompts = prompts_for(cfg["vocab_size"], lengths, 0, seed + 1)
    llm = LLM(model=str(path), dtype="float32", device=str(device), max_num_tokens=4096)
    outs = llm.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    del llm
    hf = hf_model(path, torch.float32, device)
    per_prompt = []
    ok = True
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            gen = hf.generate(torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=num_tokens,
                              min_new_tokens=num_tokens, output_scores=True, return_dict_in_generate=True,
                              pad_token_id=0)
            ref = gen.sequences[0, len(prompt):].tolist()
            first = next((k for k, (a, b) in enumerate(zip(out.token_ids, ref, strict=True)) if a != b), None)
            entry: dict[str, Any] = {"prompt_len": len(prompt), "identical": first is None}
            if first is not None:
                top2 = gen.scores[first][0].float().topk(2).values
                margin = float(top2[0] - top2[1])
                entry.update(first_difference=first, hf_top2_margin=margin, tie=margin <= FP32_ATOL)
                ok &= entry["tie"]
            per_prompt.append(entry)
    del hf
    return {"num_tokens": num_tokens, "prompts": per_prompt, "ok": ok,
            "num_identical": sum(e["identical"] for e in per_prompt)}


# ---- 4. throughput --------------------------------------------------------------------------

def burst(vocab: int, num_requests: int, output_scale: float, seed: int) -> list[Any]:
    """benchmarks/peers' burst64 lengths (drawn for `num_requests`), token ids from the vocabulary."""
    import numpy as np
    import workloads

    corpus = np.random.default_rng(seed).integers(3, vocab, size=200_000)
    return workloads.build("burst64", corpus, num_requests=num_requests, output_scale=output_scale)


def inflight_burst(path: Path, device: torch.device, requests: list[Any], options: dict[str, Any]) -> dict[str, Any]:
    from inflight import LLM
    from inflight.bench.local import run_engine, warm_up
    from inflight.bench.results import BenchRun
    from inflight.bench.workload import BenchRequest

    bench = [BenchRequest(i, r.prompt_token_ids, "", r.max_tokens, r.arrival_s) for i, r in enumerate(requests)]
    llm = LLM(model=str(path), dtype="bfloat16", device=str(device), **options)
    engine = llm.engine
    warm_up(engine)
    start = len(engine.step_records)
    capture = run_engine(engine, bench, progress=False)
    steps = list(engine.step_records)[start:]
    metrics = BenchRun.measure("inflight", options, capture).metrics
    del llm, engine
    return {
        "options": options,
        "wall_s": capture.duration_s,
        "output_tok_s": metrics.output_throughput,
        "ttft_ms": dataclasses.asdict(metrics.ttft_ms),
        "tbt_ms": dataclasses.asdict(metrics.tbt_ms),
        "steps": len(steps),
        "steps_per_s": len(steps) / max(capture.duration_s, 1e-9),
        "num_preemptions": metrics.num_preemptions,
        "num_failed": metrics.num_failed,
    }


def decode_bandwidth(path: Path, device: torch.device, batch: int, context: int, vocab: int,
                     num_steps: int) -> dict[str, Any]:
    """A decode-only step of `batch` requests at ~`context` tokens: its time, and the bytes it must
    read (every weight once, and each request's KV) over that time."""
    from inflight import LLM, SamplingParams

    block_size = 16
    blocks = batch * -(-(context + num_steps + 8) // block_size) + 8
    llm = LLM(model=str(path), dtype="bfloat16", device=str(device), max_batch_size=batch, max_num_tokens=8192,
              num_kv_blocks=blocks, enable_prefix_caching=False)
    engine = llm.engine
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (context,), generator=gen).tolist(), params)
    while not engine.step_records or engine.step_records[-1].num_prefill_tokens or \
            engine.step_records[-1].num_requests < batch:
        engine.step()
    for _ in range(2):
        engine.step()
    times = []
    for _ in range(num_steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        assert engine.step_records[-1].num_decode_tokens == batch
    step_s = statistics.median(times)
    model = engine.model
    cfg = model.config
    itemsize = model.dtype.itemsize
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    weight_bytes = (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size) * itemsize
    kv_per_token = 2 * cfg.num_layers * kv * itemsize  # K and V of every layer
    kv_bytes = batch * (context + 4 + num_steps // 2) * kv_per_token
    del llm, engine, model
    achieved = (weight_bytes + kv_bytes) / step_s
    return {"batch": batch, "context": context, "step_ms_median": 1000 * step_s,
            "step_ms_min": 1000 * min(times), "weight_bytes": weight_bytes, "kv_bytes_read": kv_bytes,
            "achieved_bytes_s": achieved, "fraction_of_h200_hbm": achieved / H200_HBM_BYTES_S}


def hf_static(path: Path, device: torch.device, requests: list[Any], batch_size: int) -> dict[str, Any]:
    """transformers' `generate` in static batches of `batch_size` in arrival order, left-padded;
    a batch runs until its longest output is done, and only each request's own tokens count."""
    hf = hf_model(path, torch.bfloat16, device)
    useful = sum(r.max_tokens for r in requests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            group = requests[b:b + batch_size]
            width = max(len(r.prompt_token_ids) for r in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for i, r in enumerate(group):
                n = len(r.prompt_token_ids)
                ids[i, width - n:] = torch.tensor(r.prompt_token_ids)
                mask[i, width - n:] = 1
            longest = max(r.max_tokens for r in group)
            hf.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=longest,
                        min_new_tokens=longest, pad_token_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    del hf
    return {"batch_size": batch_size, "wall_s": wall, "useful_output_tok_s": useful / wall}


def throughput(path: Path, device: torch.device, tiny: bool, seed: int) -> dict[str, Any]:
    cfg = json.loads((path / "config.json").read_text())
    vocab = cfg["vocab_size"]
    scale = 0.1 if tiny else 1.0
    rows: dict[str, Any] = {}
    for label, n, options in (
        ("burst64", 8 if tiny else 64, {"max_batch_size": 64, "max_num_tokens": 2048}),
        ("burst256", 16 if tiny else 256, {"max_batch_size": 256, "max_num_tokens": 2048}),
    ):
        requests = burst(vocab, n, scale, seed)
        tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in requests)
        options = {**options, "num_kv_blocks": tokens // 16 + 2 * n + 16, "enable_prefix_caching": False}
        ours = inflight_burst(path, device, requests, options)
        theirs = hf_static(path, device, requests, 64)
        rows[label] = {"num_requests": n, "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                       "num_output_tokens": sum(r.max_tokens for r in requests), "inflight": ours,
                       "transformers_static": theirs,
                       "ratio": ours["output_tok_s"] / theirs["useful_output_tok_s"]}
    for batch in ((4, 8) if tiny else (64, 256)):
        rows[f"decode{batch}"] = decode_bandwidth(path, device, batch, 48 if tiny else 512, vocab, 8 if tiny else 30)
    return rows


# ---- the run --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(args.models_dir) if args.models_dir else out / "models"
    device = torch.device(args.device)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "imports": check_imports()}
    if not report["imports"]["ok"]:
        print(json.dumps(report, indent=2))
        return 1
    report["environment"] = environment(device)
    t0 = time.perf_counter()

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - t0
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    numerics_shape = "tiny" if args.tiny else "smollm2-135m"
    path = build_model_dir(numerics_shape, models, args.seed)
    lengths = [1, 7, 16, 17, 40] if args.tiny else [1, 7, 16, 17, 100, 300]
    report["numerics"] = numerics(path, device, lengths, 6, 16, args.seed)
    print(f"numerics ({numerics_shape}): {'ok' if report['numerics']['ok'] else 'FAILED'}", flush=True)
    save()
    report["greedy_fp32"] = greedy(path, device, lengths, 8 if args.tiny else 32, args.seed)
    g = report["greedy_fp32"]
    print(f"greedy fp32: {g['num_identical']}/{len(g['prompts'])} identical, {'ok' if g['ok'] else 'FAILED'}",
          flush=True)
    save()
    report["throughput"] = {}
    for shape in (["tiny"] if args.tiny else ["smollm2-135m", "llama-1b"]):
        rows = throughput(build_model_dir(shape, models, args.seed), device, args.tiny, args.seed)
        report["throughput"][shape] = rows
        save()
        for label, row in rows.items():
            if "inflight" in row:
                r = row["inflight"]
                print(f"{shape} {label}: {r['output_tok_s']:.0f} tok/s, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                      f"TBT p99 {r['tbt_ms']['p99']:.1f} ms, {r['steps_per_s']:.1f} steps/s; transformers static "
                      f"{row['transformers_static']['useful_output_tok_s']:.0f} tok/s ({row['ratio']:.2f}x)",
                      flush=True)
            else:
                print(f"{shape} {label}: {row['step_ms_median']:.2f} ms a step, "
                      f"{row['achieved_bytes_s'] / 1e9:.2f} GB/s ({row['fraction_of_h200_hbm']:.2%} of 4.8 TB/s)",
                      flush=True)
    ok = report["numerics"]["ok"] and report["greedy_fp32"]["ok"]
    report["ok"] = ok
    save()
    print(f"wrote {out / 'gpu_check.json'} in {report['elapsed_s']:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
