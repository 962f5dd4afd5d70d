"""A checkpoint's block checksums summed on several threads (plait.checkpoint.checksums.block_crcs) are the CRC-32s
the one-thread path gives, block for block, and a damaged block is still the one named."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch

from plait.checkpoint import checksums
from plait.errors import ConfigError


@pytest.fixture
def small_threshold(monkeypatch):
    """Every 1 KiB of blocks gets a thread of its own: small tensors take the threaded path."""
    monkeypatch.setattr(checksums, "THREAD_BYTES", 1024)


def reference(tensor: torch.Tensor, dim: int) -> str:
    """The block record's checksums computed the plain way: numpy slices of each block, zlib over their bytes."""
    array = tensor.numpy()
    size = checksums.block_size(array.shape[dim])
    crcs = []
    for lo in range(0, array.shape[dim], size):
        block = np.take(array, range(lo, min(lo + size, array.shape[dim])), axis=dim)
        crcs.append(f"{zlib.crc32(np.ascontiguousarray(block).tobytes()):08x}")
    return "".join(crcs)


@pytest.mark.parametrize(("shape", "dim"), [((100, 37), 0), ((37, 100), 1), ((6, 70, 5), 1), ((4096,), 0)])
def test_threaded_block_checksums_equal_the_one_thread_ones(small_threshold, shape, dim):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    one = checksums.block_checksums(tensor, dim, threads=1)
    many = checksums.block_checksums(tensor, dim, threads=4)
    assert many == one
    assert many["crc32"] == reference(tensor, dim)
    header = checksums.file_header({"w": tensor}, {"w": dim}, "fmt", threads=4)
    assert header == checksums.file_header({"w": tensor}, {"w": dim}, "fmt", threads=1)


def test_the_blocks_are_summed_on_as_many_threads_as_asked(small_threshold, monkeypatch):
    """Each thread's first block waits (at most 10 s) until a second thread is summing: one thread alone fails."""
    seen: set[int] = set()
    both = threading.Event()
    lock = threading.Lock()
    crc = checksums.tensor_crc

    def counted(block: torch.Tensor) -> str:
        with lock:
            first = threading.get_ident() not in seen
            seen.add(threading.get_ident())
            if len(seen) >= 2:
                both.set()
        if first:
            both.wait(timeout=10)
        return crc(block)

    monkeypatch.setattr(checksums, "tensor_crc", counted)
    tensor = torch.randn(64, 64)
    assert checksums.block_checksums(tensor, 0, threads=2) == {"dim": 0, "size": 2, "crc32": reference(tensor, 0)}
    assert len(seen) == 2


def test_a_damaged_block_is_named_when_checked_on_threads(small_threshold, tmp_path):
    tensor = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    blocks = checksums.block_checksums(tensor, 1, threads=1)  # 32 blocks of 3 columns
    damaged = tensor.clone()
    damaged[10, 50] += 1.0  # column 50: block 16 (columns 48..51)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        checksums.check_blocks(tmp_path, "f.safetensors", "w", tensor, 0, blocks)  # intact: no error
        with pytest.raises(ConfigError, match=r"'w' .*indices 48\.\.51 along dim 1"):
            checksums.check_blocks(tmp_path, "f.safetensors", "w", damaged, 0, blocks)
    finally:
        torch.set_num_threads(threads)
