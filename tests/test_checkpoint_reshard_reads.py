"""A checkpoint loaded under another layout is read about once in all, not once per tensor-parallel rank: each rank
reads the checksum blocks its slices touch and checks them, so a damaged slice is still refused by the rank that
reads it, naming the file and the tensor, and the ranks that read only undamaged blocks load. One process: a tp1
checkpoint saved here, read as the ranks of a tp4 (and tp2) load read it (``load_local``'s regions)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors
import torch

import plait
from plait.checkpoint import CheckpointReader, local_tensors, save_checkpoint
from plait.checkpoint.checksums import BLOCK_KEY, KEY, tensor_crc
from plait.errors import ConfigError
from plait.models import Llama, LlamaConfig
from test_checkpoint_checksums import copy_of, flip_bytes

FILE = "pp0-tp0-dp0.safetensors"


@pytest.fixture(scope="module")
def tp1(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict[str, int | None]]:
    """A tp1 checkpoint of a seeded tiny Llama, its tensors, and the dim tensor parallelism splits each along."""
    torch.manual_seed(0)
    with plait.init(1, 1, 1) as ctx:
        pm = plait.parallelize(Llama(LlamaConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4)), ctx)
        path = save_checkpoint(pm, None, tmp_path_factory.mktemp("reshard"), step=1)
        state = {lt.key: lt.tensor.detach().clone() for lt in local_tensors(pm)}
        split = {lt.key: lt.split for lt in local_tensors(pm)}
    assert set(split.values()) == {None, 0, 1}, split  # replicated, column- and row-parallel tensors
    return path, state, split


class Counted:
    """A safetensors handle that adds the bytes of every tensor and slice it hands back to ``count``."""

    def __init__(self, handle, count: list[int]):
        self.handle, self.count = handle, count

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._counted(self.handle.get_tensor(name))

    def get_slice(self, name: str):
        part, counted = self.handle.get_slice(name), self._counted

        class Slice:
            def __getitem__(self, index) -> torch.Tensor:
                return counted(part[index])

            def get_shape(self) -> list[int]:
                return part.get_shape()

        return Slice()

    def _counted(self, t: torch.Tensor) -> torch.Tensor:
        self.count[0] += t.numel() * t.element_size()
        return t


def region(shape: list[int], dim: int, tp: int, rank: int) -> tuple[int, int]:
    """The indices along ``dim`` that rank ``rank`` of tp ``tp`` holds (as plait.checkpoint.shards lays them out)."""
    n = math.ceil(shape[dim] / tp)
    start = min(rank * n, shape[dim])
    return start, min(start + n, shape[dim])


def load_as(path: Path, split: dict, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of a tp ``tp`` load reads: its slice of each split tensor, the others whole."""
    reader, out = CheckpointReader(path), {}
    for key in split:
        dim = split[key]
        if dim is None:
            out[key] = reader.read(key)
        else:
            start, stop = region(reader.meta["tensors"][key]["shape"], dim, tp, rank)
            out[key] = reader.read(key, dim, start, stop)
    return out


def sliced(state: dict[str, torch.Tensor], split: dict, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What ``load_as`` should give: ``state`` cut as rank ``rank`` of tp ``tp`` holds it."""
    out = {}
    for key, t in state.items():
        start, stop = region(list(t.shape), split[key], tp, rank) if split[key] is not None else (0, 0)
        out[key] = t if split[key] is None else t.narrow(split[key], start, stop - start)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_a_resharded_load_reads_the_checkpoint_about_once_in_all(tp1, tp, monkeypatch):
    path, state, split = tp1
    count = [0]
    opened = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: Counted(opened(*a, **k), count))
    size = sum(t.numel() * t.element_size() for t in state.values())
    replicated = sum(t.numel() * t.element_size() for k, t in state.items() if split[k] is None)
    for rank in range(tp):
        want = sliced(state, split, tp, rank)
        assert all(torch.equal(t, want[k]) for k, t in load_as(path, split, tp, rank).items()), rank
    # each rank: its slices plus at most a block each side, and the tensors every rank holds whole
    assert count[0] <= size * 1.1 + (tp - 1) * replicated, (count[0], size, tp)


def refusals(ckpt: Path, split: dict, tp: int) -> dict[int, str]:
    """The ConfigError of each rank of a tp ``tp`` load that refuses ``ckpt``."""
    refused = {}
    for rank in range(tp):
        try:
            load_as(ckpt, split, tp, rank)
        except ConfigError as exc:
            refused[rank] = str(exc)
    return refused


def test_a_damaged_slice_is_refused_by_the_rank_that_reads_it_and_by_no_other(tp1, tmp_path):
    path, state, split = tp1
    ckpt = copy_of(path, tmp_path)
    # 64 x 64, in blocks of 2 rows (columns): the middle byte starts the third quarter's rows (column), is in the
    # first quarter's columns (row)
    column = "layers.1.self_attn.q_proj.weight"  # split along dim 0
    row = "layers.0.self_attn.o_proj.weight"  # split along dim 1
    assert (split[column], split[row]) == (0, 1)
    for name in (column, row):
        flip_bytes(ckpt / FILE, name)
    said = f"{ckpt}: {FILE}: tensor '{{}}' does not match its checksum in meta.json (crc32 "
    refused = refusals(ckpt, {k: split[k] for k in split if k != row}, 4)
    assert list(refused) == [2] and refused[2].startswith(said.format(column)), refused
    assert "; indices 32..34 along dim 0)" in refused[2], refused[2]
    refused = refusals(ckpt, {row: 1}, 4)
    assert list(refused) == [0] and refused[0].startswith(said.format(row)), refused
    with pytest.raises(ConfigError, match="does not match its checksum"):
        CheckpointReader(ckpt).read(column)  # one process reading all of it


def test_a_checkpoint_with_one_checksum_a_tensor_is_still_checked(tp1, tmp_path):
    """Checkpoints saved before the blocks record the checksum of each tensor whole: read and checked whole."""
    path, state, split = tp1
    ckpt = copy_of(path, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    for key, entry in meta["tensors"].items():
        for shard in entry["shards"]:
            del shard[BLOCK_KEY]
            shard[KEY] = tensor_crc(state[key])
    (ckpt / "meta.json").write_text(json.dumps(meta))
    want = sliced(state, split, 4, 3)
    assert all(torch.equal(t, want[k]) for k, t in load_as(ckpt, split, 4, 3).items())
    name = "layers.1.self_attn.q_proj.weight"
    flip_bytes(ckpt / FILE, name)
    with pytest.raises(ConfigError, match=f"{FILE}: tensor '{name}' does not match its checksum"):
        load_as(ckpt, split, 4, 0)  # rows 0..n/4 are whole, but the tensor is checked whole
