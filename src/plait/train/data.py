"""Training text: the Python standard library's sources (on every machine) or given files, as token ids.

Files are read in sorted order; every tenth file is held out for evaluation. Batch ``step`` is drawn
from a generator seeded with (seed, step), so the data position of a run is just its step number and a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from plait.errors import ConfigError
from plait.tokenizers import ByteTokenizer

HOLDOUT_EVERY = 10  # file i goes to the held-out split when i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1


@dataclass
class Corpus:
    """Token ids of the training and held-out text, and where they came from."""

    train: torch.Tensor  # [N] uint8 (bytes) or int64
    held_out: torch.Tensor  # [M]
    files: int
    source: str


def default_paths() -> list[Path]:
    """The standard library's ``.py`` files (site-packages excluded), sorted by relative path."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel = os.path.relpath(folder, root)
        found += [os.path.normpath(os.path.join(rel, n)) for n in names if n.endswith(".py")]
    return [Path(root, r) for r in sorted(r.replace(os.sep, "/") for r in found)]


def expand(paths: list[str]) -> list[Path]:
    """Files named directly, and every file under named folders (sorted); missing paths raise ConfigError."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out += sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"--data {raw}: no such file or directory")
    return out


def load_corpus(paths: list[str], tokenizer, max_mb: float = 4.0) -> Corpus:
    """Read files in order until ``max_mb`` of text; split train / held-out by file index."""
    files = expand(paths) if paths else default_paths()
    source = ", ".join(paths) if paths else f"Python {sysconfig.get_python_version()} standard library"
    budget = int(max_mb * 1e6)
    parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    used = size = 0
    for i, f in enumerate(files):
        raw = f.read_bytes()
        if not raw or b"\0" in raw[:1024]:
            continue  # binary
        ids = _encode(tokenizer, raw)
        parts[int(i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1)].append(ids)
        used, size = used + 1, size + ids.numel()
        if size >= budget:
            break
    train = torch.cat(parts[0]) if parts[0] else torch.zeros(0, dtype=torch.uint8)
    if train.numel() < 2:
        raise ConfigError(f"--data {source}: not enough text to train on ({train.numel()} tokens)")
    held = torch.cat(parts[1]) if parts[1] else train[-(train.numel() // 10):]
    return Corpus(train, held, used, source)


def _encode(tokenizer, raw: bytes) -> torch.Tensor:
    """Token ids [n] of one file: uint8 for bytes (taken as they are), int64 otherwise."""
    if isinstance(tokenizer, ByteTokenizer):
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # ids < 256: one byte each
    return torch.tensor(tokenizer.encode(raw.decode("utf-8", errors="replace")), dtype=torch.long)


def batch(ids: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int,
          part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``part = (index, count)`` of global batch ``step``: inputs and next-token targets [B/count, S]."""
    if ids.numel() <= seq_len + 1:
        raise ConfigError(f"--seq-len {seq_len}: the text has only {ids.numel()} tokens")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, ids.numel() - seq_len - 1, (batch_size,), generator=g)
    index, count = part
    rows = batch_size // count
    starts = starts[index * rows:(index + 1) * rows]
    window = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # [B, S+1]
    tokens = ids[window].long()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
