"""Row (f): llama.cpp through llama-cpp-python's low-level API, run as a subprocess in its own
environment: `PYTHON llama_cpp_runner.py JOB.json RESULT.json`.

A small continuous-batching loop in the style of llama-server: up to `n_seq_max` sequences,
each step one `llama_decode` over a batch of at most `n_batch` tokens: one token for every
decoding sequence, then prompt tokens of newly admitted sequences (chunked) to fill the rest.
Greedy: argmax of each sequence's logits. The weights stay as they are in the GGUF (Q4_1), so
llama.cpp does quantized matmuls where the other rows compute in fp32.

Written against llama-cpp-python 0.3.x (llama.cpp's `llama_model_load_from_file`,
`llama_init_from_model`, `llama_memory_seq_rm`), with fallbacks to older names.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from peer_protocol import (
    Clock,
    PeerRecord,
    PeerRequest,
    RunResult,
    read_job,
    warmup_requests,
    write_result,
)


def _fn(lib, *names):
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise AttributeError(f"llama_cpp has none of {names}")


@dataclass
class _Seq:
    index: int
    seq_id: int
    prompt: list[int]
    max_tokens: int
    num_fed: int = 0  # tokens already in the KV cache
    outputs: list[int] = field(default_factory=list)

    @property
    def in_prefill(self) -> bool:
        return self.num_fed < len(self.prompt)


class LlamaCppRunner:
    def __init__(self, model_path: str, n_seq_max: int, n_ctx_per_seq: int, n_batch: int,
                 n_threads: int) -> None:
        import llama_cpp as lib
        import numpy as np

        self.lib, self.np = lib, np
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = _fn(lib, "llama_model_load_from_file", "llama_load_model_from_file")(
            model_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        if hasattr(lib, "llama_model_get_vocab"):
            self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        else:
            self.n_vocab = lib.llama_n_vocab(self.model)
        ctx_params = lib.llama_context_default_params()
        # Per-sequence KV streams (the default, not kv_unified): each sequence gets n_ctx / n_seq_max.
        ctx_params.n_ctx = n_seq_max * n_ctx_per_seq
        ctx_params.n_batch = ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = n_seq_max
        ctx_params.n_threads = ctx_params.n_threads_batch = n_threads
        self.ctx = _fn(lib, "llama_init_from_model", "llama_new_context_with_model")(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_seq_max, self.n_batch = n_seq_max, n_batch
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        _fn(self.lib, "llama_model_free", "llama_free_model")(self.model)

    def _forget(self, seq_id: int) -> None:
        lib = self.lib
        if hasattr(lib, "llama_memory_seq_rm"):
            lib.llama_memory_seq_rm(lib.llama_get_memory(self.ctx), seq_id, -1, -1)
        else:
            _fn(lib, "llama_kv_self_seq_rm", "llama_kv_cache_seq_rm")(self.ctx, seq_id, -1, -1)

    def run(self, requests: list[PeerRequest], clock: Clock) -> list[PeerRecord]:
        clock.start()
        records = [PeerRecord(r.arrival_s) for r in requests]
        waiting: deque[int] = deque()
        free_ids = deque(range(self.n_seq_max))
        running: list[_Seq] = []
        while clock.has_pending or waiting or running:
            waiting.extend(clock.due())
            while waiting and free_ids:
                i = waiting.popleft()
                r = requests[i]
                running.append(_Seq(i, free_ids.popleft(), r.prompt_token_ids, r.max_tokens))
            if not running:
                clock.wait_for_next()
                continue
            wanted = self._step(running)
            now = clock.now()
            for seq, token in wanted:
                seq.outputs.append(token)
                records[seq.index].token_times_s.append(now)
            for seq in [s for s in running if len(s.outputs) >= s.max_tokens]:
                records[seq.index].token_ids = seq.outputs
                running.remove(seq)
                self._forget(seq.seq_id)
                free_ids.append(seq.seq_id)
        return records

    def _step(self, running: list[_Seq]) -> list[tuple[_Seq, int]]:
        """One llama_decode: decodes first, then prompt chunks in admission order."""
        batch, n = self.batch, 0
        wanted: list[tuple[_Seq, int]] = []  # (sequence, batch row whose logits it needs)

        def add(seq: _Seq, token: int, logits: bool) -> None:
            nonlocal n
            batch.token[n], batch.pos[n] = token, seq.num_fed
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq.seq_id
            batch.logits[n] = 1 if logits else 0
            if logits:
                wanted.append((seq, n))
            seq.num_fed += 1
            n += 1

        for seq in running:
            if not seq.in_prefill and n < self.n_batch:
                add(seq, seq.outputs[-1], True)
        for seq in running:
            while seq.in_prefill and n < self.n_batch:
                add(seq, seq.prompt[seq.num_fed], seq.num_fed == len(seq.prompt) - 1)
        batch.n_tokens = n
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")
        return [(seq, self._argmax(row)) for seq, row in wanted]

    def _argmax(self, row: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())


def main(job_path: str, result_path: str) -> None:
    requests, options = read_job(job_path)
    import llama_cpp

    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    n_ctx_per_seq = 256 * ((longest + 255) // 256)
    n_seq_max = min(options.get("max_num_seqs", 64), len(requests))
    runner = LlamaCppRunner(options["gguf_path"], max(n_seq_max, 2), n_ctx_per_seq,
                            options.get("max_num_tokens", 512), options.get("threads") or os.cpu_count() or 1)
    try:
        runner.run(warmup_requests(), Clock(warmup_requests()))
        clock = Clock(requests)
        records = runner.run(requests, clock)
    finally:
        runner.close()
    info = {
        "version": getattr(llama_cpp, "__version__", "?"),
        "n_seq_max": n_seq_max,
        "n_batch": runner.n_batch,
        "n_ctx_per_seq": n_ctx_per_seq,
        "weights": "Q4_1 as stored in the GGUF",
    }
    write_result(result_path, RunResult("llama.cpp", clock.wall_s(records), records, info))


if __name__ == "__main__":
    t = time.perf_counter()
    main(sys.argv[1], sys.argv[2])
    print(f"llama.cpp runner done in {time.perf_counter() - t:.1f} s", file=sys.stderr)
