"""Rows (a) and (b): Hugging Face transformers on the same GGUF file, dequantized to fp32 by
transformers' own GGUF loader; plus the export of that model as an HF directory for vLLM."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from peer_protocol import Clock, PeerRecord, PeerRequest, RunResult, warmup_requests

STATIC_BATCH_SIZE = 16
CB_MAX_BATCH_TOKENS = 512
CB_MAX_REQUESTS = 64


def load_hf_model(gguf_path: Path) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    # Fixed output lengths: generate() fills unset fields from the model's own generation
    # config, so EOS is only truly off once it is gone from there.
    model.generation_config.eos_token_id = None
    return model.eval()


# --- (a) generate() in static batches ---------------------------------------------------------


class _StepTimes:
    """A streamer that only stamps the time of each decoding step (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def run_hf_static(model: Any, requests: list[PeerRequest], pad_id: int) -> RunResult:
    """Batches of up to 16 in arrival order, each started when the previous one is done and
    with whatever has arrived by then. A batch is left-padded and runs to its longest output;
    each request keeps only its own first `max_tokens` tokens, so the extra steps of shorter
    members are the static baseline's waste, counted as time but not as generated tokens."""
    _static_loop(model, warmup_requests(), Clock(warmup_requests()), pad_id)
    clock = Clock(requests)
    records = _static_loop(model, requests, clock, pad_id)
    info = {"batch_size": STATIC_BATCH_SIZE, "padding": "left", "attn": model.config._attn_implementation}
    return RunResult("hf-static", clock.wall_s(records), records, info)


def _static_loop(model: Any, requests: list[PeerRequest], clock: Clock, pad_id: int) -> list[PeerRecord]:
    clock.start()
    records = [PeerRecord(r.arrival_s) for r in requests]
    waiting: deque[int] = deque()
    while clock.has_pending or waiting:
        waiting.extend(clock.due())
        if not waiting:
            clock.wait_for_next()
            continue
        batch = [waiting.popleft() for _ in range(min(STATIC_BATCH_SIZE, len(waiting)))]
        tokens, times = _generate(model, [requests[i] for i in batch], pad_id)
        for row, i in enumerate(batch):
            n = requests[i].max_tokens
            records[i].token_ids = tokens[row][:n]
            records[i].token_times_s = [t - clock.t0 for t in times[:n]]
    return records


@torch.inference_mode()
def _generate(model: Any, batch: list[PeerRequest], pad_id: int) -> tuple[list[list[int]], list[float]]:
    from transformers import GenerationConfig

    longest = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        ids[row, longest - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, longest - len(r.prompt_token_ids):] = 1
    max_new = max(r.max_tokens for r in batch)
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)
    streamer = _StepTimes()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=streamer)
    return out[:, longest:].tolist(), streamer.times


# --- (b) transformers' continuous batching ----------------------------------------------------


def run_hf_continuous(model: Any, requests: list[PeerRequest]) -> RunResult:
    """The manager API: a background thread schedules; each request is added at its arrival
    time with its own `max_new_tokens` and per-token timestamps on."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page_size = 256
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        # Room for every request at its full length, as for inflight: no eviction anywhere.
        num_blocks=sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / page_size) + 1 for r in requests),
        max_batch_tokens=CB_MAX_BATCH_TOKENS,
        max_requests_per_batch=CB_MAX_REQUESTS,
        auto_switch_to_flash=False,
        use_cuda_graph=False,
        use_async_batching=False,
    )
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=16)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
    manager.start()
    try:
        _cb_loop(manager, warmup_requests(), Clock(warmup_requests()), "warm")
        clock = Clock(requests)
        records = _cb_loop(manager, requests, clock, "req")
    finally:
        manager.stop(block=True)
    info = {
        "attn": model.config._attn_implementation,
        "page_size": page_size,
        "max_batch_tokens": CB_MAX_BATCH_TOKENS,
        "max_requests_per_batch": CB_MAX_REQUESTS,
    }
    return RunResult("hf-continuous", clock.wall_s(records), records, info)


def _cb_loop(manager: Any, requests: list[PeerRequest], clock: Clock, prefix: str) -> list[PeerRecord]:
    clock.start()
    records = [PeerRecord(r.arrival_s) for r in requests]
    num_done = 0
    while num_done < len(requests):
        for i in clock.due():
            r = requests[i]
            manager.add_request(r.prompt_token_ids, request_id=f"{prefix}-{i}", max_new_tokens=r.max_tokens,
                                record_timestamps=True, eos_token_id=-1)
        # Wait for a result, but wake in time for the next arrival.
        to_next = clock.seconds_to_next()
        result = manager.get_result(timeout=0.5 if to_next is None else max(0.001, min(0.5, to_next)))
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"transformers' continuous batching failed {result.request_id}: "
                               f"{result.error}")
        i = int(result.request_id.rsplit("-", 1)[1])
        records[i].token_ids = list(result.generated_tokens)
        records[i].token_times_s = [t - clock.t0 for t in result.timestamps or []]
        num_done += 1
    return records


# --- the HF directory that vLLM loads ----------------------------------------------------------


def export_hf_dir(model: Any, tokenizer: Any, out_dir: Path) -> Path:
    """The dequantized fp32 weights as a plain HF checkpoint (safetensors + config.json).
    Written by hand: transformers refuses to save a model that came from GGUF."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain fp32 now, not GGUF blocks
    config["architectures"] = [type(model).__name__]
    config["dtype"] = config["torch_dtype"] = "float32"
    # Also the pre-v5 spellings, for a vLLM environment on an older transformers.
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    tied = bool(config.get("tie_word_embeddings"))
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out_dir)
    tokenizer_config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    # v5's "TokenizersBackend" is unknown to transformers v4.
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2))
    return out_dir
