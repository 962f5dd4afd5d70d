"""plait train on two "nodes" as the README runs it on several hosts: two torchrun invocations on this host
(--nnodes 2, --node-rank 0 and 1, one --master-addr) form one job that trains exactly as one device would; with no
host profile for several hosts it says why nothing is predicted instead of blaming --cluster none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from plait.distributed.launch import free_port
from plait.train import TrainConfig

pytestmark = pytest.mark.timeout(420)
STEPS = 4
FLAGS = ["--tp", "1", "--pp", "2", "--steps", str(STEPS), "--seq-len", "32", "--batch-size", "4", "--microbatches", "2",
         "--max-data-mb", "0.3", "--sample-tokens", "0", "--eval-every", "0", "--trace-every", "0"]
SEVERAL = "no prediction: the run spans several hosts (2 processes, 1 here) and a host profile describes one"


def test_two_torchrun_nodes_train_as_one_device(tmp_path):
    from checks_train import reference_losses

    port, metrics = free_port(), tmp_path / "m.jsonl"
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}  # a summary row on one line
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "plait.cli.main", "train", *FLAGS, "--metrics", str(metrics)],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for n in (0, 1)]
    try:
        outs = [node.communicate(timeout=360) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    out = outs[0][0]
    assert f"note: {SEVERAL}" in out and f" ms ({SEVERAL})" in out, out
    assert "--cluster none" not in out, out
    assert "plait train: summary" not in outs[1][0], "the other node printed the summary too"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    cfg = TrainConfig.from_dict(dict(tp=1, pp=2, steps=STEPS, seq_len=32, batch_size=4, microbatches=2,
                                     max_data_mb=0.3))
    ref = reference_losses(cfg, STEPS)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    for r in rows:
        assert abs(r["loss"] - ref[r["step"] - 1]) <= 1e-5 * ref[r["step"] - 1], (r["step"], r["loss"])


def test_the_predictor_says_why_a_run_over_several_hosts_gets_no_prediction(monkeypatch):
    from plait.cli.predict import HostPredictor

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = TrainConfig.from_dict({"model": "tiny", "tp": 1, "pp": 1, "dp": 1, "seq_len": 32, "batch_size": 4})
    run = SimpleNamespace(cfg=cfg, ctx=SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0))
    assert HostPredictor().predict(run) is None  # type: ignore[arg-type]
    assert run.unpredicted.startswith("the run spans several hosts (8 processes, 4 here)"), run.unpredicted
    run.cfg = TrainConfig.from_dict({**cfg.to_dict(), "cluster": "none"})
    assert HostPredictor().predict(run) is None and run.unpredicted == "--cluster none"  # type: ignore[arg-type]
