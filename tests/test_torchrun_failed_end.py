"""Under torchrun (no plait launcher), the agent ends a job whose worker died with SIGTERM to the workers left and
SIGKILL 30 s later; a plait train or serve worker catches SIGTERM (a checkpoint, a drain), and one blocked in a
collective with a live peer runs no handler: it ends ``FAILED_END_S`` after that SIGTERM, naming the dead rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from plait.distributed.job_signals import FAILED_END_S

pytestmark = pytest.mark.timeout(300)

# three workers with plait train's stop signals; once all are connected each notes whether it would take a SIGTERM
# as the end of a failed job (none has ended: no), rank 2 notes the time and dies by SIGKILL, and ranks 0 and 1 each
# wait in a receive from the other, a wait that no peer's death ends
WAITS_ON_A_LIVE_PEER = """
import os, signal, sys, time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plait.distributed.job_signals import ended_ranks, ending_after_a_failure
from plait.train.preempt import StopRequest

rank = int(os.environ["RANK"])
StopRequest().install()
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
dist.barrier()
Path(sys.argv[1], f"healthy{rank}").write_text(repr((ending_after_a_failure(), ended_ranks())))
dist.barrier()
if rank == 2:
    Path(sys.argv[1], "died").write_text(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)
dist.recv(torch.zeros(1), src=1 - rank)
"""


def test_torchrun_s_end_of_a_failed_job_ends_workers_waiting_on_live_peers_naming_the_dead_rank(tmp_path):
    (tmp_path / "waits.py").write_text(WAITS_ON_A_LIVE_PEER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PLAIT_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "waits.py", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=240)
    took = time.monotonic() - float((tmp_path / "died").read_text())
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert [(tmp_path / f"healthy{r}").read_text() for r in range(3)] == ["(False, [])"] * 3
    for r in (0, 1):
        line = (f"error: rank {r}: rank 2 of this host ended, and torchrun ends the job: this rank ends "
                f"{FAILED_END_S:g} s after its SIGTERM")
        assert proc.stderr.count(line) == 1, proc.stderr[-4000:]
    root = proc.stderr.partition("Root Cause")[2]
    assert re.search(r"rank\s*: 2 \(local_rank: 2\)\n\s*exitcode\s*: -9", root), proc.stderr[-4000:]
    # torchrun's SIGTERM comes within a second of the death, the ranks end FAILED_END_S later: not its 30 s SIGKILL
    assert took < FAILED_END_S + 12, f"the job ended {took:.1f} s after the death"
