"""``plait generate --pp 2`` from the command line with one worker stopped (SIGSTOP) in the middle of decoding:
the command ends soon after its timeout (PLAIT_TIMEOUT), naming the rank that waited, what it waited for and the
rank it waited on; it does not hang, and the stopped worker neither holds the job's end nor outlives it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import alive
from plait.distributed.launch import worker_pids
from plait.models import Llama, LlamaConfig

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 5  # PLAIT_TIMEOUT of the command: how long a rank waits for a peer
DECODING_CPU_S = 3.0  # CPU seconds of the worker when it is stopped: start-up is done by then, decoding is not


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _model(path: Path) -> Path:
    """A byte-level Llama folder with room for thousands of new tokens (decoding outlasts the test's stop)."""
    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=4096)).save_pretrained(path)
    return path


def test_a_stopped_worker_ends_generate_naming_it_soon_after_the_timeout(tmp_path):
    args = [sys.executable, "-m", "plait.cli.main", "generate", "--model", str(_model(tmp_path / "m")), "--pp", "2",
            "--prompt", "a", "--prompt", "b", "--max-new-tokens", "4000"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PLAIT_TIMEOUT": str(TIMEOUT_S), "OMP_NUM_THREADS": "1"})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(pids) < 2 and proc.poll() is None and time.monotonic() < deadline:
            pids = worker_pids(proc.pid)  # the launcher's workers, ranks in order of their pids
            time.sleep(0.05)
        assert len(pids) == 2, (pids, proc.poll())
        while proc.poll() is None and _cpu_s(pids[1]) < DECODING_CPU_S and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "generate ended before its worker could be stopped"
        os.kill(pids[1], signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        stopped = time.monotonic()
        _out, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    # which prompt's tokens rank 0 waits for depends on where in the wavefront the stop falls: either of the two
    assert re.search(r"error: rank 0: CommTimeoutError: generate: pipeline rank 0 waited more than 5s for the tokens "
                     r"of prompt [01] at new position \d+ from global rank 1: ", err), err
    # and the one it waited on, which the launcher found stopped
    assert err.endswith(f" (pid {pids[1]}) was stopped (SIGSTOP or Ctrl-Z) when the job failed\n"), err
    assert re.search(rf"; rank 1 \(pid {pids[1]}\) was stopped", err), err
    # the timeout, the failed rank's pause before it exits (2 s), then the stopped worker continued to take the
    # launcher's SIGTERM: not torch elastic's 30 s shutdown timeout for a worker that cannot take it
    assert took < TIMEOUT_S + 2 + 15, took
    assert not alive(pids[1]), "the stopped worker outlived its job"


def test_a_torchrun_rank_of_generate_that_lost_its_peer_says_so_in_one_error_not_a_traceback(tmp_path, monkeypatch):
    """Under torchrun (each worker runs the command) a rank whose pipeline peer died ended in a traceback of ~80
    lines, each prefixed [rank0]:, with the message at its foot; it now ends as plait train's rank does."""
    from typer.testing import CliRunner

    import plait.distributed.launch as launch
    from plait.cli.main import app
    from plait.errors import CommError

    def lost(target, payload, nproc):
        raise CommError("generate: pipeline rank 0: the tokens of prompt 0 at new position 4 from global rank 1 "
                        "failed (did that rank die?): Connection reset by peer")

    model = tmp_path / "m"
    Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=256)).save_pretrained(model)
    monkeypatch.setattr(launch, "run_or_launch", lost)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("PLAIT_DEBUG", raising=False)
    res = CliRunner().invoke(app, ["generate", "--model", str(model), "--pp", "2", "--prompt", "a"])
    assert res.exit_code == 1, (res.output, res.exception)
    assert res.output == ("error: rank 0: CommError: generate: pipeline rank 0: the tokens of prompt 0 at new "
                          "position 4 from global rank 1 failed (did that rank die?): Connection reset by peer\n")
    monkeypatch.setenv("PLAIT_DEBUG", "1")  # the traceback, for whoever asks
    res = CliRunner().invoke(app, ["generate", "--model", str(model), "--pp", "2", "--prompt", "a"])
    assert isinstance(res.exception, CommError), res.output
