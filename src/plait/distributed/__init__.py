"""ParallelContext (mesh, process groups, rank coordinates) and local launch helpers."""

from plait.distributed.context import Layout, ParallelContext, init, resolve_layout

__all__ = ["Layout", "ParallelContext", "init", "resolve_layout"]
