"""The prediction ``plait train`` shows on a host with a GPU: the planner's GPU model of that GPU (the driver's
name mapped to the catalogue), never a CPU calibration; ``plait calibrate`` refuses such a host."""

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import plait.devices
from plait.cli.main import app
from plait.errors import ConfigError
from plait.plan.catalogue import GPUS, gpu_of_device
from plait.plan.cluster import Cluster
from plait.train.config import TrainConfig


def test_driver_names_map_to_the_catalogue():
    """The names torch.cuda.get_device_name reports on each card; cards the catalogue lacks map to None."""
    assert gpu_of_device("NVIDIA H200") is GPUS["h200"]
    assert gpu_of_device("NVIDIA H100 80GB HBM3") is GPUS["h100-sxm"]
    assert gpu_of_device("NVIDIA H100 PCIe") is GPUS["h100-pcie"]
    assert gpu_of_device("NVIDIA A100-SXM4-40GB") is GPUS["a100-40gb"]
    assert gpu_of_device("NVIDIA A100-SXM4-80GB") is GPUS["a100-80gb"]
    assert gpu_of_device("NVIDIA L40S") is GPUS["l40s"]
    assert gpu_of_device("NVIDIA A100-PCIE-40GB") is None
    assert gpu_of_device("NVIDIA GeForce RTX 4090") is None


def test_dry_run_on_a_gpu_host_uses_the_gpu_model(tmp_path, monkeypatch):
    """With no --cluster on an H200 host, --dry-run costs the run on that many H200s with the GPU model and the
    attention kernel torch's SDPA runs there (cuDNN's), and says so; on a GPU the catalogue lacks it names the GPU
    and the way out."""
    from plait.cli.predict import predict

    monkeypatch.setattr(plait.devices, "accelerator_name", lambda: "NVIDIA H200")
    metrics = tmp_path / "m.jsonl"
    flags = ["--model", "small", "--tp", "2", "--pp", "2", "--seq-len", "64", "--batch-size", "8", "--dry-run"]
    r = CliRunner().invoke(app, ["train", *flags, "--metrics", str(metrics)])
    assert r.exit_code == 0, r.output
    row = json.loads(metrics.read_text())
    cfg = TrainConfig.from_dict({"model": "small", "tp": 2, "pp": 2, "seq_len": 64, "batch_size": 8})
    est = predict(cfg, Cluster("h200", 4, gpus_per_node=4, flash_attention="cudnn"), 4)
    assert row["predicted_step_time_s"] == pytest.approx(est.step_time_s)
    flash2 = predict(cfg, Cluster("h200", 4, gpus_per_node=4, flash_attention="flash2"), 4)
    assert row["predicted_step_time_s"] < flash2.step_time_s  # cuDNN's published speed is above FlashAttention-2's
    assert row["predicted_on"] == "NVIDIA H200 SXM 141GB (plait plan, GPU model)"
    assert "GPU model" in r.output
    monkeypatch.setattr(plait.devices, "accelerator_name", lambda: "NVIDIA GeForce RTX 4090")
    r = CliRunner().invoke(app, ["train", *flags])
    assert r.exit_code == 2 and "RTX 4090" in r.output and "--cluster none" in r.output


def test_the_trainers_predictor_on_a_gpu_uses_the_gpu_model(monkeypatch):
    """``plait train``'s predictor on a GPU run (rank 0 of one) predicts with the GPU model, measuring nothing."""
    from plait.cli.predict import HostPredictor, predict

    monkeypatch.setattr(plait.devices, "accelerator_name", lambda: "NVIDIA H100 80GB HBM3")
    cfg = TrainConfig.from_dict({"model": "small", "tp": 1, "pp": 1, "dp": 1, "seq_len": 64, "batch_size": 4})
    run = SimpleNamespace(cfg=cfg, ctx=SimpleNamespace(device=torch.device("cuda", 0), world_size=1, rank=0),
                          data=None)  # no --data: the synthetic batches
    got = HostPredictor().predict(run)  # type: ignore[arg-type]
    assert got is not None and got.source == "NVIDIA H100 SXM5 80GB (plait plan, GPU model)"
    cudnn = Cluster("h100", 1, gpus_per_node=1, flash_attention="cudnn")
    assert got.step_time_s == pytest.approx(predict(cfg, cudnn, 1).step_time_s)
    assert got.host_speed is None
    monkeypatch.setattr(plait.devices, "accelerator_name", lambda: "NVIDIA GeForce RTX 4090")
    assert HostPredictor().predict(run) is None  # type: ignore[arg-type]  # no prediction; the run goes on


def test_the_own_run_costs_the_attention_kernel_sdpa_runs_on_that_gpu(monkeypatch):
    """plait's attention is torch's SDPA: cuDNN's kernel on the Hopper GPUs (and the B200), FlashAttention-2 on
    the A100 and the L40S; the predictor's cluster names that kernel."""
    from plait.cli.predict import gpu_cluster
    from plait.plan.attention import sdpa_kernel

    assert {name: sdpa_kernel(gpu) for name, gpu in GPUS.items() if name != "cpu"} == {
        "a100-40gb": "flash2", "a100-80gb": "flash2", "h100-sxm": "cudnn", "h100-pcie": "cudnn", "h200": "cudnn",
        "b200": "cudnn", "l40s": "flash2"}
    for device, kernel in (("NVIDIA H200", "cudnn"), ("NVIDIA A100-SXM4-80GB", "flash2")):
        monkeypatch.setattr(plait.devices, "accelerator_name", lambda d=device: d)
        cluster = gpu_cluster(2)
        assert cluster is not None and cluster.attention == kernel and cluster.flash_attention


def test_calibrate_refuses_a_gpu_host(monkeypatch):
    """Its kernels are sized for CPU cores: on a GPU host it stops before launching anything."""
    import plait.calibrate as calibrate

    monkeypatch.setattr(plait.devices, "accelerator_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(calibrate, "_measure_once", lambda *a: pytest.fail("measured on a GPU host"))
    with pytest.raises(ConfigError, match=r"calibrate: this host has a GPU \(NVIDIA H200\)"):
        calibrate.calibrate((1,))
