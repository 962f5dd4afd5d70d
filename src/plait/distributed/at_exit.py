"""The default process group plait makes is destroyed when the program ends, before the interpreter's teardown."""

from __future__ import annotations

import atexit

import torch.distributed as dist
from torch.distributed import ProcessGroup


def destroy_at_exit() -> None:
    """Have the default process group, just made by plait, and every group made over it destroyed when the
    program ends, while the interpreter is still whole (``atexit``: before its finalization). Left to the
    finalization, a Gloo group can be destroyed after Python is torn down, and the process then aborts with
    "terminate called without an active exception" and a non-zero status although the program returned. A
    program that destroys the group itself first, or makes another default group since, is left as it is."""
    atexit.register(_destroy, dist.group.WORLD)


def _destroy(world: ProcessGroup | None) -> None:
    """Destroy every process group if the default one is still ``world``; local, no collective runs."""
    if dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group()
