"""ParallelContext (mesh, process groups, rank coordinates) and local launch helpers.

``ParallelContext`` and ``init`` are loaded with torch on first use, so that the launcher's modules
(``plait.distributed.launch``, ``job_signals``) import without torch: ``plait train`` starts its workers' fork
server before this process imports torch, and the two imports run side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.distributed.context import ParallelContext, init

__all__ = ["ParallelContext", "init"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from plait.distributed import context

        return getattr(context, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
