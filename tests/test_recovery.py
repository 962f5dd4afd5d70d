"""Recovery without a person: plait train under torchrun --max-restarts with workers killed by SIGKILL (mid-run,
during a restart's start-up, right after a restart's first step) finishes with the losses of an uninterrupted
run, each restart continuing from the latest complete checkpoint (--auto-resume); a kill while a checkpoint is
written in the background leaves the previous one in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

STEPS, EVERY = 30, 2
FLAGS = ["--tp", "1", "--pp", "2", "--steps", str(STEPS), "--seq-len", "32", "--batch-size", "4", "--microbatches", "2",
         "--max-data-mb", "0.3", "--sample-tokens", "0", "--eval-every", "0", "--trace-every", "0", "--cluster", "none",
         "--checkpoint-every", str(EVERY), "--auto-resume"]


def _workers(pid: int) -> list[int]:
    """The live child processes of ``pid`` (torchrun's workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return sorted(out)


def _rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.endswith("}")]


def _wait(proc: subprocess.Popen, until, what: str, timeout: float = 120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = until()
        if got:
            return got
        assert proc.poll() is None, f"torchrun ended (exit {proc.returncode}) while waiting for {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_torchrun_restarts_resume_exactly_after_sigkills(tmp_path):
    from checks_train import reference_losses
    from plait.train import TrainConfig

    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "3", "-m", "plait.cli.main", "train", *FLAGS, "--metrics", str(metrics)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kills = []
    try:
        # 1: a pipeline rank mid-run; 2: a worker of the restart before it trained (start-up, rendezvous);
        # 3: the other pipeline rank right after the next restart's first step
        gen0 = _wait(proc, lambda: len(_workers(proc.pid)) == 2 and _workers(proc.pid), "the first workers")
        _wait(proc, lambda: len(_rows(metrics)) >= 7, "step 7")
        kills.append(("mid-run", gen0[1]))
        os.kill(gen0[1], signal.SIGKILL)
        gen1 = _wait(proc, lambda: (w := _workers(proc.pid)) and len(w) == 2 and not set(w) & set(gen0) and w,
                     "the restarted workers")
        time.sleep(1.0)
        kills.append(("start-up", gen1[0]))
        os.kill(gen1[0], signal.SIGKILL)
        n = len(_rows(metrics))
        gen2 = _wait(proc, lambda: (w := _workers(proc.pid)) and len(w) == 2 and not set(w) & set(gen1) and w,
                     "the second restart's workers")
        _wait(proc, lambda: len(_rows(metrics)) > n, "the second restart's first step")
        kills.append(("first step", gen2[1]))
        os.kill(gen2[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = _rows(metrics)
    starts = [i for i, r in enumerate(rows) if i == 0 or r["step"] != rows[i - 1]["step"] + 1]
    runs = [rows[a:b] for a, b in zip(starts, starts[1:] + [len(rows)], strict=True)]
    assert runs[0][0]["step"] == 1 and runs[-1][-1]["step"] == STEPS, [(r[0]["step"], r[-1]["step"]) for r in runs]
    for before, after in zip(runs, runs[1:], strict=False):
        resumed = after[0]["step"] - 1
        assert resumed % EVERY == 0 and before[-1]["step"] - 2 * EVERY <= resumed <= before[-1]["step"], (
            f"a restart continued at step {resumed + 1} after a run that reached step {before[-1]['step']}: "
            f"more than the steps since the last complete checkpoint were replayed")
    saving = [r for r in rows if r["step"] % EVERY == 0 and r["step"] < STEPS]
    assert saving and all(r["checkpoint_blocked_s"] >= 0 for r in saving), "a saving step's row lacks its stall"
    assert "starting fresh" in out and out.count("resuming from") >= 2, out[-3000:]
    cfg = TrainConfig.from_dict(dict(tp=1, pp=2, steps=STEPS, seq_len=32, batch_size=4, microbatches=2,
                                     max_data_mb=0.3))
    ref = reference_losses(cfg, STEPS)
    for r in rows:
        assert abs(r["loss"] - ref[r["step"] - 1]) <= 1e-5 * ref[r["step"] - 1], (r["step"], r["loss"], kills)


BACKGROUND_WRITE_KILLED = textwrap.dedent("""
    import sys, time, torch
    import plait
    from plait.checkpoint import AsyncCheckpointer, writer
    from plait.models import Llama, LlamaConfig
    ctx = plait.init(1, 1, 1)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4)), ctx)
    saver = AsyncCheckpointer()
    saver.save(pm, None, sys.argv[1], 1)
    saver.wait()
    real = writer._fsync_path
    def slow(path):
        real(path)
        print("writing", flush=True)
        time.sleep(60)
    writer._fsync_path = slow
    saver.save(pm, None, sys.argv[1], 2)  # returns once the state is copied
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)  # training goes on while step 2 is written
    print("training", flush=True)
    time.sleep(60)
""")


def test_kill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    import torch

    from plait.checkpoint import CheckpointReader, find_checkpoint
    from plait.models import Llama, LlamaConfig

    proc = subprocess.Popen([sys.executable, "-c", BACKGROUND_WRITE_KILLED, str(tmp_path / "ck")],
                            stdout=subprocess.PIPE, text=True)
    try:
        said = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert said == {"writing", "training"}, said  # the loop went on while the write was under way
        assert (tmp_path / "ck" / ".step_00000002.tmp").is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    found = find_checkpoint(tmp_path / "ck")
    assert found is not None and found.name == "step_00000001"
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_00000001"
    state = CheckpointReader(found).full_state_dict()
    torch.manual_seed(0)
    ref = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4)).state_dict()
    assert set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
