"""The seam plait's collectives go through: each names what it moves and over which group, and a backend's
failure there (a peer died, closed its connection or went silent) becomes a ``plait.CommError`` saying so
("dp all-reduce of gradients over global ranks 0,1 failed (did global rank 1 die?): ...") instead of the
backend's bare RuntimeError. Also the one home of the flat tensor collectives' names across torch versions."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait.errors import CommError, collective_error, is_timeout

T = TypeVar("T")

# torch >= 2.13 renamed the flat tensor collectives; keep the older names working for the open version range
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective(what: str | Callable[[], str], group: ProcessGroup | None, op: Callable[[], T]) -> T:
    """Run ``op``: a blocking collective over ``group`` (None: the world), or the wait for one launched with
    ``async_op=True``. ``what`` names it ("dp all-reduce of gradients"; a function giving the words is called only
    on an error). A backend error (``backend_failure``) becomes plait.errors.collective_error's CommError naming
    it, the group's global ranks and the other members; a CommError from inside ``op``, and an error of the call
    itself (a wrong tensor, out of memory), pass as they are."""
    try:
        return op()
    except CommError:
        raise
    except RuntimeError as exc:
        if not backend_failure(exc):
            raise
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        raise collective_error(what() if callable(what) else what, ranks, dist.get_rank(), exc) from exc


def backend_failure(exc: RuntimeError) -> bool:
    """Whether a collective's error is the transport's (a peer gone or silent) rather than the call's own: torch's
    distributed error kinds (NCCL's DistBackendError, store and network errors), Gloo's errors (they name their
    ``gloo/transport`` source file or a connection), and a wait that timed out."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or "gloo" in text or "connection" in text or is_timeout(exc)
