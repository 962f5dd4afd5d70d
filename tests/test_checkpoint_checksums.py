"""A checkpoint records a checksum of every tensor it saves; bytes changed in a shard file's data afterwards make
every reader (train --resume, generate, serve, export, a load under another layout) refuse it in one line naming
the file and the tensor, never load wrong weights. A checkpoint whose meta.json holds no checksums (an older
plait's) loads unchecked."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plait.checkpoint import CheckpointReader
from plait.cli.main import app
from plait.errors import ConfigError

STEP = "step_00000001"
TRAIN = ["--tp", "2", "--pp", "1", "--seq-len", "16", "--batch-size", "2", "--microbatches", "1", "--eval-every", "0",
         "--sample-tokens", "0"]
DAMAGED = ("pp0-tp1-dp0.safetensors", "layers.1.self_attn.q_proj.weight")  # a TP shard: rows 64..127 of 128


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """ckpt/: one step of the tiny preset trained under tp 2 (two shard files, AdamW state)."""
    tmp_path = tmp_path_factory.mktemp("checksums")
    res = subprocess.run([sys.executable, "-m", "plait.cli.main", "train", *TRAIN, "--steps", "1", "--cluster", "none",
                          "--checkpoint-dir", "ckpt"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    return tmp_path / "ckpt"


def copy_of(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def flip_bytes(file: Path, name: str) -> None:
    """Change 4 bytes in the middle of tensor ``name``'s data (the header, and so the file's layout, unchanged)."""
    raw = bytearray(file.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    start, stop = json.loads(raw[8:8 + size])[name]["data_offsets"]
    at = 8 + size + (start + stop) // 2
    raw[at:at + 4] = bytes(b ^ 0x5A for b in raw[at:at + 4])
    file.write_bytes(raw)


def test_every_shard_record_has_the_checksum_of_its_file_s_bytes(saved):
    meta = json.loads((saved / STEP / "meta.json").read_text())
    shards = [s for entry in meta["tensors"].values() for s in entry["shards"]]
    assert {s["file"] for s in shards} == {"pp0-tp0-dp0.safetensors", "pp0-tp1-dp0.safetensors"}
    assert all(s["crc32_blocks"]["crc32"] and len(s["crc32_blocks"]["crc32"]) % 8 == 0 for s in shards), shards
    CheckpointReader(saved / STEP).check_files()  # every tensor read whole and checked: none differs


def test_a_resume_dry_run_says_what_the_checkpoint_holds(saved, tmp_path, monkeypatch):
    """--resume --dry-run checked the checkpoint and printed the prediction, nothing of the checkpoint: not its step,
    nor the layout it was saved under, nor how far its run had read."""
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", *TRAIN, "--steps", "2", "--checkpoint-dir", str(saved), "--resume",
                                   "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"would resume {saved / STEP} (step 1): saved under tp 2 x pp 1 x dp 1, 32 tokens seen (epoch " in \
        " ".join(res.output.split()), res.output
    assert "every tensor read and matched to its checksum" in " ".join(res.output.split()), res.output
    assert "resharded" not in res.output and "note:" not in res.output, res.output  # nothing changed


def test_a_resume_dry_run_says_what_the_run_would_say_as_it_resumed(saved, tmp_path, monkeypatch):
    """--auto-resume --dry-run says the newer folder it passes over, the layout it would reshard to and the settings
    changed since the checkpoint, as the run's first lines would; with no checkpoint, that it would start fresh."""
    ckpt = copy_of(saved, tmp_path)
    (ckpt / "step_00000002").mkdir()  # a save that did not finish
    monkeypatch.chdir(tmp_path)
    flags = [*TRAIN, "--tp", "1", "--seq-len", "32", "--steps", "3", "--auto-resume", "--dry-run"]
    res = CliRunner().invoke(app, ["train", *flags, "--checkpoint-dir", str(ckpt)])
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and f"would resume {ckpt / STEP} (step 1)" in out, res.output
    assert f"note: {ckpt / 'step_00000002'} has no meta.json: not a complete checkpoint" in out, res.output
    assert "its weights and optimizer state would be resharded from tp 2 x pp 1 x dp 1 to tp 1 x pp 1 x dp 1" in out
    assert "note: --seq-len 16 -> 32" in out and "this run's batches" in out, res.output
    res = CliRunner().invoke(app, ["train", *flags, "--checkpoint-dir", str(tmp_path / "none")])
    assert res.exit_code == 0 and "--auto-resume: no complete checkpoint in " in res.output, res.output
    assert "would start fresh" in " ".join(res.output.split()), res.output


def test_changed_bytes_in_a_shard_are_refused_by_every_reader_naming_the_file_and_tensor(saved, tmp_path,
                                                                                          monkeypatch):
    ckpt = copy_of(saved, tmp_path)
    file, name = DAMAGED
    flip_bytes(ckpt / STEP / file, name)
    said = f"{ckpt / STEP}: {file}: tensor '{name}' does not match its checksum in meta.json (crc32 "
    monkeypatch.chdir(tmp_path)
    for args in (["train", *TRAIN, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume", "--dry-run"],
                 ["generate", "--model", str(ckpt), "--prompt", "def ", "--max-new-tokens", "2"],  # one process
                 ["export", str(ckpt), str(tmp_path / "hf")]):
        res = CliRunner().invoke(app, args)  # --dry-run checks every tensor; one process as it loads
        assert res.exit_code == 2 and res.stderr.startswith(f"error: {said}"), (args, res.output)
        assert len(res.stderr.splitlines()) == 1, (args, res.output)
    # launched: the rank that reads the damaged shard refuses it as it loads, and the job ends on that one line
    res = CliRunner().invoke(app, ["generate", "--model", str(ckpt), "--tp", "2", "--prompt", "def ",
                                   "--max-new-tokens", "2"])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: rank 1: {said}"), res.output
    assert len(res.stderr.splitlines()) == 1, res.output
    assert not (tmp_path / "hf").exists(), "export wrote a folder of wrong weights"
    reader = CheckpointReader(ckpt / STEP)  # what a worker reads, under any layout: the rows of either shard
    with pytest.raises(ConfigError, match="does not match its checksum"):
        reader.read(name, 0, 96, 128)  # tp 4's last rank: a part of the damaged shard
    assert reader.read(name, 0, 0, 64).shape == (64, 128)  # the other file's shard is whole


def test_a_checkpoint_saved_without_checksums_loads_unchecked(saved, tmp_path, monkeypatch):
    ckpt = copy_of(saved, tmp_path)
    meta_file = ckpt / STEP / "meta.json"
    meta = json.loads(meta_file.read_text())
    for entry in meta["tensors"].values():
        for shard in entry["shards"]:
            del shard["crc32_blocks"]
    meta_file.write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    for args in (["train", *TRAIN, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume", "--dry-run"],
                 ["generate", "--model", str(ckpt), "--prompt", "def ", "--max-new-tokens", "2"],
                 ["export", str(ckpt), str(tmp_path / "hf")]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
    assert CheckpointReader(ckpt / STEP).read(DAMAGED[1], 0, 96, 128).shape == (32, 128)
