"""One run at a time in a checkpoint folder.

Two runs saving into one folder remove each other's saves in progress (a save clears the ``.step_*.tmp`` folders
it finds, taking them for the remains of a killed save), can commit one run's shard file under the other's
``meta.json`` when they save the same step, and point ``latest`` at each other's checkpoints in turn, so that a
later ``--resume`` continues whichever wrote last. The run that saves into a folder therefore holds ``.lock`` in
it: an advisory ``flock``, which the kernel releases when the holding process ends, however it ends (a killed
run, a torchrun restart, leaves no stale lock). A second run finds it held and is refused, naming the holder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from plait.errors import ConfigError

LOCK = ".lock"


@contextmanager
def hold_folder(folder: str | Path, flag: str = "--checkpoint-dir") -> Iterator[None]:
    """Hold ``folder``'s lock for the ``with`` block (the folder made if need be, and removed again if nothing else
    was put in it); a ConfigError naming ``flag``, the folder and the process that holds it when another does, or
    why the folder cannot be written. A filesystem without ``flock`` (some network filesystems answer ENOLCK) runs
    unlocked."""
    path = Path(folder)
    made = not path.is_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a read-only filesystem, no permission: said before the run, not at its first save
        raise ConfigError(f"{flag} {folder}: checkpoints cannot be written there ({exc.strerror})") from None
    try:
        if _lock(fd, f"{flag} {folder}", flag):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), 0)
        yield
    finally:
        if made and [p.name for p in path.iterdir()] == [LOCK]:  # a run that saved nothing leaves no folder
            with suppress(OSError):
                (path / LOCK).unlink()
                path.rmdir()
        os.close(fd)  # releases the lock


def _lock(fd: int, named: str, flag: str) -> bool:
    """Take the lock of open file ``fd``: True once held, False where the filesystem has no ``flock``; a
    ConfigError beginning with ``named`` when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        raise ConfigError(f"{named}: another run saves its checkpoints there ({holder}); give this run another "
                          f"{flag}, or let that run end first") from None
    return True
