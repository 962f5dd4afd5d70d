"""Checksums of a checkpoint's tensors: damage to a shard file after it was written is an error, not wrong weights.

A save takes CRC-32s of every tensor it writes from the host copy it writes (no re-reading of the file), one per
block: the tensor cut into at most ``BLOCKS`` equal runs of indices along its *split dim* (the dim tensor
parallelism cuts it along, whatever the layout of the save; dim 0 for a tensor no layout cuts), so that a reader
of a slice along that dim checks the blocks it reads and no others. The save keeps them in the file's safetensors
header (``__metadata__[HEADER]``, a JSON object whose ``BLOCK_KEY`` maps each tensor's name to its blocks); rank 0
copies them into each shard record of ``meta.json`` (``"crc32_blocks"``: ``{"dim", "size", "crc32"}``, the last
the blocks' checksums written one after the other, 8 hex digits each) when it commits the checkpoint. A reader
(plait.checkpoint.store.CheckpointReader, which resume, generate, serve and export all read through) checks every
block a read touches against its record before it hands back any of it. A shard record with one checksum of the
whole tensor (``"crc32"``, as plait saved before the blocks) is checked whole on its first read; one without
either (an older plait's) is read unchecked.
"""

from __future__ import annotations

import json
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from plait.errors import ConfigError

KEY = "crc32"  # a shard record's checksum of its whole tensor in meta.json (the checkpoints saved before the blocks)
BLOCK_KEY = "crc32_blocks"  # a shard record's block checksums in meta.json, and their key in a file's header entry
#: the most blocks a tensor's part in one file is cut into: slices of a 2**k-way split (k <= 5) of it are whole blocks
BLOCKS = 32
#: a shard file's one entry of header metadata (JSON): one only, as safetensors writes the entries of its metadata
#: in no fixed order and two saves of the same state must give the same bytes
HEADER = "plait"
#: the fewest bytes of blocks that get a thread of their own (``block_crcs``): zlib's CRC-32 lets go of the GIL, so
#: the blocks of a large tensor are summed on several threads at once, each with milliseconds of work to pay for
#: starting it
THREAD_BYTES = 4 << 20


def tensor_crc(tensor: torch.Tensor) -> str:
    """The CRC-32 of ``tensor``'s bytes as a safetensors file holds them (row-major, little-endian), 8 hex digits."""
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    return f"{zlib.crc32(data.cpu().numpy().data):08x}"


def block_size(length: int) -> int:
    """The indices along its split dim of each block of a tensor part ``length`` long there (the last may be short)."""
    return max(1, math.ceil(length / BLOCKS))


def block_crcs(blocks: list[torch.Tensor], threads: int | None = None) -> list[str]:
    """``tensor_crc`` of each of ``blocks``, in order, on up to ``threads`` threads (None: torch's intra-op thread
    count), one more for each ``THREAD_BYTES`` the blocks hold."""
    nbytes = sum(block.numel() * block.element_size() for block in blocks)
    workers = min(torch.get_num_threads() if threads is None else threads, len(blocks), nbytes // THREAD_BYTES)
    if workers <= 1:
        return [tensor_crc(block) for block in blocks]
    with ThreadPoolExecutor(workers, thread_name_prefix="plait-crc32") as pool:
        return list(pool.map(tensor_crc, blocks))


def block_checksums(tensor: torch.Tensor, dim: int, threads: int | None = None) -> dict:
    """The block record of ``tensor`` cut along ``dim``: ``{"dim", "size", "crc32"}`` (a 0-dim tensor: one block);
    ``threads``: ``block_crcs``'."""
    flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
    size = block_size(flat.shape[dim])
    return {"dim": dim, "size": size, KEY: "".join(block_crcs(_blocks(flat, dim, size), threads))}


def _blocks(tensor: torch.Tensor, dim: int, size: int) -> list[torch.Tensor]:
    """``tensor`` cut along ``dim`` into runs of ``size`` indices (the last may be short), each contiguous: the whole
    blocks through one copy (a block along a later dim is not contiguous in the tensor), not one a block."""
    length, whole = tensor.shape[dim], tensor.shape[dim] // size * size
    before, after = math.prod(tensor.shape[:dim]), math.prod(tensor.shape[dim + 1:])
    out = []
    if whole:
        head = tensor.narrow(dim, 0, whole).reshape(before, whole // size, size, after)
        out += list(head.transpose(0, 1).contiguous())  # block b: its indices' elements in row-major order
    if whole < length:
        out.append(tensor.narrow(dim, whole, length - whole))
    return out


def tensor_checksums(tensors: dict[str, torch.Tensor], split: dict[str, int | None],
                     threads: int | None = None) -> dict[str, dict]:
    """Each tensor's block record, cut along its ``split`` dim (None: dim 0); ``threads``: ``block_crcs``'."""
    return {name: block_checksums(t, split.get(name) or 0, threads) for name, t in tensors.items()}


def file_header(tensors: dict[str, torch.Tensor], split: dict[str, int | None], fmt: str,
                threads: int | None = None) -> dict[str, str]:
    """The header metadata of a shard file of checkpoint format ``fmt`` holding ``tensors`` (``split``: the dim
    each is cut along into checksum blocks): each one's block checksums (``threads``: ``block_crcs``')."""
    blocks = tensor_checksums(tensors, split, threads)
    return {HEADER: json.dumps({"format": fmt, BLOCK_KEY: blocks}, separators=(",", ":"))}


def record_checksums(meta: dict, folder: Path) -> None:
    """Rank 0, before writing ``meta.json``: every shard record of ``meta`` gets the block checksums that its file's
    writer kept in the file's header (a file without them leaves its records without)."""
    from safetensors import safe_open

    kept: dict[str, dict[str, dict]] = {}
    for name, entry in meta["tensors"].items():
        for shard in entry["shards"]:
            file = shard["file"]
            if file not in kept:
                with safe_open(str(folder / file), framework="pt") as handle:
                    kept[file] = json.loads((handle.metadata() or {}).get(HEADER, "{}")).get(BLOCK_KEY, {})
            if name in kept[file]:
                shard[BLOCK_KEY] = kept[file][name]


def check_tensor(checkpoint: Path, file: str, name: str, tensor: torch.Tensor, shard: dict) -> None:
    """ConfigError naming the file and the tensor when ``tensor``, all of ``name`` that ``file`` holds, does not
    match the whole-tensor checksum of its shard record (none recorded: nothing to check)."""
    want = shard.get(KEY)
    if want is not None:
        _compare(checkpoint, file, name, tensor_crc(tensor), want, "")


def check_blocks(checkpoint: Path, file: str, name: str, span: torch.Tensor, first: int, blocks: dict) -> None:
    """ConfigError naming the file, the tensor and the block when a block of ``span`` does not match its record in
    ``blocks`` (the shard record's block checksums): ``span`` is the blocks from ``first`` on, whole, along
    ``blocks["dim"]``, of the part of ``name`` that ``file`` holds."""
    dim, size, crcs = blocks["dim"], blocks["size"], blocks[KEY]
    flat = span.reshape(1) if span.dim() == 0 else span
    end = first * size + flat.shape[dim]  # the index along ``dim`` where ``span`` ends
    for at, got in enumerate(block_crcs(_blocks(flat, dim, size)), start=first):
        want = crcs[8 * at:8 * at + 8]
        if got != want:
            where = f"; indices {at * size}..{min(at * size + size, end)} along dim {dim}"
            _compare(checkpoint, file, name, got, want, where)


def _compare(checkpoint: Path, file: str, name: str, got: str, want: str, where: str) -> None:
    if got != want:
        raise ConfigError(f"{checkpoint}: {file}: tensor {name!r} does not match its checksum in meta.json (crc32 "
                          f"{got}, saved as {want}{where}): the file was damaged after it was written; restore it "
                          "from a copy, or use an older checkpoint")
