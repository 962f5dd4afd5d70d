"""The prepared-dataset format on disk, and reading it (shards with ``pread``, the document index memory-mapped).

A prepared dataset is a folder::

    meta.json                 format, tokenizer (fingerprint, vocabulary, EOS), dtype, splits, sources
    train/00000.bin ...       token ids, raw little-endian uint16 (vocabulary <= 65,536) or uint32; each
                              document's tokens followed by one EOS; the split's stream is its shards in order
    train/docs.npy            int64 [documents + 1]: where each document starts in the split's stream
    train/00000.mask ...      (chat datasets) uint8 beside each shard, one per token: 1 where the token is in
                              the loss (the assistant's tokens), 0 where training ignores it as a target
    held_out/...              the same for the held-out documents

``plait-tokens/2`` added the masks (a shard names its ``mask`` file); ``plait-tokens/1`` datasets, without
them, read the same: every token in the loss. ``plait-tokens/3`` puts a token in the loss when any of its
characters is (``plait.data.tokens``); ``/2`` masked only those whose first character was, so a ``/2`` chat
dataset is refused (prepared again, it gets the masks of ``/3``), while ``/2`` text, without masks, reads as before.

``meta.json`` is written last and the folder is renamed into place only when complete (plait.data.prepare),
so a folder with a ``meta.json`` of this format is a whole dataset; ``open_prepared`` still checks that every
shard has the size the metadata gives.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from plait.errors import ConfigError

FORMAT = "plait-tokens/3"
READABLE = ("plait-tokens/1", "plait-tokens/2", FORMAT)
FIRST_CHARACTER_MASKS = "plait-tokens/2"  # chat datasets of this format: a token's mask is its first character's
META = "meta.json"
SPLITS = ("train", "held_out")


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a prepared dataset's ``meta.json``."""
    return (Path(path) / META).is_file()


class TokenSplit(Protocol):
    """A split's packed token stream: its length, its documents, and reading a range of it."""

    tokens: int
    documents: int
    masked: bool  # whether read_mask says which tokens are in the loss (else all are)

    def read(self, start: int, length: int) -> np.ndarray: ...

    def read_mask(self, start: int, length: int) -> np.ndarray: ...

    def first_document_end(self) -> int | None:
        """Where the first document ends in the stream (after its EOS), from the split's document index; None
        without one."""
        ...


class Split:
    """One split's token stream (its shard files, read with ``pread`` when asked: no file is opened or mapped
    between reads, so a dataset of any number of shards costs no descriptors and no memory maps) and document
    index."""

    def __init__(self, root: Path, name: str, info: dict, dtype: str):
        self.name, self.dtype = name, np.dtype(dtype)
        self.files: list[Path] = []
        self.masks: list[Path] = []
        self.masked = bool(info["shards"]) and all("mask" in s for s in info["shards"])
        for s in info["shards"]:
            self.files.append(_checked(root, s["file"], s["tokens"] * self.dtype.itemsize))
            if self.masked:
                self.masks.append(_checked(root, s["mask"], s["tokens"]))
        sizes = np.asarray([s["tokens"] for s in info["shards"]], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # [shards + 1]
        self.tokens = int(self.starts[-1])
        self.documents = int(info["documents"])
        docs = root / name / "docs.npy"
        self.docs = np.load(docs, mmap_mode="r") if docs.is_file() else np.zeros(1, dtype=np.int64)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream (may span shards).

        Read with ``pread``, not through memory maps: a mapped page counts in the process's resident size in
        units of the page cache's folios (about 0.8 MB per random window on Linux 6 with large folios), so a
        run reading windows through the maps would look as large as the part of the corpus it has visited."""
        return self._pread(self.files, self.dtype, start, length)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """The loss mask of tokens ``[start, start + length)`` (uint8, 1: in the loss); all ones without masks."""
        if not self.masked:
            return np.ones(length, dtype=np.uint8)
        return self._pread(self.masks, np.dtype(np.uint8), start, length)

    def _pread(self, files: list[Path], dtype: np.dtype, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > self.tokens:
            raise IndexError(f"{self.name}: tokens [{start}, {start + length}) outside [0, {self.tokens})")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        size = dtype.itemsize
        parts, pos, left = [], start, length
        while left > 0:
            off = pos - int(self.starts[i])
            take = min(left, int(self.starts[i + 1]) - pos)
            fd = os.open(files[i], os.O_RDONLY)
            try:
                parts.append(np.frombuffer(os.pread(fd, take * size, off * size), dtype=dtype))
            finally:
                os.close(fd)
            pos, left, i = pos + take, left - take, i + 1
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def first_document_end(self) -> int | None:
        """Where the first document ends (docs.npy's second entry); None for a dataset prepared without an index
        or with no document."""
        return int(self.docs[1]) if len(self.docs) > 1 else None

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens, its EOS included."""
        start, stop = int(self.docs[i]), int(self.docs[i + 1])
        return self.read(start, stop - start)


def _checked(root: Path, name: str, want: int) -> Path:
    """``root / name``, ConfigError unless it is a file of ``want`` bytes."""
    path = root / name
    if not path.is_file() or path.stat().st_size != want:
        got = path.stat().st_size if path.is_file() else "missing"
        raise ConfigError(f"{root}: shard {name} is {got} bytes, meta.json says {want}: the dataset is damaged; "
                          "prepare it again")
    return path


@dataclass
class Prepared:
    """An opened prepared dataset: its metadata and both splits."""

    path: Path
    meta: dict
    train: Split
    held_out: Split

    @property
    def tokenizer(self) -> dict:
        """``{"kind", "fingerprint", "vocab_size", "eos", "name"}`` of the tokenizer it was prepared with."""
        return self.meta["tokenizer"]


def open_prepared(path: str | Path) -> Prepared:
    """Open a prepared dataset folder (ConfigError if it is none, or is incomplete or damaged)."""
    root = Path(path)
    meta_path = root / META
    if not meta_path.is_file():
        raise ConfigError(f"{root}: not a prepared dataset (no {META}); make one with "
                          f"`plait data prepare SRC... --tokenizer DIR|bytes --out {root}`")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{meta_path}: not valid JSON ({exc}); prepare the dataset again") from None
    if meta.get("format") not in READABLE:
        raise ConfigError(f"{meta_path}: format {meta.get('format')!r}, this plait reads {', '.join(READABLE)}")
    if meta["format"] == FIRST_CHARACTER_MASKS and meta.get("chat") is not None:
        raise ConfigError(f"{root}: a chat dataset of format {FIRST_CHARACTER_MASKS}, whose loss masks hold a token "
                          "only when its first character is the assistant's; this plait puts a token in the loss "
                          f"when any of its characters is (format {FORMAT}): prepare it again with `plait data "
                          f"prepare SRC... --chat --out {root} --force` (the same tokenizer and chat options)")
    train, held = (Split(root, name, meta["splits"][name], meta["dtype"]) for name in SPLITS)
    return Prepared(root, meta, train, held)


def write_meta(root: Path, meta: dict) -> None:
    """``meta.json`` (sorted keys, flushed to disk): the last file a prepare writes."""
    path = root / META
    with open(path, "w") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
