"""The pre-launch gate against another engine's real server: starts it on the embedded model (or
--model), runs `inflight bench --url` with an SLA, captures the server's `/metrics` (and, for
llama-server, `/slots`) while the traffic runs, runs `inflight check`, and stops the server.

    # llama.cpp's server, built from the sources in the llama-cpp-python sdist:
    #   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp && tar ...
    #   cmake -S vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON && \\
    #   cmake --build build --target llama-server -j2
    .venv/bin/python benchmarks/gate_real_server.py llama-server --binary /tmp/.../bin/llama-server \\
        --output benchmarks/results/gate-llama-server.json --capture tests/fixtures/metrics

    # vLLM's CPU build in its own environment (benchmarks/README.md installs it); it is served the
    # GGUF's weights dequantized to an fp32 HF directory (as benchmarks/peers.py does), its KV pool
    # VLLM_CPU_KVCACHE_SPACE GiB (--vllm-kv-gib, default 1):
    .venv/bin/python benchmarks/gate_real_server.py vllm --python /tmp/vllm-env/bin/python \
        --output benchmarks/results/gate-vllm.json --capture tests/fixtures/metrics --version-tag 0.32.0
    # inflight's own server, for a side-by-side on the same model, load and SLA:
    .venv/bin/python benchmarks/gate_real_server.py inflight --output benchmarks/results/gate-inflight.json
    # with --find-max-rate 4: the highest rate the SLA holds at, in at most 4 runs, and its plot

What it prints: the bench's table and its line on what the sampling read, then the check. The
run file is `--output`, its HTML report beside it (`.html`); with `--capture DIR`, one mid-run
scrape of `/metrics` is written to DIR/ENGINE-VERSION-captured.txt (and `/slots` beside it) for
the parser tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from serving import free_port  # noqa: E402

SLA = HERE / "gate" / "sla-small-cpu.yaml"
WORKLOAD = HERE / "gate" / "chat-small.yaml"


def start(engine: str, args: argparse.Namespace, model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    if engine == "llama-server":
        command = [args.binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--metrics",
                   "-np", str(args.parallel), "-c", str(args.parallel * args.ctx_per_slot), "-t", str(args.threads),
                   "--no-webui"]
    elif engine == "inflight":  # for a side-by-side: inflight's own server on the same model and load
        command = [sys.executable, "-m", "inflight.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
                   "--port", str(port), "--max-batch-size", str(args.parallel),
                   "--max-model-len", str(args.ctx_per_slot),
                   "--num-kv-blocks", str(args.parallel * args.ctx_per_slot // 16)]  # llama-server's KV, in tokens
    else:  # vllm's OpenAI server, CPU build, on the GGUF's weights as an fp32 HF directory
        command = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_model_dir(model)),
                   "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.parallel),
                   "--max-model-len", str(args.ctx_per_slot), "--max-num-batched-tokens", "512",
                   "--dtype", "float32", "--served-model-name", "model"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def vllm_model_dir(model: Path) -> Path:
    """The GGUF dequantized by transformers and written as a plain HF checkpoint, once, in the
    temporary folder (hundreds of MB: never beside the records)."""
    out = Path(tempfile.gettempdir()) / f"inflight-vllm-{model.stem}"
    if not (out / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM

        sys.path.insert(0, str(HERE / "peers"))
        from hf_runners import export_hf_dir

        from inflight.model.loader import resolve_model
        from inflight.model.tokenizer import Tokenizer

        hf = AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name, dtype=torch.float32)
        export_hf_dir(hf, Tokenizer.load(resolve_model(str(model))).hf, out)
    return out


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited during startup; see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not come up in {timeout_s:.0f} s; see {log}")


def capture(url: str, folder: Path, name: str, after_s: float, done: threading.Event) -> None:
    """One scrape of /metrics (and /slots) `after_s` into the run, while requests are in flight."""
    if done.wait(after_s):
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}-captured.txt").write_text(httpx.get(url + "/metrics", timeout=10).text)
    slots = httpx.get(url + "/slots", timeout=10)
    if slots.status_code == 200:
        (folder / f"{name}-captured-slots.json").write_text(json.dumps(slots.json(), indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", choices=("llama-server", "vllm", "inflight"))
    p.add_argument("--binary", help="llama-server's executable")
    p.add_argument("--python", help="a Python where vllm is installed")
    p.add_argument("--model", default=None, help="a GGUF (default: the embedded model)")
    p.add_argument("--parallel", type=int, default=8, help="slots / max-num-seqs (default 8)")
    p.add_argument("--ctx-per-slot", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's KV pool (VLLM_CPU_KVCACHE_SPACE, default 1)")
    p.add_argument("--workload", default=str(WORKLOAD))
    p.add_argument("--sla", default=str(SLA))
    p.add_argument("--output", required=True, help="the bench's run file")
    p.add_argument("--capture", metavar="DIR", help="write a mid-run /metrics scrape (and /slots) here")
    p.add_argument("--capture-after", type=float, default=3.0, help="seconds into the run (default 3)")
    p.add_argument("--version-tag", default="", help="the engine's version, for the capture's file name")
    p.add_argument("--find-max-rate", type=int, default=0, metavar="TRIALS",
                   help="instead of one run, search the highest passing rate in at most TRIALS runs")
    args = p.parse_args()
    if args.engine == "llama-server" and not args.binary:
        p.error("llama-server needs --binary")
    if args.engine == "vllm" and not args.python:
        p.error("vllm needs --python")
    from inflight.model.loader import resolve_model

    model = resolve_model(args.model).path
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(args.output).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = start(args.engine, args, model, port, log)
    done = threading.Event()
    try:
        wait_ready(proc, url, log)
        catcher = None
        if args.capture:
            kind = {"llama-server": "llama.cpp"}.get(args.engine, args.engine)
            name = f"{kind}-{args.version_tag or 'local'}"
            catcher = threading.Thread(target=capture, args=(url, Path(args.capture), name, args.capture_after, done))
            catcher.start()
        bench = [sys.executable, "-m", "inflight.cli", "bench", "--workload", args.workload, "--url", url,
                 "--sla", args.sla, "--output", args.output, "--no-progress", "--metrics-interval", "0.25",
                 "--report", str(Path(args.output).with_suffix(".html"))]
        if args.model:
            bench += ["--model", args.model]
        if args.find_max_rate:
            bench += ["--find-max-rate", "--max-trials", str(args.find_max_rate), "--start-rate", "1",
                      "--rate-tolerance", "0.25", "--plot", str(Path(args.output).with_suffix(""))]
        code = subprocess.run(bench, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
        done.set()
        if catcher is not None:
            catcher.join()
        print(f"inflight bench exited {code}")
        if args.find_max_rate:  # the search checked every trial; its exit code says whether any passed
            return code
        check = subprocess.run([sys.executable, "-m", "inflight.cli", "check", "--sla", args.sla, args.output])
        return check.returncode
    finally:
        done.set()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
