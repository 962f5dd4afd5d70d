"""A child process that ends when its parent is gone: a launcher's fork server and workers, ``plait data
prepare``'s pool workers. SIGKILL leaves a parent no time to end its children; without this they would run on
(a job's workers would finish the run, writing checkpoints beside a restarted job's, then wait forever for the
launcher to collect their results)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def end_with_parent(parent: int) -> None:
    """End this process when ``parent`` (its parent's pid, read at its start) is gone. On Linux the kernel kills it
    then (``prctl(PR_SET_PDEATHSIG, SIGKILL)``; a process forked from this one and calling this in turn ends with
    it too); elsewhere a thread looks twice a second."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # gone before that was set
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="plait-parent-watch", daemon=True).start()
