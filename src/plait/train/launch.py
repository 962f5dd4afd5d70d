"""Run a job on local worker processes with PyTorch's elastic launcher, or as one worker under torchrun.

The elastic agent (``max_restarts=0``) watches the workers: when one dies it stops the others and the
launch fails; we then name the rank that failed first, with its own one-line message (each worker writes
its exception to a small file instead of printing a traceback; ``PLAIT_DEBUG=1`` prints them).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import tempfile
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

EXIT_CODES = {"ConfigError": 2, "NonFiniteLoss": 3}


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
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"plait-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    with tempfile.TemporaryDirectory(prefix="plait-job-") as failures:
        try:
            results = elastic_launch(config, worker)(target, payload, failures)
        except ChildFailedError as exc:
            raise JobError(*_explain(exc, Path(failures))) from None
    return [results[r] for r in sorted(results)]


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
