"""The fork server that ``plait.distributed.launch`` forks a job's workers from: what it imports, starting it ahead
of a launch, and its end. Imports no torch, so that a caller can start the server before importing torch itself.

The server imports torch and the job's modules once (about 4 s of CPU) for every worker it forks. ``ahead``
starts it while its caller still has work of its own before the launch (``plait train`` checks its configuration,
importing torch too: about 2 s), so that on two or more cores both run at once.

When its launcher exits, the server leaves without the interpreter's teardown of those modules (about a second of
CPU, during which it would still hold the launcher's standard output and error, which it shares with its workers:
a caller reading the launcher's output to its end would wait for it). It has nothing of its own to flush or close.
A launcher killed (SIGKILL: no exit of its own) takes the server with it, and the server its workers
(``plait.distributed.parent``).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing import forkserver
from types import FrameType

from plait.distributed.parent import end_with_parent


def modules(target: str, preload: tuple[str, ...] = ()) -> list[str]:
    """What the server imports for the workers of ``target`` (``module:function``): torch, the launcher's modules,
    the target's module and ``preload``."""
    return ["torch", "torch.distributed.elastic.multiprocessing.api", "plait.distributed.launch", __name__,
            target.partition(":")[0], *preload]


def quiet_backend_logs() -> None:
    """Hide the C++ warnings of torch's c10d (``socket.cpp ... waitForInput ... timed out after 5000ms``) in the
    processes this one starts: a worker waiting on a silent peer printed them above plait's one-line error, which
    names the rank and the wait. torch reads TORCH_CPP_LOG_LEVEL once, at its import, so it goes into this process's
    environment before the server (or a spawned worker) starts. A level the user set stays; PLAIT_DEBUG=1 keeps
    the warnings."""
    if not os.environ.get("PLAIT_DEBUG"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def start_method(target: str, preload: tuple[str, ...] = ()) -> str:
    """``forkserver``, its imports set (read when the server starts), or ``spawn`` where there is none; either way
    the workers' environment quiets torch's C++ warnings first (``quiet_backend_logs``)."""
    quiet_backend_logs()
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(modules(target, preload))
    return "forkserver"


def _servers() -> set[int]:
    """This process's fork servers (Linux's /proc; elsewhere none)."""
    from plait.distributed.job_signals import child_pids

    return set(child_pids(os.getpid(), b"multiprocessing.forkserver"))


@contextlib.contextmanager
def ahead(target: str, preload: tuple[str, ...] = ()) -> Iterator[None]:
    """Start the server for a launch of ``target`` now (if none runs), while the block runs; a later ``launch`` of
    this process forks from it. The server starts with SIGINT blocked, as ``launch`` starts it (``HeldInterrupts``:
    its workers begin so). If the block raises (an invalid configuration, Ctrl-C), a server started here is ended."""
    if start_method(target, preload) != "forkserver":
        yield
        return
    from multiprocessing import resource_tracker

    before = _servers()
    resource_tracker.ensure_running()  # its start unblocks SIGINT: started first, it is not started again
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        yield
    except BaseException:
        started = _servers() - before
        for pid in started:  # still importing: it would finish before it saw this process end
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while started & _servers() and time.monotonic() < deadline:  # dead (a zombie: multiprocessing reaps it,
            time.sleep(0.01)  # and starts another at the next launch), not alive and refusing that launch
        raise


def launching(target: str, processes: int) -> contextlib.AbstractContextManager:
    """``ahead`` where a command is about to launch ``processes`` workers of ``target`` itself (more than one, and
    not under torchrun, whose workers run the command each); otherwise nothing."""
    from plait.distributed.launch import under_torchrun

    return ahead(target) if processes > 1 and not under_torchrun() else contextlib.nullcontext()


def _in_server() -> bool:
    """True while the fork server imports this module (``multiprocessing.forkserver.main`` on the stack)."""
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _leave(pid: int) -> None:
    if os.getpid() == pid:  # the server (its workers end by os._exit and never run this)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the server's own end: its launcher is gone (it exits 0 then too)


if _in_server():
    atexit.register(_leave, os.getpid())
    end_with_parent(os.getppid())  # a SIGKILLed launcher's server ends with it, and its workers with the server
