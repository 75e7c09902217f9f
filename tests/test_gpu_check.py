"""benchmarks/gpu_check.py, the CUDA path's one-run check, on CPU with the tiny shape: the same
flow the GPU runs, so that the script cannot rot while no GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CASES = ("alone", "packed", "chunked", "shuffled_pool", "decode_batched")


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_check


def test_the_tiny_run_checks_and_measures_everything(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["imports"]["ok"] and report["ok"]
    numerics = report["numerics"]
    for dtype in ("fp32", "bf16"):
        for case in CASES:
            entry = numerics[f"{dtype}/{case}"]
            assert entry["ok"], (dtype, case, entry)
            assert entry["max_abs_err_vs_hf_fp32"] > 0  # the two really were compared
    assert numerics["fp32/packed"]["max_abs_err_vs_hf_fp32"] <= 2e-3
    assert report["greedy_fp32"]["ok"] and len(report["greedy_fp32"]["prompts"]) == 5
    rows = report["throughput"]["tiny"]
    for label in ("burst64", "burst256"):
        row = rows[label]
        assert row["inflight"]["num_failed"] == 0 and row["inflight"]["output_tok_s"] > 0
        assert row["transformers_static"]["useful_output_tok_s"] > 0 and row["ratio"] > 0
        assert row["inflight"]["steps"] > 0 and row["inflight"]["ttft_ms"]["count"] == row["num_requests"]
    for label in ("decode4", "decode8"):
        row = rows[label]
        assert row["step_ms_median"] > 0 and row["weight_bytes"] > 0 and row["kv_bytes_read"] > 0
    assert "tok/s" in proc.stdout and "GB/s" in proc.stdout


def test_the_numerics_check_catches_wrong_logits(gpu_check, tmp_path, monkeypatch):
    """A model whose logits are off by a hundredth fails the fp32 checks: the tolerance bites."""
    from inflight.model.llama import LlamaModel

    path = gpu_check.build_model_dir("tiny", tmp_path, 0)
    forward = LlamaModel.forward
    monkeypatch.setattr(LlamaModel, "forward", lambda self, *a: forward(self, *a) + 0.01)
    result = gpu_check.numerics(path, torch.device("cpu"), [3, 20], 2, 16, 0)
    assert not result["ok"]
    assert not any(result[f"fp32/{case}"]["ok"] for case in CASES)
