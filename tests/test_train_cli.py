"""plait train/generate/export as a user runs them: a short real run, a killed worker, a killed save, SIGTERM and
resume, a torchrun worker that lost its peer (what they refuse before launching: test_train_cli_refusals.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from harness import alive
from plait.cli.main import app
from plait.distributed.launch import worker_pids
from save_util import assert_first_checkpoint_whole, kill_inside_second_save

PLAIT = [sys.executable, "-m", "plait.cli.main"]
FAST = ["--seq-len", "32", "--batch-size", "4", "--microbatches", "2", "--eval-every", "0", "--max-data-mb", "0.3",
        "--trace-every", "2"]


def _run(args, cwd, timeout=240):
    return subprocess.run(PLAIT + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_short_run_metrics_checkpoint_sample_generate_export(tmp_path, monkeypatch):
    tensorboard = ["--tensorboard", "tb"] if importlib.util.find_spec("tensorboard") else []
    res = _run(["train", "--steps", "4", *FAST, "--sample-tokens", "8", "--metrics", "m.jsonl", *tensorboard], tmp_path)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(ln) for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["tokens_seen"] for r in rows] == [128, 256, 384, 512] and 0 < rows[0]["epoch"] < rows[-1]["epoch"] < 1
    assert not tensorboard or list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in rows)
    assert "measured_bubble" in rows[1] and 0 <= rows[1]["predicted_bubble"] < 1
    assert "summary" in res.stdout and "sample" in res.stdout and "step_00000004" in res.stdout
    assert (tmp_path / "plait-checkpoints" / "step_00000004" / "pp1-tp1-dp0.safetensors").is_file()
    gen = _run(["generate", "--prompt", "def ", "--max-new-tokens", "5"], tmp_path)
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr
    exp = _run(["export", "plait-checkpoints", "hf"], tmp_path)
    assert exp.returncode == 0 and (tmp_path / "hf" / "config.json").is_file(), exp.stderr
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)  # the refusal comes before any work: in this process (a real run's exit code above)
    refused = CliRunner().invoke(app, ["export", "plait-checkpoints", "a-file"])
    assert refused.exit_code == 2 and refused.stderr.strip() == "error: OUT a-file: cannot write a folder there " \
        "(File exists: a-file)", refused.output


def _wait_for_rows(metrics: Path, n: int, timeout: float) -> None:
    """Until the run's metrics file has ``n`` rows (steps), at most ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.05)


def test_killed_worker_ends_the_job_promptly(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(PLAIT + ["train", "--steps", "100000", *FAST, "--metrics", str(metrics),
                                     "--checkpoint-every", "1"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_rows(metrics, 2, 120)  # step 2's save began once step 1's was complete
        workers = worker_pids(proc.pid)
        assert len(workers) == 4, f"expected 4 workers, found {workers}"
        victim = sorted(workers)[2]
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        _, err = proc.communicate(timeout=60)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f}s to end"
    assert f"(pid {victim}) died (signal SIGKILL)" in err and "Traceback" not in err, err
    from plait.checkpoint import find_checkpoint

    latest = find_checkpoint(tmp_path / "plait-checkpoints")  # what to do next: continue from it
    assert latest is not None and err.endswith(f"plait train: the latest complete checkpoint is plait-checkpoints/"
                                               f"{latest.name} (step {int(latest.name[5:])}); the same command with "
                                               "--auto-resume continues from it\n"), err
    deadline = time.monotonic() + 1  # every worker gone within a second of the job's end
    while [p for p in workers if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in workers if alive(p)], "orphan workers left behind"


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    kill_inside_second_save("""
        writer.save_checkpoint(pm, None, sys.argv[1], 1)
        with torch.no_grad():
            for p in pm.parameters():
                p.add_(1.0)
        hang_in_writes()
        writer.save_checkpoint(pm, None, sys.argv[1], 2)
    """, tmp_path / "ck", {"writing"})  # inside the second save, after its first write
    assert_first_checkpoint_whole(tmp_path / "ck")


def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path):
    """SIGTERM to plait train (as SLURM or Kubernetes send it): every worker stops after the same step with a
    checkpoint, exit code 0 within a bounded time; --resume then continues to the same losses as one device."""
    from checks_train import reference_losses
    from plait.train import TrainConfig

    steps = 12
    flags = ["--tp", "1", "--pp", "2", "--steps", str(steps), "--seq-len", "32", "--batch-size", "4",
             "--microbatches", "2", "--max-data-mb", "0.3", "--sample-tokens", "0"]
    metrics = tmp_path / "m.jsonl"
    slow = ["--eval-every", "1", "--trace-every", "1"]  # longer steps, same losses: the signal lands mid-run
    proc = subprocess.Popen(PLAIT + ["train", *flags, *slow, "--metrics", str(metrics)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_rows(metrics, 2, 150)
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        out, err = proc.communicate(timeout=120)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert elapsed < 60, f"the run took {elapsed:.0f}s to stop"  # one step, one checkpoint, teardown
    first = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    stopped = first[-1]["step"]
    assert 2 <= stopped < steps, f"stopped at {stopped}: the signal did not arrive mid-run"
    assert f"stopped by SIGTERM after step {stopped}" in " ".join(out.split()), out
    assert (tmp_path / "plait-checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    res = _run(["train", *flags, "--eval-every", "0", "--resume", "--metrics", str(tmp_path / "m2.jsonl")], tmp_path)
    assert res.returncode == 0, res.stderr
    second = [json.loads(ln) for ln in (tmp_path / "m2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first + second] == list(range(1, steps + 1))
    cfg = TrainConfig.from_dict(dict(tp=1, pp=2, steps=steps, seq_len=32, batch_size=4, microbatches=2,
                                     max_data_mb=0.3))
    ref = reference_losses(cfg, steps)
    for r in first + second:
        assert abs(r["loss"] - ref[r["step"] - 1]) <= 1e-5 * ref[r["step"] - 1], (r, ref)


def test_a_torchrun_worker_that_lost_its_peer_says_so_in_one_error_not_a_traceback(monkeypatch):
    """Under torchrun a rank whose peer died ended in a Python traceback of ~60 lines (torchrun prints it, each
    line prefixed [rank0]:) with the message at its foot; it now ends as under plait's own launcher."""
    import plait.cli.train_worker as train_worker
    from plait.errors import CommError

    def lost(payload):
        raise CommError("pipeline rank 0 failed in action 0B1 (#3); it needs the gradient from global rank 1")

    monkeypatch.setattr(train_worker, "train_worker", lost)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("PLAIT_DEBUG", raising=False)
    res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "2"])
    assert res.exit_code == 1, (res.output, res.exception)
    assert res.output == ("error: rank 0: CommError: pipeline rank 0 failed in action 0B1 (#3); it needs the "
                          "gradient from global rank 1\n"), res.output
    monkeypatch.setenv("PLAIT_DEBUG", "1")  # the traceback, for whoever asks
    assert isinstance(CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "2"]).exception, CommError)


# the start of a script that holds a reference cycle (freed only by the garbage collector) with a finalizer, which
# says so if it is collected at the exit
HOLDS_A_CYCLE = """
import os

class Held:
    def __del__(self, write=os.write):
        write(2, b"collected at the exit\\n")

held = Held()
held.me = held
"""

# a rank that loses its peer, holding such a cycle
LOSES_ITS_PEER = HOLDS_A_CYCLE + """
import sys
import typer
from plait.cli.torchrun import lost_peer_in_one_line
from plait.errors import CommError

try:
    with lost_peer_in_one_line():
        raise CommError("gradient from global rank 1 failed (did that rank die?)")
except typer.Exit as exc:
    sys.exit(exc.exit_code)
"""


def test_a_torchrun_worker_that_lost_its_peer_skips_the_collection_at_its_exit():
    """Such a worker spent seconds of a loaded machine after its one-line error in the interpreter's finalization,
    collecting torch's and the run's objects, which torchrun waits for; what it holds is now left to the exit."""
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_DEBUG"} | {"RANK": "2"}
    res = subprocess.run([sys.executable, "-c", LOSES_ITS_PEER], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr == "error: rank 2: CommError: gradient from global rank 1 failed (did that rank die?)\n"


# plait train's launcher, holding such a cycle, told that its job failed
JOB_FAILS = HOLDS_A_CYCLE + """
import plait.distributed.launch as launch
from plait.cli.main import app

def fails(*args, **kwargs):
    raise launch.JobError("rank 3 (pid 4242) died (signal SIGKILL); stopped the other ranks")

launch.launch = fails
app(["train", "--tp", "1", "--pp", "2", "--steps", "2"])
"""


def test_a_failed_job_s_launcher_skips_the_collection_at_its_exit(tmp_path):
    """The launcher of a failed job, its report printed, spent most of a second of a loaded machine in the
    interpreter's finalization before the shell got its status; what it holds is now left to the exit."""
    res = subprocess.run([sys.executable, "-c", JOB_FAILS], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr
    first = "error: rank 3 (pid 4242) died (signal SIGKILL); stopped the other ranks\n"
    assert res.stderr.startswith(first), res.stderr
    assert "collected at the exit" not in res.stderr and res.stderr.endswith("the same command starts again\n"), \
        res.stderr
