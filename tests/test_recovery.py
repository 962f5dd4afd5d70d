"""Recovery without a person: plait train under torchrun --max-restarts with workers killed by SIGKILL (mid-run,
during a restart's start-up, right after a restart's first step) finishes with the losses of an uninterrupted
run, each restart continuing from the latest complete checkpoint (--auto-resume) and --metrics holding each step
once; a kill while a checkpoint is written in the background leaves the previous one in place."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from plait.distributed.launch import child_pids
from save_util import assert_first_checkpoint_whole, kill_inside_second_save

# the first kill lands once step 7 is logged, the third after a restart's first step (one past its checkpoint, step 6
# or so): the last restart still trains to step 16 from there
STEPS, EVERY = 16, 2
FLAGS = ["--tp", "1", "--pp", "2", "--steps", str(STEPS), "--seq-len", "32", "--batch-size", "4", "--microbatches", "2",
         "--max-data-mb", "0.3", "--sample-tokens", "0", "--eval-every", "0", "--trace-every", "0", "--cluster", "none",
         "--checkpoint-every", str(EVERY), "--auto-resume"]


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


def _latest(folder: Path) -> int:
    """The step of the latest complete checkpoint in ``folder`` (0: none yet)."""
    from plait.checkpoint import find_checkpoint

    found = find_checkpoint(folder)
    return int(found.name.removeprefix("step_")) if found is not None else 0


def test_torchrun_restarts_resume_exactly_after_sigkills(tmp_path):
    from checks_train import reference_losses
    from plait.train import TrainConfig

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "plait-checkpoints"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "3", "-m", "plait.cli.main", "train", *FLAGS, "--metrics", str(metrics)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kills = []  # (when, pid, the latest complete checkpoint's step, the last step in --metrics), at each kill
    try:
        # 1: a pipeline rank mid-run; 2: a worker of the restart before it trained (start-up, rendezvous);
        # 3: the other pipeline rank right after the next restart's first step
        gen0 = _wait(proc, lambda: len(child_pids(proc.pid)) == 2 and child_pids(proc.pid), "the first workers")
        _wait(proc, lambda: len(_rows(metrics)) >= 7, "step 7")
        os.kill(gen0[1], signal.SIGKILL)
        kills.append(("mid-run", gen0[1], _latest(ckpt), _rows(metrics)[-1]["step"]))
        gen1 = _wait(proc, lambda: (w := child_pids(proc.pid)) and len(w) == 2 and not set(w) & set(gen0) and w,
                     "the restarted workers")
        time.sleep(1.0)
        os.kill(gen1[0], signal.SIGKILL)
        before = _rows(metrics)
        kills.append(("start-up", gen1[0], _latest(ckpt), before[-1]["step"]))
        gen2 = _wait(proc, lambda: (w := child_pids(proc.pid)) and len(w) == 2 and not set(w) & set(gen1) and w,
                     "the second restart's workers")
        # a row of its own (each has its step's time): the rows past its checkpoint were dropped as it began
        _wait(proc, lambda: any(r not in before for r in _rows(metrics)), "the second restart's first step")
        os.kill(gen2[1], signal.SIGKILL)
        kills.append(("first step", gen2[1], _latest(ckpt), _rows(metrics)[-1]["step"]))
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = _rows(metrics)
    # each step once: a restart drops the rows of the steps it trains again (they were appended twice)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    resumed = [int(s) for s in re.findall(r"resuming from \S+ \(step (\d+)\)", out)]
    assert "starting fresh" in out and len(resumed) >= 2, out[-3000:]
    for (when, _pid, latest, reached), at in zip([kills[0], kills[2]], [resumed[0], resumed[-1]], strict=True):
        assert at % EVERY == 0 and latest <= at <= reached, (
            f"the restart after the kill {when} continued at step {at + 1}, where the latest complete checkpoint "
            f"was of step {latest} and the run had reached step {reached}")
    saving = [r for r in rows if r["step"] % EVERY == 0 and r["step"] < STEPS]
    assert saving and all(r["checkpoint_blocked_s"] >= 0 for r in saving), "a saving step's row lacks its stall"
    cfg = TrainConfig.from_dict(dict(tp=1, pp=2, steps=STEPS, seq_len=32, batch_size=4, microbatches=2,
                                     max_data_mb=0.3))
    ref = reference_losses(cfg, STEPS)
    for r in rows:
        assert abs(r["loss"] - ref[r["step"] - 1]) <= 1e-5 * ref[r["step"] - 1], (r["step"], r["loss"], kills)


def test_kill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    kill_inside_second_save("""
        from plait.checkpoint import AsyncCheckpointer
        saver = AsyncCheckpointer()
        saver.save(pm, None, sys.argv[1], 1)
        saver.wait()
        hang_in_writes()
        saver.save(pm, None, sys.argv[1], 2)  # returns once the state is copied
        with torch.no_grad():
            for p in pm.parameters():
                p.add_(1.0)  # training goes on while step 2 is written
        print("training", flush=True)
        time.sleep(60)
    """, tmp_path / "ck", {"writing", "training"})  # the loop went on while the write was under way
    assert_first_checkpoint_whole(tmp_path / "ck")


def test_a_save_prunes_old_checkpoints_out_of_sight_at_once_and_deletes_them_on_a_thread(tmp_path):
    import threading

    from plait.checkpoint import find_checkpoint
    from plait.checkpoint.writer import META, PRUNED, _commit

    def folder(name: str) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "pp0-tp0-dp0.safetensors").write_bytes(b"\0" * 4096)
        (tmp_path / name / META).write_text("{}")
        return tmp_path / name

    for step in (1, 2):
        folder(f"step_{step:08d}")
    (tmp_path / f"{PRUNED}step_00000000-left").mkdir()  # left by a process killed while it deleted
    _commit(tmp_path, folder(".step_00000003.tmp"), tmp_path / "step_00000003", keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert find_checkpoint(tmp_path) == tmp_path / "step_00000003"
    for t in threading.enumerate():
        if t.name == "plait-checkpoint-prune":
            t.join(30)
    assert not list(tmp_path.glob(PRUNED + "*")), list(tmp_path.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
