"""plait.files.fsync_path: the one helper that flushes a file, or a folder's entries, to disk."""

from __future__ import annotations

import os

import pytest

from plait.files import fsync_path


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_fsync_path_flushes_that_path_and_closes_what_it_opened(tmp_path, monkeypatch, kind):
    path = tmp_path / "x"
    if kind == "file":
        path.write_bytes(b"abc")
    else:
        path.mkdir()
    synced: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append((fd, os.fstat(fd).st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fsync_path(path)
    assert [ino for _, ino in synced] == [path.stat().st_ino]
    with pytest.raises(OSError):
        os.fstat(synced[0][0])  # closed again
