"""Durable writes: flushing a file, or a folder's names after a rename into it, to disk before going on."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush ``path`` to disk: a file's data, or a folder's entries (a rename into it, a file made in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
