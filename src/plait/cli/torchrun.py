"""How a command run by torchrun (each worker runs the command) ends when its rank loses a peer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import typer


@contextlib.contextmanager
def lost_peer_in_one_line() -> Iterator[None]:
    """A rank whose peer died or went silent (``plait.CommError``: what it waited on, over or from which ranks) ends
    with that message on one line, ``error: rank 0: CommError: ...``, exit code 1, as under plait's own launcher,
    not a traceback that buries it; torchrun then restarts the group (--max-restarts) or stops it. Only a process
    that runs ranks itself (under torchrun) raises one here. ``PLAIT_DEBUG=1`` keeps the traceback. The process's
    end then skips the interpreter's collection of the run's objects (``skip_collection_at_exit``): torchrun ends
    the job once every worker has."""
    from plait.errors import CommError

    try:
        yield
    except CommError as exc:
        if os.environ.get("PLAIT_DEBUG"):
            raise
        typer.echo(f"error: rank {os.environ.get('RANK', '0')}: {type(exc).__name__}: {exc}", err=True)
        from plait.distributed.at_exit import skip_collection_at_exit

        skip_collection_at_exit()
        raise typer.Exit(1) from None
