"""Checksums of a checkpoint's tensors: damage to a shard file after it was written is an error, not wrong weights.

A save takes the CRC-32 of every tensor it writes from the host copy it writes (no re-reading of the file) and
keeps them in the file's safetensors header (``__metadata__[HEADER]``, a JSON object whose KEY maps each tensor's
name to its checksum); rank 0 copies them into each shard record of ``meta.json`` (``"crc32"``) when it commits
the checkpoint. A reader (plait.checkpoint.store.CheckpointReader, which resume, generate, serve and export all
read through) checks a tensor of a file against its record the first time it reads it. A shard record without a
checksum (a checkpoint an older plait saved) is read unchecked.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from plait.errors import ConfigError

KEY = "crc32"  # a shard record's checksum in meta.json, and the checksums' key in a file's header entry
#: a shard file's one entry of header metadata (JSON): one only, as safetensors writes the entries of its metadata
#: in no fixed order and two saves of the same state must give the same bytes
HEADER = "plait"


def tensor_crc(tensor: torch.Tensor) -> str:
    """The CRC-32 of ``tensor``'s bytes as a safetensors file holds them (row-major, little-endian), 8 hex digits."""
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    return f"{zlib.crc32(data.cpu().numpy().data):08x}"


def file_header(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, str]:
    """The header metadata of a shard file of checkpoint format ``fmt`` holding ``tensors``: each one's checksum."""
    return {HEADER: json.dumps({"format": fmt, KEY: tensor_checksums(tensors)}, separators=(",", ":"))}


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_crc(t) for name, t in tensors.items()}


def record_checksums(meta: dict, folder: Path) -> None:
    """Rank 0, before writing ``meta.json``: every shard record of ``meta`` gets the checksum that its file's writer
    kept in the file's header (a file without them leaves its records without)."""
    from safetensors import safe_open

    kept: dict[str, dict[str, str]] = {}
    for name, entry in meta["tensors"].items():
        for shard in entry["shards"]:
            file = shard["file"]
            if file not in kept:
                with safe_open(str(folder / file), framework="pt") as handle:
                    kept[file] = json.loads((handle.metadata() or {}).get(HEADER, "{}")).get(KEY, {})
            if name in kept[file]:
                shard[KEY] = kept[file][name]


def check_tensor(checkpoint: Path, file: str, name: str, tensor: torch.Tensor, shard: dict) -> None:
    """ConfigError naming the file and the tensor when ``tensor``, all of ``name`` that ``file`` holds, does not
    match the checksum of its shard record (none recorded: nothing to check)."""
    want = shard.get(KEY)
    if want is None:
        return
    got = tensor_crc(tensor)
    if got != want:
        raise ConfigError(f"{checkpoint}: {file}: tensor {name!r} does not match its checksum in meta.json (crc32 "
                          f"{got}, saved as {want}): the file was damaged after it was written; restore it from a "
                          "copy, or use an older checkpoint")
