"""ParallelContext (mesh, process groups, rank coordinates) and local launch helpers."""

from plait.distributed.context import ParallelContext, init

__all__ = ["ParallelContext", "init"]
