"""The fp32 matmul's per-machine choices (model/kernel_tuning.py): none changes a result, the
timing's record is kept and read back, and a record that does not fit this build or CPU is made
again."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, astuple

import pytest
import torch

from inflight.model import kernel_tuning
from inflight.model.kernel_tuning import GemmTuning, TuningShape
from inflight.model.kernels import cpu_kernels
from tests.test_linear import random_blocks

SMALL = TuningShape(out_features=128, in_features=64, num_matrices=2, rounds=1)


@pytest.fixture
def kernels():
    module = cpu_kernels()
    if module is None:
        pytest.skip("inflight kernel not available here")
    saved = module.gemm_tuning()
    yield module
    module.set_gemm_tuning(*saved)


def test_no_choice_changes_a_result(kernels):
    """Every output is the same in-order sum over k, whichever rows share a microkernel pass and
    whether the passes prefetch: the fp32 panels and the GGUF blocks' panel path, bit for bit."""
    most = kernels.gemm_max_rows()
    torch.manual_seed(0)
    weight = torch.randn(200, 96)
    packed = kernels.pack_linear_weight(weight)
    blocks = None
    if kernels.gguf_blocks_available():
        raw, _ = random_blocks("Q4_K", 80, 256, seed=3)
        blocks = kernels.pack_gguf_blocks([raw], ["Q4_K"], 256)
    x, xq = torch.randn(300, 96), torch.randn(300, 256)
    rows = (1, 4, most - 1, most, most + 1, 3 * most - 2, 64, 300)
    kernels.set_gemm_tuning(most, True, True)
    expected = {m: kernels.packed_linear(x[:m], packed, None, 200) for m in rows}
    expected_blocks = {m: kernels.gguf_blocks_gemm(xq[:m], blocks, 80) for m in rows} if blocks is not None else {}
    choices = itertools.product(sorted({1, (most + 1) // 2, most}), (True, False), (True, False))
    for max_rows, one_pass, passes in choices:
        kernels.set_gemm_tuning(max_rows, one_pass, passes)
        assert kernels.gemm_tuning() == (max_rows, one_pass, passes)
        for m in rows:
            assert torch.equal(kernels.packed_linear(x[:m], packed, None, 200), expected[m]), (max_rows, m)
            if blocks is not None:
                assert torch.equal(kernels.gguf_blocks_gemm(xq[:m], blocks, 80), expected_blocks[m]), (max_rows, m)
    torch.testing.assert_close(expected[64], x[:64] @ weight.T, atol=1e-4, rtol=1e-5)
    for bad in (0, most + 1):
        with pytest.raises(RuntimeError, match="max_rows must be 1 to"):
            kernels.set_gemm_tuning(bad, True, True)


def test_the_other_value_needs_a_margin():
    assert kernel_tuning.prefers_other([10.0, 10.0, 10.0], [9.0, 9.2, 11.0]) == (True, pytest.approx(0.92))
    assert not kernel_tuning.prefers_other([10.0, 10.0, 10.0], [9.7, 9.6, 9.8])[0]  # 3% is noise here
    assert not kernel_tuning.prefers_other([10.0, 10.0, 10.0], [8.0, 12.0, 10.5])[0]


def test_the_record_is_kept_read_back_and_redone_when_it_does_not_fit(kernels, tmp_path, monkeypatch):
    chosen = kernel_tuning.apply(kernels, tmp_path, SMALL)
    record = json.loads((tmp_path / kernel_tuning.TUNING_FILE).read_text())
    assert record["cpu"] == kernel_tuning.cpu_identity() and record["isa"] == kernels.isa()
    assert GemmTuning(**record["choice"]) == chosen
    assert kernels.gemm_tuning() == astuple(chosen)
    if kernels.isa() != "generic":  # each comparison timed in alternated rounds
        assert [t["setting"] for t in record["trials"]][:2] == ["prefetch_one_pass", "prefetch_passes"]
        assert all(len(t["default_ms"]) == len(t["other_ms"]) == SMALL.rounds for t in record["trials"])
    assert "timed" in kernel_tuning.describe(tmp_path)

    timed = []
    real_tune = kernel_tuning.tune

    def counting_tune(module, shape):
        timed.append(shape)
        return real_tune(module, shape)

    monkeypatch.setattr(kernel_tuning, "tune", counting_tune)
    # Kept: read, not timed again; the module takes the recorded choice.
    other = GemmTuning(max_rows=1, prefetch_one_pass=False, prefetch_passes=True)
    (tmp_path / kernel_tuning.TUNING_FILE).write_text(json.dumps({**record, "choice": asdict(other)}))
    assert kernel_tuning.apply(kernels, tmp_path, SMALL) == other
    assert kernels.gemm_tuning() == (1, False, True) and not timed
    # Made again: another CPU's record, another version's, a choice this build cannot take, damage.
    for damaged in (json.dumps({**record, "cpu": "another CPU"}), json.dumps({**record, "version": 0}),
                    json.dumps({**record, "choice": {**record["choice"], "max_rows": kernels.gemm_max_rows() + 1}}),
                    json.dumps({**record, "choice": {"max_rows": 4, "prefetch_one_pass": "yes"}}),
                    "{not json"):
        (tmp_path / kernel_tuning.TUNING_FILE).write_text(damaged)
        kernel_tuning.apply(kernels, tmp_path, SMALL)
        assert json.loads((tmp_path / kernel_tuning.TUNING_FILE).read_text())["cpu"] == kernel_tuning.cpu_identity()
    assert len(timed) == 5


def test_a_cache_it_cannot_write_still_gets_a_choice(kernels, tmp_path, caplog):
    """Where the build's directory takes no file (here: it is under a plain file), the choice is
    timed and used, and the log says it could not be kept."""
    (tmp_path / "a-file").write_text("")
    nowhere = tmp_path / "a-file" / "build"
    tuning = kernel_tuning.apply(kernels, nowhere, SMALL)
    assert kernels.gemm_tuning() == astuple(tuning)
    assert "could not keep the matmul tuning" in caplog.text


def test_a_failed_timing_leaves_the_kernels_usable(kernels, monkeypatch, caplog):
    """Where the timing cannot run (no memory for its matrices), the kernels keep their defaults
    and say so; loading them does not fail."""
    from inflight.model import kernels as kernels_module

    def fail(module, build_dir):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    kernels.set_gemm_tuning(kernels.gemm_max_rows(), True, True)
    monkeypatch.setattr(kernel_tuning, "apply", fail)
    kernels_module.tune(kernels)
    assert "fp32 matmul tuning skipped (DefaultCPUAllocator" in caplog.text
    assert kernels.gemm_tuning() == (kernels.gemm_max_rows(), True, True)
