"""Ctrl-C to plait train: a checkpoint at the next step and exit code 0, as for SIGTERM; a second one stops the
workers at once."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from plait.distributed.job_signals import ForwardSignal, ResumeStopped

PLAIT = [sys.executable, "-m", "plait.cli.main"]


def test_ctrl_c_saves_a_checkpoint_and_exits_0(tmp_path):
    (tmp_path / "text.txt").write_text("some training text for an interrupted run. " * 200)
    metrics = tmp_path / "m.jsonl"
    flags = ["--tp", "1", "--pp", "2", "--steps", "1000", "--seq-len", "32", "--batch-size", "4", "--microbatches",
             "2", "--sample-tokens", "0", "--eval-every", "0", "--cluster", "none", "--data", "text.txt"]
    proc = subprocess.Popen(PLAIT + ["train", *flags, "--metrics", str(metrics)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 150
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends Ctrl-C: to every process of the job
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err  # was torch elastic's SignalException, exit 1
    stopped = len(metrics.read_text().splitlines())
    assert f"stopped by SIGINT after step {stopped}: checkpoint" in " ".join(out.split()), out
    assert (tmp_path / "plait-checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"


@pytest.mark.parametrize("when", ["workers forked", "fork server importing"])
def test_ctrl_c_while_the_workers_start_is_one_line(tmp_path, when):
    """Ctrl-C while the workers start: they take it at their entry point, without a traceback each; one that
    came once the launch began while the fork server still imported (no worker to pass it to yet) too, not lost.
    (The launch makes its job folder in TMPDIR as it begins; the server may have started before, beside plait
    train's checks of the run.)"""
    from plait.distributed.launch import child_pids, worker_pids

    def started(pid: int) -> bool:
        if when == "workers forked":
            return len(worker_pids(pid)) >= 2
        return any(tmp.glob("plait-job-*")) and bool(child_pids(pid, b"forkserver")) and not worker_pids(pid)

    (tmp_path / "text.txt").write_text("some training text for an interrupted run. " * 200)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    flags = ["--tp", "1", "--pp", "2", "--steps", "5", "--seq-len", "32", "--batch-size", "4", "--microbatches", "2",
             "--sample-tokens", "0", "--eval-every", "0", "--cluster", "none", "--data", "text.txt"]
    proc = subprocess.Popen(PLAIT + ["train", *flags], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.time() + 150
        while time.time() < deadline and not started(proc.pid):
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # was each worker's KeyboardInterrupt out of an import, then "error: rank 0 (pid ...) died (signal SIGINT)"
    assert err == "plait train: stopped (SIGINT) before the first step: nothing trained, no checkpoint\n", err
    assert proc.returncode == 130 and not (tmp_path / "plait-checkpoints").exists(), out


def _wait_out_one_signal(ready) -> None:
    """A worker that takes the first SIGINT as a request (its handler sets a flag) and goes on."""
    signal.signal(signal.SIGINT, lambda *_: None)
    ready.set()
    time.sleep(60)


def test_a_second_ctrl_c_stops_the_workers_at_once():
    """plait train's launcher (again_kills): the second SIGINT kills the workers; plait serve's forwards it (its
    workers end the requests still running on a second Ctrl-C)."""
    for again_kills in (True, False):
        ready = mp.get_context("spawn").Event()
        child = mp.get_context("spawn").Process(target=_wait_out_one_signal, args=(ready,), daemon=True)
        child.start()
        try:
            assert ready.wait(60)
            with ForwardSignal(signal.SIGINT, again_kills=again_kills) as forward:
                os.kill(os.getpid(), signal.SIGINT)  # forwarded: the worker goes on towards its step's end
                child.join(0.5)
                assert child.is_alive()
                os.kill(os.getpid(), signal.SIGINT)
                child.join(5 if again_kills else 0.5)
            assert child.is_alive() != again_kills, again_kills
            assert forward.received == signal.SIGINT and forward.killed == again_kills
            assert not again_kills or child.exitcode == -signal.SIGKILL
        finally:
            if child.is_alive():
                child.kill()



def test_ctrl_c_to_generate_is_one_line(tmp_path, monkeypatch):
    """Ctrl-C while plait generate decodes in this process (KeyboardInterrupt), or to the launcher of its workers
    (torch elastic's SignalException): one line and exit code 130, not a traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from typer.testing import CliRunner

    import plait.distributed.launch as launch
    from plait.cli.main import app
    from serve_util import tiny_model

    model = str(tiny_model(tmp_path / "m"))
    for raised in (KeyboardInterrupt(), SignalException("got signal: 2", sigval=signal.SIGINT)):
        def interrupted(*args, raised=raised, **kwargs):
            raise raised

        monkeypatch.setattr(launch, "run_or_launch", interrupted)
        res = CliRunner().invoke(app, ["generate", "--model", model, "--prompt", "hi", "--pp", "2"])
        assert res.exit_code == 130 and res.output == "plait generate: stopped (SIGINT)\n", res.output


def test_the_watch_for_stopped_workers_has_ended_when_its_job_folder_goes(tmp_path):
    """The launcher removes the job's folder right after leaving ResumeStopped: its watch, which reads that folder,
    has ended by then (else, in the middle of a look, it raised FileNotFoundError into the job's output)."""
    (tmp_path / "rank1").write_text("failed")
    asked, release = threading.Event(), threading.Event()

    def workers() -> list[int]:  # the watch is in here when the job ends
        asked.set()
        release.wait(0.5)
        return []

    with ResumeStopped(tmp_path, workers, after_s=0.0) as watch:
        assert asked.wait(10)
    assert not watch.thread.is_alive()
