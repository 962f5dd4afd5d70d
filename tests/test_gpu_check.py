"""``bench/gpu_check.py`` end to end on the CPU (``--device cpu --quick``): every section runs and fills its keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_every_section_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    # a caller's own world variables must not leak into the check's child commands either
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MASTER_PORT="1", RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    failed = {name: v["error"] for name, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    assert results["tests"]["failed"] == 0 and results["tests"]["passed"] > 0
    assert results["device"]["cuda"] is None and results["mfu"] is None  # no dense peak for a CPU
    for key in ("train_tokens_per_s", "hf_train_tokens_per_s", "predicted_step_s", "measured_step_s",
                "serve_tokens_per_s"):
        assert isinstance(results[key], float | int) and results[key] > 0, (key, results[key])
    assert set(results["generate_tokens_per_s"]) == {"1", "32"}
    assert all(v > 0 for v in results["generate_tokens_per_s"].values())
    assert all(results["generate"][f"hf_generate_tokens_per_s_batch{b}"] > 0 for b in (1, 32))  # the peer ran
    assert results["predict"]["predicted_on"].endswith("(plait plan, host profile)")  # a CPU: its calibration
    table = (out / "gpu_check.md").read_text()
    assert "| predict | predicted_step_s |" in table and "| serve | serve_tokens_per_s |" in table
