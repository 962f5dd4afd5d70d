"""A torchrun script that catches plait's ConfigError and ends normally, without ctx.close() or
destroy_process_group, exits 0 on every rank: the default group plait.init made is destroyed at the program's exit,
before the interpreter's finalization (left to it, a Gloo group sometimes aborted the process with "terminate
called without an active exception")."""

import ctypes
import hashlib
import subprocess
import sys
import threading
import time

import pytest

from plait.distributed import at_exit

SCRIPT = """
import atexit, os
import torch.distributed as dist
def say(line):
    with open(f"rank{os.environ['RANK']}.txt", "a") as f:
        f.write(line + "\\n")
atexit.register(lambda: say(f"default group alive at exit: {dist.is_initialized()}"))  # registered first: runs last
import torch, plait
from plait.models import Llama, LlamaConfig
ctx = plait.init(tp=2, timeout_s=60)
torch.manual_seed(0)
pm = plait.parallelize(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32)), ctx)
rows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(ctx.rank))  # each rank its own rows
try:
    pm.train_step(rows[:, :-1], rows[:, 1:])
except plait.ConfigError as exc:
    say(f"caught: {str(exc).split(' (')[0]}")
"""


def test_a_script_that_catches_a_config_error_and_returns_exits_cleanly(tmp_path):
    script = tmp_path / "caught.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "terminate called" not in said, said[-3000:]
    for rank in (0, 1):  # the abort comes only now and then: that the group is gone at exit is what holds always
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines == ["caught: the ranks of data-parallel replica 0 were handed different batches",
                         "default group alive at exit: False"], (rank, lines, said[-3000:])


def _named_spinner(name: bytes, spin_s: float, stop: threading.Event) -> threading.Thread:
    """A thread that names itself ``name`` (as the OS sees it), works without the GIL (hashing, as a C++ worker
    would) for ``spin_s`` or until ``stop``, then sleeps until ``stop``."""
    def run() -> None:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
        block, end = bytes(1 << 20), time.monotonic() + spin_s
        while time.monotonic() < end and not stop.is_set():
            hashlib.sha256(block).digest()  # releases the GIL over blocks this large
        stop.wait()
    return threading.Thread(target=run, daemon=True)


@pytest.mark.skipif(not at_exit.TASKS.is_dir(), reason="reads the threads' states from /proc (Linux)")
def test_the_exit_waits_while_a_gloo_worker_runs_and_no_longer():
    stop, other_stop = threading.Event(), threading.Event()
    worker = _named_spinner(at_exit.GLOO_WORKER.encode(), 0.4, stop)
    started = time.monotonic()
    worker.start()
    try:
        assert at_exit.settle_gloo_workers(limit_s=5.0)
        waited = time.monotonic() - started
        assert waited >= 0.4, waited  # it waited while the worker ran
        assert waited < 4.0, waited  # and ended once it slept
        again = _named_spinner(at_exit.GLOO_WORKER.encode(), 5.0, stop)  # a worker busy past the limit
        again.start()
        started = time.monotonic()
        assert not at_exit.settle_gloo_workers(limit_s=0.3)
        assert time.monotonic() - started < 2.0
        stop.set()
        time.sleep(0.1)
        other = _named_spinner(b"not_gloo", 5.0, other_stop)  # other threads are not waited for
        other.start()
        started = time.monotonic()
        assert at_exit.settle_gloo_workers(limit_s=3.0)
        assert time.monotonic() - started < 2.0
    finally:
        stop.set()
        other_stop.set()


@pytest.mark.skipif(not at_exit.TASKS.is_dir(), reason="reads the threads' names from /proc (Linux)")
def test_torch_names_its_gloo_workers_as_the_exit_expects():
    """The wait looks for threads by the name torch gives them: a Gloo group that has run a collective has one."""
    import torch
    import torch.distributed as dist

    def names() -> list[str]:
        return [(task / "comm").read_text().strip() for task in at_exit.TASKS.iterdir()]

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    group.allreduce([torch.ones(2)]).wait()
    assert at_exit.GLOO_WORKER in names(), names()
