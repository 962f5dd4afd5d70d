"""A task's token shards as ``plait data prepare`` writes them: each document's ids (and loss mask) appended as
it is encoded, converted to the stored dtype a piece at a time and hashed on the way, so no task's ids are held
whole; a file is created at its first write and flushed to disk when the task ends."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

PIECE = 1 << 20  # ids converted to the stored dtype and written at a time


@dataclass(frozen=True)
class Written:
    """A finished shard file: its name in the dataset folder, size and BLAKE2b (16-byte) hex digest."""

    file: str
    bytes: int
    blake2b: str


class ShardFile:
    """One file of a task, created at its first ``write``."""

    def __init__(self, root: Path, name: str, dtype: str):
        self.root, self.name, self.dtype = root, name, np.dtype(dtype)
        self.f: BinaryIO | None = None
        self.size = 0
        self.hash = hashlib.blake2b(digest_size=16)

    def write(self, array: np.ndarray) -> None:
        if self.f is None:
            self.f = open(self.root / self.name, "wb")  # noqa: SIM115 (closed by close())
        for a in range(0, len(array), PIECE):
            piece = np.ascontiguousarray(array[a:a + PIECE]).astype(self.dtype, casting="same_kind", copy=False)
            data = piece.data.cast("B")
            self.hash.update(data)
            self.f.write(data)
            self.size += piece.nbytes

    def close(self) -> Written | None:
        """Flushed to disk and closed: what was written (None when nothing was)."""
        if self.f is None:
            return None
        with self.f:
            self.f.flush()
            os.fsync(self.f.fileno())
        return Written(self.name, self.size, self.hash.hexdigest())

    def abandon(self) -> None:
        if self.f is not None:
            self.f.close()


class ShardSink:
    """A split's part of a task: its ids file (``split/NNNNNN.bin``), with ``masked`` its loss mask beside
    (``.mask``), the length of each document and the tokens in the loss."""

    def __init__(self, root: Path, split: str, index: int, dtype: str, eos: int, masked: bool):
        self.ids = ShardFile(root, f"{split}/{index:06d}.bin", dtype)
        self.mask = ShardFile(root, f"{split}/{index:06d}.mask", "uint8") if masked else None
        self.end = np.asarray([eos], dtype=dtype)
        self.lengths: list[int] = []
        self.loss = 0

    def document(self, ids: np.ndarray, mask: np.ndarray | None) -> None:
        """One document's ids (the EOS appended here) and, when masked, its mask (the EOS's entry included)."""
        self.ids.write(ids)
        self.ids.write(self.end)
        self.lengths.append(len(ids) + 1)
        if mask is not None and self.mask is not None:
            self.mask.write(mask)
            self.loss += int(np.count_nonzero(mask))
        else:
            self.loss += len(ids) + 1

    def close(self) -> list[Written]:
        return [w for w in (self.ids.close(), self.mask.close() if self.mask is not None else None) if w]

    def abandon(self) -> None:
        self.ids.abandon()
        if self.mask is not None:
            self.mask.abandon()


def file_digest(path: Path) -> bytes:
    """The BLAKE2b (16-byte) digest of a file's bytes, read 1 MB at a time."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()
