"""Launch N local CPU ranks (Gloo) running one function, with a deadline that names silent ranks.

Used by the tests, ``plait verify`` and ``plait demo``. Long-running jobs (``plait train``) use
torch's own elastic launcher instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RankFailure:
    """What a rank reported when its function raised."""

    rank: int
    error_type: str
    message: str
    traceback: str


class LaunchError(RuntimeError):
    """A launched world failed: a rank raised, died, or missed the deadline."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, threads: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(threads)
    try:
        value = fn(*args)
        results.put((rank, True, value))
    except BaseException as exc:  # report every failure to the parent, including KeyboardInterrupt
        results.put((rank, False, RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, nprocs: int, *args: Any, timeout_s: float = 300.0, threads: int = 1,
              return_failures: bool = False, allow_dead: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` fresh processes forming one torch.distributed world.

    Returns the per-rank return values (index = rank). If a rank raises, the world is torn down and a
    LaunchError carries that rank's traceback (or, with ``return_failures``, the RankFailure is returned
    in its slot). If ranks are silent past ``timeout_s``, all are killed and the error names them.
    ``allow_dead`` puts None in the slot of a rank that exits without reporting instead of raising.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, results, threads), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        values = _collect(procs, results, nprocs, timeout_s, return_failures, allow_dead)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return values


def _collect(procs: list, results: Any, nprocs: int, timeout_s: float, return_failures: bool,
             allow_dead: bool) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < nprocs:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            silent = sorted(set(range(nprocs)) - set(values))
            raise LaunchError(f"timeout after {timeout_s:.0f}s: ranks {silent} did not answer "
                              f"(ranks {sorted(values)} finished)")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive()
                    and p.exitcode not in (0, None)]
            if dead:
                time.sleep(0.5)  # let a final report that was in flight arrive
                _drain(results, values)
                dead = [r for r in dead if r not in values]
                if dead and allow_dead:
                    values.update({r: None for r in dead})
                elif dead:
                    raise LaunchError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]}) "
                                      "without reporting") from None
            continue
        if not ok and not return_failures:
            raise LaunchError(f"rank {rank} raised {value.error_type}: {value.message}\n{value.traceback}")
        values[rank] = value
    return [values[r] for r in range(nprocs)]


def _drain(results: Any, values: dict[int, Any]) -> None:
    while True:
        try:
            rank, _ok, value = results.get_nowait()
        except queue.Empty:
            return
        values[rank] = value
