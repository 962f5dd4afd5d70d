"""The default process group of this process, made from its launcher's environment (or over a given store) before
any layout's groups, the device of its collectives, and how long a rank waits for a peer (``PLAIT_TIMEOUT``)."""

from __future__ import annotations

import datetime
import os
import re

import torch
import torch.distributed as dist

from plait.distributed.at_exit import destroy_at_exit, settle_at_exit
from plait.distributed.environment import launched_world, local_rank
from plait.distributed.rendezvous import agent_store_shared, generation_store
from plait.errors import CommTimeoutError

#: how long a rank waits for a peer, in seconds: in making the default group and in every collective after it
DEFAULT_TIMEOUT_S = float(os.environ.get("PLAIT_TIMEOUT", "300"))


def ensure_default_group(timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.Store | None = None) -> None:
    """Initialise the default process group from the launcher's environment (or over ``store``) unless it exists: NCCL
    when CUDA and NCCL are there (on the GPU ``local_rank`` picks), else Gloo. An incomplete launch environment is a
    ConfigError before anything is made (``launched_world``, ``local_rank``). One process without a launcher gets an
    in-process store (no port opened, nothing set for processes started later). At exit a group made here is
    destroyed, and Gloo's workers waited for whoever made it (distributed.at_exit)."""
    settle_at_exit()
    if dist.is_initialized():
        return
    launched = launched_world()
    rank, world = launched or (0, 1)
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(process_device().index)
    if store is None and launched is None:
        store = dist.HashStore()
    if store is None and agent_store_shared():  # torchrun's long-lived store: this generation's own (rendezvous)
        store = generation_store(rank, timeout_s)
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world, store=store,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError as exc:  # a rank that never published its address: stopped, hung or not started
        raise CommTimeoutError(f"rank {rank} waited more than {timeout_s:g}s for {_awaited(exc, rank, world)} to "
                               f"join the default process group ({world} ranks) at start-up (stopped, hung or not "
                               f"started?): {exc}") from exc
    destroy_at_exit()


def _awaited(exc: Exception, rank: int, world: int) -> str:
    """The rank whose address ``exc`` (a start-up store wait) timed out on, in words: Gloo's key of it ends in
    its rank; "the other ranks" when the key names none."""
    key = re.search(r"keys: \S*/(\d+)\s*$", str(exc))
    other = int(key.group(1)) if key else -1
    return f"global rank {other}" if 0 <= other < world and other != rank else "the other ranks"


def process_device() -> torch.device:
    """The device this process computes on, with or without a process group: its GPU where CUDA is there (the
    ``local_rank``-th: GPU 0 for a process alone), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank(launched_world(), torch.cuda.device_count()))


def default_device() -> torch.device:
    """The device of this process's collectives: its current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
