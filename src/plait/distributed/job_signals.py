"""The stop signals of a job that ``plait.distributed.launch.launch`` runs: passed on to its workers
(``ForwardSignal``), held in the workers until their entry point while they start (``HeldInterrupts``), and taken
by stopped workers once the job has failed (``ResumeStopped``); in a worker (of that launcher or of torchrun),
whether the launcher's SIGTERM ends a failed job (``ending_after_a_failure``), signals taken in a thread of their
own whatever the main thread waits on (``SignalThread``) and the end of a worker that cannot take them
(``end_after``); what the kernel says of processes (``process_state``, ``child_pids``)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

STOP_TIMEOUT_S = 120.0  # after a SIGTERM, time the workers get to reach a step boundary, save and exit
#: after the SIGTERM with which the launcher ends a failed job, how long a worker left gets to end by itself (rank 0
#: of plait serve: to answer its clients' requests with the error) before ``end_after`` ends it
FAILED_END_S = 3.0
#: the environment variable naming, in a launched worker, its job's folder: each failed worker's ``rank{r}`` file and
#: each stop signal ``ForwardSignal`` passed on (``signal-N``)
JOB_DIR_ENV = "PLAIT_JOB_DIR"
WATCH_STEP_S = 0.02  # how often the waits below look again


class HeldInterrupts:
    """While active, the workers this thread starts begin with SIGINT blocked (a process's signal mask outlives
    fork and exec: the fork server a first launch starts here passes it on to the workers it forks), so that a
    Ctrl-C while they start waits for their entry point (``worker`` unblocks it inside its error handling)
    instead of printing each one's traceback out of an import. This process still takes it: the kernel hands a
    blocked signal to a thread that does not block it, here one started to that end."""

    def __init__(self):
        self.ready = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
        self.done = threading.Event()
        self.mask: set = set()  # this thread's mask before

    def __enter__(self):
        if self.ready:  # the thread first: it keeps the mask of its start, SIGINT open
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()  # its start unblocks SIGINT: started now, it is not started again
            threading.Thread(target=self.done.wait, name="plait-sigint", daemon=True).start()
            self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return self

    def __exit__(self, *exc) -> None:
        if self.ready:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
            self.done.set()


class ForwardSignal:
    """While active (main thread only), ``sig`` to this process goes to its worker processes instead; those
    still alive ``STOP_TIMEOUT_S`` later are killed, or with ``again_kills`` at once on a second SIGINT. With
    ``note`` (a folder) each signal is also written there as ``signal-N``, for the workers not running yet (a
    fork server still importing): ``taken_signals`` reads them at their entry point."""

    def __init__(self, sig: int, again_kills: bool = False, note: Path | None = None):
        self.sig, self.again_kills, self.note = sig, again_kills, note
        self.previous: Callable[[int, FrameType | None], Any] | int | None = None
        self.timer: threading.Timer | None = None
        self.received = 0  # the signal forwarded (0: none yet)
        self.killed = False  # the workers killed: a second SIGINT with again_kills, or STOP_TIMEOUT_S over

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
        self.received = signum
        if self.note is not None:
            (self.note / f"signal-{signum}").touch()
        if self.again_kills and self.timer is not None and signum == signal.SIGINT:  # Ctrl-C again: kill now
            self._kill()
            return
        for child in mp.active_children():
            if child.pid is not None:
                os.kill(child.pid, signum)
        if self.timer is None:
            timer = threading.Timer(STOP_TIMEOUT_S, self._kill)
            timer.daemon = True
            timer.start()
            self.timer = timer

    def _kill(self) -> None:
        self.killed = True
        for child in mp.active_children():
            child.kill()


class ResumeStopped:
    """While active, ``after_s`` seconds after a worker reported a failure (a ``rank*`` file in ``failures``),
    every worker that is stopped (SIGSTOP: state T) gets SIGCONT. The launcher ends a failed job by sending
    SIGTERM to the workers left, which a stopped process takes only once continued: a stopped worker would
    hold the job's end for torch elastic's whole shutdown timeout (30 s), then be killed. ``workers`` gives the
    worker pids."""

    def __init__(self, failures: Path, workers: Callable[[], list[int]], after_s: float):
        self.failures, self.workers, self.after_s = failures, workers, after_s
        self.continued: list[int] = []  # the stopped workers it continued
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="plait-resume-stopped", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop the watch and wait for it: the caller removes ``failures`` next, which the watch may be reading."""
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        while not any(self.failures.glob("rank*")):
            if self.done.wait(0.2):
                return
        # each stopped worker continued once the launcher's SIGTERM waits in it (the job's end has begun), all of
        # them after_s after the failure at the latest
        deadline = time.monotonic() + self.after_s
        while not self.done.wait(WATCH_STEP_S):
            late = time.monotonic() >= deadline
            for pid in self.workers():
                if pid not in self.continued and process_state(pid) == "stopped" and (late or term_pending(pid)):
                    self.continued.append(pid)
                    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                        os.kill(pid, signal.SIGCONT)
            if late:
                return

    def said(self) -> str:
        """What the failed job's message adds of the workers it found stopped: '; rank 1 (pid 4242) was stopped
        (SIGSTOP or Ctrl-Z) when the job failed' ('' for none; each rank as the worker wrote it, ``note_pid``)."""
        names = []
        for pid in self.continued:
            f = self.failures / f"pid{pid}"
            names.append(f"rank {f.read_text()} (pid {pid})" if f.is_file() else f"pid {pid}")
        return f"; {', '.join(names)} {'was' if len(names) == 1 else 'were'} stopped (SIGSTOP or Ctrl-Z) when the " \
            "job failed" if names else ""


def note_pid(job: Path, rank: int) -> None:
    """In a launched worker: its rank, in its job's folder under its pid (``ResumeStopped.said`` names it)."""
    (job / f"pid{os.getpid()}").write_text(str(rank))


def await_job_end(job: Path, bound_s: float) -> None:
    """In a launched worker that failed, before it exits, while a peer of its job has ended (a killed peer, whose
    loss is likely this worker's error): until the launcher begins ending the job (its SIGTERM, sent once it has
    seen a worker end, which it names), at most ``bound_s``. The launcher names the first worker it sees end, and a
    worker forked by the fork server is seen only once that server has reaped it: a peer killed first is then seen
    first. At once when every peer (``note_pid``) still runs: the error is this worker's own. Main thread only."""
    peers = [int(f.name[3:]) for f in job.glob("pid*") if f.name[3:].isdigit() and int(f.name[3:]) != os.getpid()]
    if not any(process_state(pid) in ("exited", "gone") for pid in peers):
        return
    ending = threading.Event()
    before = signal.signal(signal.SIGTERM, lambda signum, frame: ending.set())
    try:
        deadline = time.monotonic() + bound_s
        while not ending.is_set() and time.monotonic() < deadline:
            time.sleep(WATCH_STEP_S)
    finally:
        signal.signal(signal.SIGTERM, before)


def term_pending(pid: int) -> bool:
    """Whether a SIGTERM waits in process ``pid`` (a stopped process takes it once continued; Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return False
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in masks)


PROC_STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible sleep (I/O or a driver)",
               "Z": "exited", "R": "running", "S": "sleeping"}


def process_state(pid: int) -> str:
    """What the kernel says process ``pid`` is doing (Linux ``/proc``): "stopped", "running", ... or "gone"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "state unknown"
    return PROC_STATES.get(state, f"state {state}")


def child_pids(pid: int, command: bytes | None = None) -> list[int]:
    """The live (not zombie) child processes of ``pid``, sorted; with ``command``, only those whose command line
    holds it (``b"spawn_main"``: processes ``multiprocessing`` spawned, not its resource tracker). Read from
    Linux's /proc: elsewhere, none."""
    out = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]  # after "pid (name)"
            if int(ppid) == pid and state != "Z" and (command is None or command in (entry / "cmdline").read_bytes()):
                out.append(int(entry.name))
        except (OSError, ValueError):  # the process ended while we read it
            continue
    return sorted(out)


def a_worker_ended() -> bool:
    """True in a launched worker when a fellow worker of its job has ended: its parent, the fork server that forked
    the job's workers or torchrun's agent that started them, has fewer live children than the job has workers here
    (``LOCAL_WORLD_SIZE``). False where that cannot be told: off Linux, and for workers spawned by plait's launcher
    (its other children count too)."""
    children = child_pids(os.getppid())
    return 0 < len(children) < int(os.environ.get("LOCAL_WORLD_SIZE", "0"))


def ending_after_a_failure() -> bool:
    """True in a launched worker whose job is ending because a worker failed, so that the SIGTERM its launcher sends
    the workers left is nobody's request to stop. Under plait's launcher: a failure is written down in the job's
    folder or a worker has ended (one killed writes nothing), and no stop signal was passed on. Under torchrun, which
    passes on no note of why: a worker of this host has ended (a SIGTERM to every worker alive, a preemption, is a
    request to stop; the death of a worker of another host is not seen here). False outside a launched job."""
    from plait.distributed.launch import under_torchrun

    folder = os.environ.get(JOB_DIR_ENV)
    if not folder:
        return under_torchrun() and a_worker_ended()
    job = Path(folder)
    return not taken_signals(job) and (any(job.glob("rank*")) or a_worker_ended())


def ended_ranks() -> list[int]:
    """In a worker of torchrun, the global ranks of the workers of this host that have ended: the ``LOCAL_RANK``s
    none of its agent's live children (``child_pids``) has, numbered as torchrun numbers ranks, host by host. None
    are named where a live worker's environment cannot be read (Linux's /proc: elsewhere, none)."""
    me = int(os.environ.get("LOCAL_RANK", "0"))
    live = {me}
    for pid in child_pids(os.getppid()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended while we read, or not ours to read
            return []
        live.update(int(v) for k, _, v in (e.partition(b"=") for e in env)
                    if k == b"LOCAL_RANK" and v.isdigit())
    first = int(os.environ.get("RANK", "0")) - me
    return [first + r for r in range(int(os.environ.get("LOCAL_WORLD_SIZE", "0"))) if r not in live]


def torchrun_failure() -> str:
    """The line a torchrun worker prints as ``SignalThread`` ends it after its agent's SIGTERM to a failed job (the
    agent's own report follows, naming the first failure): which ranks ended. Under plait's launcher the launcher
    names the failed rank: nothing."""
    if os.environ.get(JOB_DIR_ENV):
        return ""
    ended = ended_ranks()
    who = f"{'rank' if len(ended) == 1 else 'ranks'} {', '.join(map(str, ended))}" if ended else "a worker"
    return (f"error: rank {os.environ.get('RANK', '0')}: {who} of this host ended, and torchrun ends the job: this "
            f"rank ends {FAILED_END_S:g} s after its SIGTERM")


def end_after(seconds: float, status: int, said: str = "") -> None:
    """End this process ``seconds`` from now with exit status ``status`` (its standard streams flushed, after ``said``
    as a line on standard error where given), whatever its main thread is doing then: a daemon timer, for a signal
    thread to start. Python runs a signal's handler in the main thread between two bytecodes, which a main thread
    blocked in C++ (a collective waiting on a live peer, a process group's teardown) does not reach."""

    def end() -> None:
        if said:
            with contextlib.suppress(Exception):
                print(said, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # closed, or a pipe no one reads
                stream.flush()
        os._exit(status)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


class SignalThread:
    """While open (made in the main thread), ``signals`` reach ``note(signum, failed)`` in a thread of its own at
    once, whatever the main thread is doing: Python runs a signal's handler only when the main thread next runs
    Python code, and it may be inside a long step or a collective that waits on a peer. The thread is woken
    through ``signal.set_wakeup_fd``; the Python-level handler does nothing. ``failed``: the signal comes with the
    launcher's end of a failed job (``ending_after_a_failure``), and at its SIGTERM this process ends
    ``FAILED_END_S`` later unless it has ended by then (``end_after``): a worker blocked on a peer that is alive
    and waits too would otherwise be ended by torch elastic's SIGKILL 30 s later. Made elsewhere than in the main
    thread it does nothing (the signals keep their handlers)."""

    def __init__(self, signals: tuple[int, ...], note: Callable[[int, bool], None]):
        self.signals, self.note = signals, note
        self.ending = False  # the launcher's end of a failed job: this process ends ``FAILED_END_S`` after it
        self.wake: tuple[int, int] | None = None  # the wakeup pipe's write end and the fd it replaced
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in signals:
            signal.signal(sig, _in_thread)
        read, write = os.pipe()
        os.set_blocking(write, False)
        self.wake = (write, signal.set_wakeup_fd(write))
        threading.Thread(target=self._watch, args=(read,), name="plait-signals", daemon=True).start()

    def _watch(self, read: int) -> None:
        """The thread: each signal's number arrives as one byte, until the pipe closes."""
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while data := pipe.read(64):
                for signum in data:
                    if signum in self.signals:
                        self._take(signum)

    def _take(self, signum: int) -> None:
        failed = ending_after_a_failure()
        if failed and signum == signal.SIGTERM and not self.ending:
            self.ending = True
            end_after(FAILED_END_S, 128 + signum, torchrun_failure())
        self.note(signum, failed)

    def close(self) -> None:
        """Stop the thread (the handlers stay: a late signal must not fail a process that has finished)."""
        if self.wake is not None:
            write, before = self.wake
            signal.set_wakeup_fd(before)
            os.close(write)  # the thread reads the end of the pipe and returns
            self.wake = None


def _in_thread(signum: int, frame: FrameType | None) -> None:
    """``SignalThread``'s Python-level handler: nothing to do, its thread has already acted on the signal."""


def taken_signals(note: Path) -> list[int]:
    """The signals a ``ForwardSignal`` wrote down in the folder ``note``."""
    return sorted(int(f.name.removeprefix("signal-")) for f in note.glob("signal-*"))
