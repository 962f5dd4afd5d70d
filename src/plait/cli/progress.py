"""The line a command prints at once, before it imports torch (seconds of silence, a minute on a loaded host)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

from plait.words import counted, mesh

if TYPE_CHECKING:
    from plait.parallel_config import ParallelConfig


def starting(command: str, processes: int, layout: str) -> None:
    """Say on standard error that ``plait command`` is starting ``processes`` processes of ``layout`` ("tp 2 x
    pp 2"), when a person is watching it (a terminal): a pipe or a log gets the command's own output only. Not
    under torchrun, whose every worker runs the command."""
    from plait.distributed.launch import under_torchrun

    if under_torchrun() or not sys.stderr.isatty() or processes < 1:  # < 1: a layout not yet valid, said later
        return
    typer.echo(f"plait {command}: starting {counted(processes, 'process')} ({layout}) ...", err=True)


def loading(command: str, folder: str, size: int, what: str = "the weights of") -> None:
    """Say on standard error, when a person is watching it (as ``starting``), that ``plait command`` reads
    ``size`` bytes (``what``) from ``folder``: after the checks, before the launch, for a large model the
    longest silence of its start."""
    from plait.distributed.launch import under_torchrun

    if under_torchrun() or not sys.stderr.isatty():
        return
    typer.echo(f"plait {command}: reading {what} {folder} ({size / 1e6:,.0f} MB) ...", err=True)


def layout_words(p: ParallelConfig) -> str:
    """A ParallelConfig's mesh in words: ``tp 2 x pp 2 x dp 1``, with ``x cp 2`` where there is context
    parallelism; a dp of -1 (inferred) as ``dp to fill --nproc``."""
    return mesh(p.tp, p.pp, p.dp if p.dp > 0 else "to fill --nproc", p.cp)
