"""Local launchers, both here: ``run_world`` (a function on N fresh Gloo processes, returning every rank's
value, with a deadline that names silent ranks: tests, ``plait verify``, benchmarks) and ``launch`` /
``run_or_launch`` (``module:function(payload)`` jobs on PyTorch's elastic launcher, or as one worker under
torchrun: ``plait train``, ``plait generate``, ``plait serve``).

The elastic agent (``max_restarts=0``) watches a job's workers: when one dies it stops the others and the
launch fails; we then name the rank that failed first, with its own one-line message (each worker writes
its exception to a small file instead of printing a traceback; ``PLAIT_DEBUG=1`` prints them).

The workers of a job are forked from ``multiprocessing``'s fork server (where the platform has one), which
imports torch and the job's modules once, instead of each being a fresh interpreter that imports them itself
(about 4 s of CPU a process: torch, and torch._dynamo, which every torch optimizer imports when it is made);
``plait.distributed.fork_server`` can start that server ahead of the launch.

SIGTERM (a preempted SLURM job or Kubernetes pod) is not the agent's to handle in ``launch``: the launcher
forwards it to every worker and keeps watching them, so workers that stop cleanly on it (``plait train``
saves a checkpoint at the next step boundary) end the launch normally, exit code 0. Workers still alive
``STOP_TIMEOUT_S`` after the signal are killed (the launch then fails, naming them).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from plait.distributed import fork_server
from plait.distributed.job_signals import (
    JOB_DIR_ENV,
    ForwardSignal,
    HeldInterrupts,
    ResumeStopped,
    await_job_end,
    child_pids,
    note_pid,
    taken_signals,
)
from plait.distributed.parent import end_with_parent

EXIT_CODES = {"ConfigError": 2, "NonFiniteLoss": 3}
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # the elastic agent's own handling: stop the workers at once
LOST_PEER = ("CommError", "CommTimeoutError")  # errors of a rank whose peer died or went silent
FAILED_WAIT_S = 2.0  # at most how long a worker that raised waits before it exits: a peer killed first is seen first
#: the environment at this module's import: in a worker, what it inherited (the fork server's) before the agent's
_INHERITED_ENV = dict(os.environ)
# glibc's mallopt(3) parameters (malloc.h) and the values plait's processes set (``keep_freed_memory``)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MALLOC_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
              "GLIBC_TUNABLES")
#: run_world's launches of a world, and what a rank says when its rendezvous port was taken (then it is launched again)
PORT_TRIES, PORT_TAKEN = 3, ("EADDRINUSE", "address already in use")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_pids(launcher: int) -> list[int]:
    """The live worker processes of the jobs that process ``launcher`` started with ``launch``, sorted: the
    children of its fork server, or the processes it spawned."""
    servers = child_pids(launcher, b"multiprocessing.forkserver")
    return sorted([p for s in servers for p in child_pids(s)] + child_pids(launcher, b"spawn_main"))


def worker_threads(local_world: int) -> int:
    """Intra-op threads per process: the cores shared fairly among the local processes."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a step frees for the next step, as PyTorch's caching allocator does
    on GPUs; True if it now does.

    By default glibc hands a freed block of more than its (adaptive) threshold back to the kernel: blocks
    above it come from fresh ``mmap`` pages, and free space at the heap's top beyond twice it is trimmed. The
    next step allocates the same sizes again and pays a page fault per 4 KiB on first touch, most where a
    schedule keeps many micro-batches' tensors alive: in a two-stage ZB-V step of ``small`` the input-gradient
    passes took 8% longer than with the memory kept, 1F1B's backward the same either way. Here tensors up to
    32 MiB (glibc's largest threshold) come from the heap, and up to 1 GiB free at its top stays mapped, so a
    process's resident memory stays at its peak (larger tensors still come from fresh pages).

    Does nothing (False) where malloc is not glibc's, or where the environment sets glibc's malloc parameters
    itself (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``: the user's choice wins)."""
    if any(name in os.environ for name in MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # not a glibc (or not a Unix) process
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # in order, stopping at the first refused: a trim threshold without the raised mmap threshold freezes
    # glibc's at 128 KiB and maps every larger tensor afresh, slower than the defaults
    return all(mallopt(param, value) == 1 for param, value in MALLOC_SETTINGS)


# ------------------------------------------------------------------------------ run_world: local test worlds
@dataclass
class RankFailure:
    """What a rank reported when its function raised."""

    rank: int
    error_type: str
    message: str
    traceback: str


class LaunchError(RuntimeError):
    """A launched world failed: a rank raised, died, or missed the deadline."""


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, report: Connection, threads: int,
            env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment at the launch (a fork server's is that of its own start)
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(threads)
    keep_freed_memory()
    try:
        value = fn(*args)
        report.send((True, value))  # whole in the pipe when it returns: the caller reads it even once we are gone
    except BaseException as exc:  # report every failure to the parent, including KeyboardInterrupt
        report.send((False, RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        report.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, nprocs: int, *args: Any, timeout_s: float = 300.0, threads: int = 1,
              return_failures: bool = False, allow_dead: bool = False, preload: tuple[str, ...] = ()) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` fresh processes forming one torch.distributed world.

    Returns the per-rank return values (index = rank). If a rank raises, the world is torn down and a
    LaunchError carries that rank's traceback (or, with ``return_failures``, the RankFailure is returned
    in its slot). If ranks are silent past ``timeout_s``, all are killed and the error names them.
    ``allow_dead`` puts None in the slot of a rank that exits without reporting instead of raising. A launch whose
    rendezvous port another process took before rank 0 bound it is made again on a fresh port (PORT_TRIES in all).

    Each process is a fresh interpreter (``spawn``) that imports torch itself: about 2 s of CPU a process,
    5 s for a world of 4 on 2 cores. With ``preload`` (module names) the processes are forked instead from
    ``multiprocessing``'s fork server, which imports those modules once, at this process's first such
    launch, and serves every later one: a caller that launches several worlds pays the imports once. The
    server only imports (it runs no kernel, makes no group and touches no device), so a forked process
    starts as a spawned one does; each gets the caller's environment as at its launch, as a spawned one (but
    glibc's malloc has read its ``MALLOC_*`` variables once, at the server's start).
    """
    launch = partial(_run_world_once, fn, nprocs, args, timeout_s, threads, return_failures, allow_dead, preload)
    for _ in range(PORT_TRIES - 1):
        try:
            return launch()
        except LaunchError as exc:  # the port was free when picked, another process bound it before rank 0 did
            if not any(word in str(exc) for word in PORT_TAKEN):
                raise
    return launch()


def _run_world_once(fn: Callable, nprocs: int, args: tuple, timeout_s: float, threads: int, return_failures: bool,
                    allow_dead: bool, preload: tuple[str, ...]) -> list[Any]:
    """One launch of ``run_world``'s world on one rendezvous port."""
    fork_server.quiet_backend_logs()
    if preload and "forkserver" in mp.get_all_start_methods():  # not on Windows: spawned there, as without
        ctx: Any = mp.get_context("forkserver")
        # read when the server starts, at the first such launch (fork_server: the server's quick end)
        ctx.set_forkserver_preload([*preload, fork_server.__name__])
    else:
        ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(nprocs)]  # (read end, write end): one per rank, its report
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, pipes[r][1], threads, env), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        for _read, write in pipes:  # the ranks hold their own write ends; a rank's pipe ends when it does
            write.close()
        values = _collect(procs, [read for read, _write in pipes], timeout_s, return_failures, allow_dead)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for read, _write in pipes:
            read.close()
    return values


def _collect(procs: list, reports: list[Connection], timeout_s: float, return_failures: bool,
             allow_dead: bool) -> list[Any]:
    """Each rank's report, read as it comes; a rank that ends without one (its process gone, or its pipe closed)
    is seen at once: a rank sends its report whole before it ends, so a pipe that holds nothing when its process
    has ended never will."""
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            silent = [r for r in range(len(procs)) if r not in values]
            raise LaunchError(f"timeout after {timeout_s:.0f}s: ranks {silent} did not answer "
                              f"(ranks {sorted(values)} finished)")
        waiting = [r for r in range(len(procs)) if r not in values]
        ready = set(wait([w for r in waiting for w in (reports[r], procs[r].sentinel)], timeout=remaining))
        dead = []
        for r in waiting:
            if reports[r] not in ready and procs[r].sentinel not in ready:
                continue
            try:
                if not reports[r].poll(0):  # ended, and its pipe held nothing
                    raise EOFError
                ok, value = reports[r].recv()
            except EOFError:
                dead.append(r)
                continue
            if not ok and not return_failures:
                raise LaunchError(f"rank {r} raised {value.error_type}: {value.message}\n{value.traceback}")
            values[r] = value
        if dead and allow_dead:
            values.update({r: None for r in dead})
        elif dead:
            for r in dead:
                procs[r].join(timeout=5)  # its pipe may end a moment before its exit status is known
            raise LaunchError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]}) "
                              "without reporting")
    return [values[r] for r in range(len(procs))]


# ---------------------------------------------------------------------- jobs: the elastic launcher, torchrun
@dataclass
class JobError(Exception):
    """A launched job failed; ``message`` is one line naming the rank."""

    message: str
    exit_code: int = 1

    def __str__(self) -> str:
        return self.message


@dataclass
class JobStopped(JobError):
    """The workers ended on a stop signal (``signal_name``) the launcher forwarded, before they could stop in their
    own way (still starting); ``killed``: the launcher killed them (a second Ctrl-C, or ``STOP_TIMEOUT_S`` over)."""

    signal_name: str = "SIGINT"
    killed: bool = False


def under_torchrun() -> bool:
    """True when this process is already a worker of torchrun (or another torch elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_or_launch(target: str, payload: dict, nproc: int, forward: tuple[int, ...] = (signal.SIGTERM,)) -> Any:
    """Run ``module:function(payload)`` here when this process is already a worker or one process is
    enough; otherwise launch ``nproc`` local workers (``launch``; ``forward``: the signals passed on to them)."""
    if under_torchrun() or nproc == 1:
        keep_freed_memory()
        module, _, function = target.partition(":")
        return getattr(importlib.import_module(module), function)(payload)
    return launch(target, payload, nproc, forward)


def worker(target: str, payload: dict, failure_dir: str, env: dict[str, str] | None = None):
    """Entry point of one worker: ``module:function(payload)``; failures go to ``failure_dir/rank{r}``. ``env``:
    the launcher's environment at the launch, which this process takes, keeping the variables the agent set."""
    import torch

    end_with_parent(os.getppid())  # the fork server's (or the launcher's) end is this worker's, even by SIGKILL
    if env is not None:
        agent = {k: v for k, v in os.environ.items() if _INHERITED_ENV.get(k) != v}
        os.environ.clear()
        os.environ.update(env, **agent)
    os.environ[JOB_DIR_ENV] = failure_dir  # job_signals.ending_after_a_failure
    rank = int(os.environ.get("RANK", "0"))
    note_pid(Path(failure_dir), rank)
    torch.set_num_threads(worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    keep_freed_memory()
    module, _, name = target.partition(":")
    try:
        for sig in taken_signals(Path(failure_dir)):  # the launcher's stop signals from before this worker ran
            os.kill(os.getpid(), sig)
        if hasattr(signal, "pthread_sigmask"):  # a Ctrl-C held since the start (``HeldInterrupts``) arrives here
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return getattr(importlib.import_module(module), name)(payload)
    except BaseException as exc:
        Path(failure_dir, f"rank{rank}").write_text(f"{type(exc).__name__}\n{exc}".strip())
        Path(failure_dir, f"rank{rank}.traceback").write_text(traceback.format_exc())
        if not isinstance(exc, KeyboardInterrupt) and type(exc).__name__ not in EXIT_CODES:
            # the agent names the first worker it sees exit: a peer killed first (whose error here is its loss)
            # must be seen first, yet a forked worker's death reaches the agent once the fork server has reaped it,
            # and this one would exit at once (a forked process skips the interpreter's finalization)
            await_job_end(Path(failure_dir), FAILED_WAIT_S)
        if os.environ.get("PLAIT_DEBUG"):
            raise
        sys.exit(EXIT_CODES.get(type(exc).__name__, 1))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def launch(target: str, payload: dict, nproc: int, forward: tuple[int, ...] = (signal.SIGTERM,),
           again_kills: bool = False, preload: tuple[str, ...] = ()) -> list:
    """Run ``target(payload)`` on ``nproc`` local processes (elastic launcher); per-rank results.

    The workers are forked from ``multiprocessing``'s fork server, which imports torch, the target's module and
    ``preload`` (module names) once, at this process's first launch, and serves the later ones (spawned where
    there is no fork server). Each worker takes this process's environment as at the launch.

    The signals in ``forward`` go to the workers, which stop on them in their own way (``plait serve`` also
    on SIGINT); the agent handles the other ones of ``AGENT_SIGNALS`` by stopping the workers at once. With
    ``again_kills`` a second SIGINT kills the workers instead (``plait train``: no waiting for a step's end). A
    SIGINT while the workers start waits for their entry point (``HeldInterrupts``); workers that end on a forwarded
    signal without an error of their own raise ``JobStopped``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # our own one-line report replaces its tables
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = {signal.Signals(sig).name for sig in forward}
    agent_signals = ",".join(name for name in AGENT_SIGNALS.split(",") if name not in names)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = agent_signals  # ``forward`` is forwarded by us (below)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"plait-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method=fork_server.start_method(target, preload))
    if hasattr(config, "signals_to_handle"):
        config.signals_to_handle = agent_signals
    with tempfile.TemporaryDirectory(prefix="plait-job-") as failures, contextlib.ExitStack() as stack:
        forwarders = [stack.enter_context(ForwardSignal(sig, again_kills, Path(failures))) for sig in forward]
        watch = stack.enter_context(ResumeStopped(Path(failures), lambda: worker_pids(os.getpid()),
                                                  FAILED_WAIT_S + 1.0))
        stack.enter_context(HeldInterrupts())
        try:
            results = elastic_launch(config, worker)(target, payload, failures, dict(os.environ))
        except ChildFailedError as exc:
            stop = next((f for f in forwarders if f.received), None)
            if stop is not None and _only_stopped(exc, Path(failures)):
                name = signal.Signals(stop.received).name
                raise JobStopped(f"stopped ({name})", 128 + stop.received, name, stop.killed) from None
            message, code = _explain(exc, Path(failures))
            raise JobError(message + watch.said(), code) from None
    return [results[r] for r in sorted(results)]


def _only_stopped(exc, failures: Path) -> bool:
    """True when no failed worker reported an error of its own: each died (by a signal) or was interrupted."""
    return all(not (failures / f"rank{r}").is_file()
               or (failures / f"rank{r}").read_text().partition("\n")[0] == "KeyboardInterrupt" for r in exc.failures)


def _explain(exc, failures: Path) -> tuple[str, int]:
    """One line naming the rank that failed first, and the exit code to use."""
    reports: dict[int, tuple[str | None, str | None, Any]] = {}
    for rank, failure in exc.failures.items():  # keyed by global rank
        f = failures / f"rank{rank}"
        if f.is_file():
            name, _, text = f.read_text().partition("\n")
            reports[rank] = (name, text or name, failure)
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
    real = [r for r, (kind, _, _) in reports.items() if kind not in LOST_PEER]
    r = min(real or reports, key=lambda k: (reports[k][2].timestamp, k))
    kind, msg, _ = reports[r]
    prefix = "" if kind in ("ConfigError", "NonFiniteLoss") else f"{kind}: "
    return f"rank {r}: {prefix}{msg}", EXIT_CODES.get(kind or "", 1)
