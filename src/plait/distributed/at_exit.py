"""What plait has done at the program's exit, while the interpreter is still whole (``atexit``, before its
finalization): the default process group plait made is destroyed, and torch's Gloo worker threads are given the
moments they need to let go of the collectives they finished.

Both guard against the same end: a C++ thread of torch that needs Python once the interpreter is finalizing is
ended by Python in the middle of a destructor, and the process aborts ("terminate called without an active
exception", SIGABRT) with a non-zero status although the program returned.
"""

from __future__ import annotations

import atexit
import gc
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait.distributed.job_signals import process_state

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives each worker thread of a ProcessGroupGloo
SETTLE_LIMIT_S = 1.0  # the longest the program's end waits for Gloo's workers
SETTLE_STEP_S = 0.005  # the GIL is free this long between two looks at the workers
TASKS = Path("/proc/self/task")  # this process's threads (Linux)


def destroy_at_exit() -> None:
    """Have the default process group, just made by plait, and every group made over it destroyed when the
    program ends. Left to the finalization, a Gloo group can be destroyed after Python is torn down. A program
    that destroys the group itself first, or makes another default group since, is left as it is."""
    atexit.register(_destroy, dist.group.WORLD)


def _destroy(world: ProcessGroup | None) -> None:
    """Destroy every process group if the default one is still ``world``; local, no collective runs."""
    if dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group()


def skip_collection_at_exit() -> None:
    """Have the program's end leave the objects that exist now to the process's exit instead of the interpreter's
    garbage collection (``gc.freeze`` at the exit; objects made later are still collected): for a process that
    ends on an error, where collecting torch's modules and the run's objects in the finalization only delays its
    end. The ``__del__`` of an object in a reference cycle is not run; reference counting still frees every other
    object let go of (the default process group's destruction at the exit among them), and Python still flushes
    its standard streams. Registered once however often it is asked."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def settle_at_exit() -> None:
    """Have the program's end wait, at most ``SETTLE_LIMIT_S``, until no Gloo worker thread of this process is
    running (``settle_gloo_workers``); registered once however often it is asked.

    A Gloo worker thread wakes the caller of a collective as soon as the collective is done, and lets go of its
    tensors after: where the caller's Python objects of those tensors are gone by then, letting go takes the GIL
    to free them. Destroying a group does not stop its threads (they stop when no Python object refers to the
    group any more), and a worker descheduled on a loaded machine can reach that point after the main thread
    has begun the interpreter's finalization, which ends the worker in its destructor and aborts the process."""
    atexit.unregister(settle_gloo_workers)
    atexit.register(settle_gloo_workers)


def settle_gloo_workers(limit_s: float = SETTLE_LIMIT_S, tasks: Path = TASKS) -> bool:
    """Wait, releasing the GIL in steps of ``SETTLE_STEP_S``, until two looks in a row find no Gloo worker thread
    running or ready to run (a worker waiting for the GIL takes it while this one sleeps). True once settled,
    False after ``limit_s`` (a collective still in flight at the exit) or where the threads cannot be read
    (not Linux: one step's wait)."""
    if not tasks.is_dir():
        time.sleep(SETTLE_STEP_S)
        return False
    deadline = time.monotonic() + limit_s
    calm = 0
    while calm < 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(SETTLE_STEP_S)
        calm = 0 if _gloo_worker_running(tasks) else calm + 1
    return True


def _gloo_worker_running(tasks: Path) -> bool:
    """Whether a thread named ``GLOO_WORKER`` among ``tasks`` is running or runnable (``process_state``: a thread's
    id names it in /proc as a process's does)."""
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name == GLOO_WORKER and process_state(int(task.name)) == "running":
            return True
    return False
