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
    # its steps met for the first time and again, with the keys' length rounded and exact (a CPU: exact by default)
    assert step["runner_decode_step_warm_ms"] > 0 and step["round_keys_default"] is False
    assert step["runner_exact_keys_decode_step_ms"] > 0 and step["runner_exact_keys_decode_step_warm_ms"] > 0
    assert step["generate_decode_step_ms"] is None or step["generate_decode_step_ms"] > 0
    assert step["generate_decode_step_cold_ms"] is None or step["generate_decode_step_cold_ms"] > 0
    assert "serving runner" in (out / "serve_profile.txt").read_text()
    gemm = results["gemm"]  # a CPU: its speeds, and no catalogue GPU to hold the planner's costs against
    assert gemm["shapes"] == 5 and gemm["best_tflops"] > 0 and gemm["planner_gpu"] is None
    assert len(json.loads((out / "gemm.json").read_text())["shapes"]) == 5
    assert results["attention"]["flash_shapes_run"] == 4 and (out / "attention.json").exists()
    rates = results["elementwise"]  # a CPU: the kernels' GB/s, no catalogue bandwidth to share
    assert rates["mul_contiguous_gb_s"] > 0 and rates["mul_rope_table_gb_s"] > 0 and rates["strided_share"] is None
    table = (out / "gpu_check.md").read_text()
    assert "| predict | predicted_step_s |" in table and "| serve | serve_tokens_per_s |" in table
    assert "| predict | activations_measured_over_predicted |" in table


def test_memory_beside_sets_each_kind_and_the_total_beside_the_measurement(monkeypatch) -> None:
    """The predict section's memory rows from a dry run's rank row and the train section's measurement: ratios
    per kind, the predicted peak of the step (the row's ``total``, the bytes held beside the activations
    included) beside the allocator's peak, and the predicted model states beside what the allocator holds as the
    step starts; no measurement: no ratios."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_check_memory import memory_beside

    predicted = {"pp_rank": 0, "params": 100, "grads": 50, "optimizer": 200, "activations_peak": 400,
                 "recompute_working": 30, "grads_at_peak": 100, "params_gathered_peak": 20, "weight_copies": 50,
                 "loss_backward": 60, "total": 960}
    measured = {"params": 100, "grads": 55, "optimizer": 200, "activations_peak": 300, "device_peak": 1700,
                "device_at_rest": 385, "device_peak_forward_backward": 1700, "device_peak_optimizer": 400}
    got = memory_beside(predicted, measured)
    assert got["memory"]["grads"] == {"predicted": 50, "measured": 55, "measured_over_predicted": 1.1}
    assert got["activations_measured_over_predicted"] == 0.75 and got["params_measured_over_predicted"] == 1.0
    assert got["predicted_total_bytes"] == 960 and got["predicted_loss_backward_bytes"] == 60
    assert got["device_peak_bytes"] == 1700 and got["device_peak_over_predicted_total"] == 1700 / 960
    assert got["device_at_rest_over_predicted_states"] == 385 / 350 and got["device_peak_optimizer_bytes"] == 400
    empty = memory_beside(predicted, None)  # the train section failed: the prediction stands alone
    assert empty["memory"]["params"]["measured"] is None and empty["activations_measured_over_predicted"] is None
    assert empty["device_peak_over_predicted_total"] is None and empty["predicted_total_bytes"] == 960


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


def test_attention_section_times_each_backend_that_runs_and_says_why_the_others_do_not(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """The attention section on a CPU (its tiny grid and the train section's attention): SDPA's flash backend runs
    every shape in both passes and is the one SDPA picks; cuDNN's and the efficient kernel, CUDA only, are
    recorded refused with SDPA's reason; every timing lands in attention.json; no catalogue GPU, no planner."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import torch
    from gpu_check import CPU_MODEL
    from gpu_check_attention import BACKENDS, MODES, attention_section

    got = attention_section(torch.device("cpu"), {"model": CPU_MODEL, "batch": 2, "seq": 128}, True, tmp_path)
    assert got["shapes"] == 5 and got["default_backends"] == "flash" and got["plait_backend"] == "flash"
    assert got["flash_shapes_run"] == 4 and got["cudnn_shapes_run"] == got["efficient_shapes_run"] == 0
    assert got["flash_median_fwd_bwd_tflops"] > 0 and got["plait_fwd_bwd_tflops"] > 0
    assert got["planner_gpu"] is None and got["plait_planner_flash2_tflops"] is None
    saved = json.loads((tmp_path / "attention.json").read_text())
    plait = saved["shapes"][-1]  # the train section's attention, grouped-query as plait's Llama runs it
    assert (plait["case"], plait["heads"], plait["kv_heads"], plait["seq"]) == ("plait", 4, 2, 128)
    for shape in saved["shapes"]:
        assert set(shape["tflops"]) == set(BACKENDS)
        assert all(len(shape["tflops"]["flash"][m]) == 2 and min(shape["tflops"]["flash"][m]) > 0 for m in MODES)
        assert "No viable backend" in shape["tflops"]["cudnn"]["refused"]
    cut = attention_section(torch.device("cpu"), {"model": CPU_MODEL, "batch": 2, "seq": 128}, True, tmp_path,
                            budget_s=0.0)  # out of time before the first shape: every pass cut, nothing timed
    assert cut["shape_passes_cut"] == 10 and cut["flash_shapes_run"] == 0 and cut["plait_fwd_bwd_tflops"] is None
    assert got["shape_passes_cut"] == 0 and cut["median_pass_scatter"] is None and cut["default_backends"] == ""


def test_attention_planner_speeds_and_summary_on_the_h200(monkeypatch) -> None:
    """Beside each shape the planner's speed of flash2 and cudnn on the catalogue GPU (the H200 takes the H100's
    published figures: FlashAttention-2 at 2048 tokens, head dimension 128, 265 TFLOP/s forward + backward); an
    A100, with no published cuDNN figure, only flash2; the summary holds each backend against its kernel."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_check_attention import causal_forward_flops, planner_tflops, summary

    from plait.plan.attention import efficiency
    from plait.plan.catalogue import get_gpu

    h200 = get_gpu("h200")
    speeds = planner_tflops(h200, 2048, 128)
    assert speeds["flash2"] == 265.0
    assert speeds["cudnn"] == round(efficiency(h200, "cudnn", 2048, 128) * 989, 1) > speeds["flash2"]
    assert set(planner_tflops(get_gpu("a100"), 2048, 128)) == {"flash2"}
    assert causal_forward_flops(2, 3, 8, 4) == 2 * 2 * 3 * 8 * 8 * 4

    def row(case: str, backend: str, flash: float, cudnn: float) -> dict:  # each pass 10% off the speed
        return {"case": case, "default_backend": backend, "planner_tflops": speeds,
                "tflops": {"flash": {"forward": [0.9, 1.1], "fwd_bwd": [flash * 0.9, flash * 1.1]},
                           "cudnn": {"forward": [0.9, 1.1], "fwd_bwd": [cudnn * 0.9, cudnn * 1.1]},
                           "efficient": {"refused": "why"}}}

    got = summary([row("h2048", "cudnn", 265.0, speeds["cudnn"]), row("h2048", "flash", 132.5, speeds["cudnn"] / 2),
                   row("plait", "cudnn", 200.0, 500.0)], "h200")
    assert got["default_backends"] == "cudnn,flash" and got["efficient_shapes_run"] == 0
    assert got["flash_over_planner_flash2"] == 0.75 and got["cudnn_over_planner_cudnn"] == 0.75
    assert got["median_pass_scatter"] == round(0.2 / 1.1, 4)
    assert (got["plait_backend"], got["plait_fwd_bwd_tflops"], got["plait_planner_flash2_tflops"]) == \
        ("cudnn", 500.0, 265.0)
