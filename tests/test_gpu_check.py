"""``bench/gpu_check.py`` end to end on the CPU (``--device cpu --quick``): every section runs and fills its keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: one quick device test (pytest node ids pass through --test-files): the section's own run of pytest and its
#: reading of the results are what is checked here, not the tests, which this suite runs itself
GUARDS = "tests/test_device_guards.py::test_local_rank_picks_the_gpu"


def test_gpu_check_runs_every_section_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    # a caller's own world variables must not leak into the check's child commands either
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MASTER_PORT="1", RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--test-files", GUARDS, "--out", str(out)], capture_output=True, text=True, timeout=900,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    failed = {name: v["error"] for name, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    assert results["tests"]["failed"] == 0 and results["tests"]["passed"] == 1
    assert results["tests"]["files"] == [GUARDS] and results["tests"]["exit_code"] == 0
    assert results["device"]["cuda"] is None and results["mfu"] is None  # no dense peak for a CPU
    for key in ("train_tokens_per_s", "hf_train_tokens_per_s", "predicted_step_s", "measured_step_s",
                "serve_tokens_per_s"):
        assert isinstance(results[key], float | int) and results[key] > 0, (key, results[key])
    assert set(results["generate_tokens_per_s"]) == {"1", "32"}
    assert all(v > 0 for v in results["generate_tokens_per_s"].values())
    assert all(results["generate"][f"hf_generate_tokens_per_s_batch{b}"] > 0 for b in (1, 32))  # the peer ran
    predict = results["predict"]
    assert predict["predicted_on"].endswith("(plait plan, host profile)")  # a CPU: its calibration
    assert predict["calibrate_s"] is None  # --quick: this host's cached profile (the suite's), no calibration
    # plait's bytes measured in the train section beside the dry run's: the same census, so within 1% on a CPU
    # (as tests/test_predict.py's), and no allocator peak to hold the predicted total against
    assert set(predict["memory"]) == {"params", "grads", "optimizer", "activations_peak"}
    for kind, row in predict["memory"].items():
        assert row["measured"] == results["train"]["memory"][kind] and row["predicted"] > 0, kind
        assert row["measured_over_predicted"] == pytest.approx(1.0, rel=0.01), (kind, row)
    assert results["activations_measured_over_predicted"] == predict["memory"]["activations_peak"][
        "measured_over_predicted"]
    assert predict["predicted_total_bytes"] > sum(r["predicted"] for r in predict["memory"].values()) / 2
    assert results["train"]["memory"]["device_peak"] is None and results["device_peak_over_predicted_total"] is None
    step = results["serve_step"]  # the serving runner's decode step alone, and batched decoding's beside it
    assert step["runner_decode_step_ms"] >= step["runner_decode_step_min_ms"] > 0
    assert step["generate_decode_step_ms"] is None or step["generate_decode_step_ms"] > 0
    assert "serving runner" in (out / "serve_profile.txt").read_text()
    gemm = results["gemm"]  # a CPU: its speeds, and no catalogue GPU to hold the planner's costs against
    assert gemm["shapes"] == 5 and gemm["best_tflops"] > 0 and gemm["planner_gpu"] is None
    assert len(json.loads((out / "gemm.json").read_text())["shapes"]) == 5
    rates = results["elementwise"]  # a CPU: the kernels' GB/s, no catalogue bandwidth to share
    assert rates["mul_contiguous_gb_s"] > 0 and rates["mul_rope_table_gb_s"] > 0 and rates["strided_share"] is None
    table = (out / "gpu_check.md").read_text()
    assert "| predict | predicted_step_s |" in table and "| serve | serve_tokens_per_s |" in table
    assert "| predict | activations_measured_over_predicted |" in table


def test_memory_beside_sets_each_kind_and_the_total_beside_the_measurement(monkeypatch) -> None:
    """The predict section's memory rows from a dry run's rank row and the train section's measurement: ratios
    per kind, the predicted total at the activation peak (gradients as held then, the recomputed layer's and
    ZeRO-3's gathered working sets included) beside the allocator's peak; no measurement: no ratios."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_check_memory import memory_beside

    predicted = {"pp_rank": 0, "params": 100, "grads": 50, "optimizer": 200, "activations_peak": 400,
                 "recompute_working": 30, "grads_at_peak": 100, "params_gathered_peak": 20}
    measured = {"params": 100, "grads": 55, "optimizer": 200, "activations_peak": 300, "device_peak": 1700}
    got = memory_beside(predicted, measured)
    assert got["memory"]["grads"] == {"predicted": 50, "measured": 55, "measured_over_predicted": 1.1}
    assert got["activations_measured_over_predicted"] == 0.75 and got["params_measured_over_predicted"] == 1.0
    assert got["predicted_total_bytes"] == 100 + 100 + 200 + 400 + 30 + 20
    assert got["device_peak_bytes"] == 1700 and got["device_peak_over_predicted_total"] == 1700 / 850
    empty = memory_beside(predicted, None)  # the train section failed: the prediction stands alone
    assert empty["memory"]["params"]["measured"] is None and empty["activations_measured_over_predicted"] is None
    assert empty["device_peak_over_predicted_total"] is None and empty["predicted_total_bytes"] == 850


def test_gemm_section_holds_the_planners_costs_against_the_h200_measurement(monkeypatch) -> None:
    """``planner_fit``, what the gemm section reports on a catalogue GPU, given the speeds measured on the H200
    (``plan.measured_gemm_h200``): the planner's cost follows them (correlation 0.73, about 3.5% off after one
    scale, under a flat speed's error), tile and wave quantization on its 132 SMs does not (0.06)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_check_gemm import planner_fit

    from plait.plan.catalogue import get_gpu
    from plait.plan.gemm import scaled_error
    from plait.plan.measured_gemm_h200 import GRID, PUBLISHED

    shapes = [(s.m, s.n, s.k) for s in PUBLISHED + GRID]
    measured = [s.flops_per_s for s in PUBLISHED + GRID]
    fit = planner_fit(get_gpu("h200"), shapes, measured)
    assert fit["planner_gpu"] == "h200"
    assert fit["planner_correlation"] == pytest.approx(0.73, abs=0.01)
    assert fit["planner_scaled_error"] < scaled_error([1.0] * len(shapes), measured)
    assert abs(fit["quantization_correlation"]) < 0.1
    assert planner_fit(get_gpu("b200"), shapes, measured)["quantization_correlation"] is None  # no SM count
