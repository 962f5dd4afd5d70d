"""Run a job on local worker processes with PyTorch's elastic launcher, or as one worker under torchrun.

The elastic agent (``max_restarts=0``) watches the workers: when one dies it stops the others and the
launch fails; we then name the rank that failed first, with its own one-line message (each worker writes
its exception to a small file instead of printing a traceback; ``PLAIT_DEBUG=1`` prints them).

SIGTERM (a preempted SLURM job or Kubernetes pod) is not the agent's to handle here: the launcher forwards it
to every worker and keeps watching them, so workers that stop cleanly on it (``plait train`` saves a
checkpoint at the next step boundary) end the launch normally, exit code 0. Workers still alive
``STOP_TIMEOUT_S`` after the signal are killed (the launch then fails, naming them).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

EXIT_CODES = {"ConfigError": 2, "NonFiniteLoss": 3}
STOP_TIMEOUT_S = 120.0  # after a SIGTERM, time the workers get to reach a step boundary, save and exit
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # the elastic agent's own handling: stop the workers at once


@dataclass
class JobError(Exception):
    """A launched job failed; ``message`` is one line naming the rank."""

    message: str
    exit_code: int = 1

    def __str__(self) -> str:
        return self.message


def under_torchrun() -> bool:
    """True when this process is already a worker of torchrun (or another torch elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_or_launch(target: str, payload: dict, nproc: int):
    """Run ``module:function(payload)`` here when this process is already a worker or one process is
    enough; otherwise launch ``nproc`` local workers (``launch``)."""
    if under_torchrun() or nproc == 1:
        import importlib

        module, _, function = target.partition(":")
        return getattr(importlib.import_module(module), function)(payload)
    return launch(target, payload, nproc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(target: str, payload: dict, failure_dir: str):
    """Entry point of one worker: ``module:function(payload)``; failures go to ``failure_dir/rank{r}``."""
    import torch

    from plait.train.loop import worker_threads

    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)(payload)
    except BaseException as exc:
        Path(failure_dir, f"rank{rank}").write_text(f"{type(exc).__name__}\n{exc}".strip())
        Path(failure_dir, f"rank{rank}.traceback").write_text(traceback.format_exc())
        if os.environ.get("PLAIT_DEBUG"):
            raise
        sys.exit(EXIT_CODES.get(type(exc).__name__, 1))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def launch(target: str, payload: dict, nproc: int) -> list:
    """Run ``target(payload)`` on ``nproc`` local processes (elastic launcher); per-rank results."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # our own one-line report replaces its tables
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS  # SIGTERM is forwarded by us (below)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"plait-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    if hasattr(config, "signals_to_handle"):
        config.signals_to_handle = AGENT_SIGNALS
    with tempfile.TemporaryDirectory(prefix="plait-job-") as failures, _ForwardSignal(signal.SIGTERM):
        try:
            results = elastic_launch(config, worker)(target, payload, failures)
        except ChildFailedError as exc:
            raise JobError(*_explain(exc, Path(failures))) from None
    return [results[r] for r in sorted(results)]


class _ForwardSignal:
    """While active (main thread only), ``sig`` to this process goes to its worker processes instead; those
    still alive ``STOP_TIMEOUT_S`` later are killed."""

    def __init__(self, sig: int):
        self.sig, self.previous, self.timer = sig, None, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(self.sig, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(self.sig, self.previous)
        if self.timer is not None:
            self.timer.cancel()

    def _forward(self, signum, frame) -> None:
        for child in multiprocessing.active_children():
            os.kill(child.pid, signum)
        if self.timer is None:
            self.timer = threading.Timer(STOP_TIMEOUT_S, _kill_children)
            self.timer.daemon = True
            self.timer.start()


def _kill_children() -> None:
    for child in multiprocessing.active_children():
        child.kill()


def _explain(exc, failures: Path) -> tuple[str, int]:
    """One line naming the rank that failed first, and the exit code to use."""
    reports = {}
    for rank, failure in exc.failures.items():  # keyed by global rank
        f = failures / f"rank{rank}"
        if f.is_file():
            kind, _, msg = f.read_text().partition("\n")
            reports[rank] = (kind, msg or kind, failure)
        else:
            reports[rank] = (None, None, failure)
    died = [r for r, (kind, _, _) in reports.items() if kind is None]
    if died:  # a process that vanished without a report is the root cause (others then lost their peer)
        r = min(died, key=lambda k: reports[k][2].timestamp)
        fail = reports[r][2]
        how = f"signal {fail.signal_name()}" if fail.exitcode < 0 else f"exit code {fail.exitcode}"
        others = sorted(set(reports) - {r})
        tail = f"; stopped the other ranks {others}" if others else "; stopped the other ranks"
        return f"rank {r} (pid {fail.pid}) died ({how}){tail}", 1
    real = [r for r, (kind, _, _) in reports.items() if kind not in ("CommError", "CommTimeoutError")]
    r = min(real or reports, key=lambda k: (reports[k][2].timestamp, k))
    kind, msg, _ = reports[r]
    prefix = "" if kind in ("ConfigError", "NonFiniteLoss") else f"{kind}: "
    return f"rank {r}: {prefix}{msg}", EXIT_CODES.get(kind, 1)
