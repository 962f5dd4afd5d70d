"""A stopped plait data prepare resumes: the tasks it finished (shards intact, by size and hash) are kept, the rest
done, and the dataset is byte for byte an uninterrupted prepare's; other inputs or options are refused naming what
changed, --restart starts over."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from data_util import documents, write_jsonl
from plait.cli.main import app
from plait.data import prepare
from plait.data import sources as data_sources
from plait.errors import ConfigError

PREPARE = sys.modules["plait.data.prepare"]  # the module (plait.data.prepare is also the function)
CHUNK = 3000  # bytes a task: a small corpus makes a few dozen tasks


def _corpus(root: Path) -> list[str]:
    root.mkdir()
    write_jsonl(root / "a.jsonl", documents(600, seed=3))
    (root / "b.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in documents(200, seed=4)) + "\n")
    for i in range(3):
        (root / f"t{i}.txt").write_text(" ".join(documents(40, seed=10 + i)))
    return [str(root / "a.jsonl"), str(root / "t0.txt"), str(root / "t1.txt"), str(root / "t2.txt")]


def _files(folder: Path) -> dict[str, bytes]:
    """Every file of a dataset by relative path, meta.json without its timings."""
    out = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    meta = json.loads(out.pop("meta.json"))
    del meta["seconds"], meta["created"]
    out["meta.json"] = json.dumps(meta, sort_keys=True).encode()
    return out


def _encoded(monkeypatch, stop_at: int | None = None) -> list[int]:
    """The tasks encoded from now on (in-process, one worker); with ``stop_at`` a Ctrl-C as that many began."""
    calls: list[int] = []
    original = PREPARE.Encoder.__call__

    def encode(self, task):
        calls.append(task.index)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return original(self, task)

    monkeypatch.setattr(PREPARE.Encoder, "__call__", encode)
    return calls


def test_a_prepare_stopped_after_some_tasks_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.setattr(data_sources, "CHUNK", CHUNK)
    srcs = _corpus(tmp_path / "c")
    prepare(srcs, "bytes", tmp_path / "clean", workers=1, held_out=0.1)
    first = _encoded(monkeypatch, stop_at=7)
    with pytest.raises(KeyboardInterrupt):
        prepare(srcs, "bytes", tmp_path / "out", workers=1, held_out=0.1)
    assert not (tmp_path / "out").exists() and len(list((tmp_path / ".out.partial" / "done").glob("*.npz"))) == 6
    monkeypatch.undo()
    monkeypatch.setattr(data_sources, "CHUNK", CHUNK)
    second = _encoded(monkeypatch)
    meta = prepare(srcs, "bytes", tmp_path / "out", workers=1, held_out=0.1)
    total = len(first) - 1 + len(second)
    assert second == list(range(6, total)) and total > 20, (first, second)  # the six finished tasks are kept
    assert _files(tmp_path / "out") == _files(tmp_path / "clean")
    assert meta["splits"]["held_out"]["documents"] > 0 and not (tmp_path / ".out.partial").exists()
    _encoded(monkeypatch, stop_at=4)  # stopped with one worker, resumed with two: the same bytes again
    with pytest.raises(KeyboardInterrupt):
        prepare(srcs, "bytes", tmp_path / "two", workers=1, held_out=0.1)
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / ".two.partial" / "train").iterdir()}
    prepare(srcs, "bytes", tmp_path / "two", workers=2, held_out=0.1)  # spawned workers: tasks as cut here
    assert _files(tmp_path / "two") == _files(tmp_path / "clean")
    assert len(kept) == 3 and all((tmp_path / "two" / "train" / n).stat().st_mtime_ns == t for n, t in kept.items())


def test_a_killed_prepare_resumes_and_a_damaged_kept_shard_is_done_again(tmp_path, monkeypatch):
    """SIGKILL mid-way (no clean-up at all), then a shard of a kept task cut short: the next prepare keeps the
    intact tasks, does the damaged one and the rest, and writes the uninterrupted prepare's bytes."""
    monkeypatch.setattr(data_sources, "CHUNK", CHUNK)
    srcs = _corpus(tmp_path / "c")
    out = tmp_path / "out"
    prepare(srcs, "bytes", tmp_path / "clean", workers=1, held_out=0.1)
    slow = (f"import sys, time, plait.data.sources as s; s.CHUNK = {CHUNK}; p = sys.modules['plait.data.prepare']"
            "; call = p.Encoder.__call__; p.Encoder.__call__ = lambda self, t: (time.sleep(0.2), call(self, t))[1];"
            " from plait.cli.main import app; app()")
    cmd = [sys.executable, "-c", slow, "data", "prepare", *srcs, "--tokenizer", "bytes", "--out", str(out),
           "--workers", "1", "--held-out", "0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    done = tmp_path / ".out.partial" / "done"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(done.glob("*.npz")) if done.is_dir() else []) < 4:
        time.sleep(0.01)
    assert proc.poll() is None, "the prepare ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = sorted(done.glob("*.npz"))
    shard = tmp_path / ".out.partial" / "train" / "000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # a kept task's shard damaged: that task is done again
    encoded = _encoded(monkeypatch)
    prepare(srcs, "bytes", out, workers=1, held_out=0.1)
    every = len(PREPARE.tasks(data_sources.discover(srcs), "text"))
    assert encoded == [1, *range(len(kept), every)], (len(kept), encoded)  # the damaged task, then the rest
    assert _files(out) == _files(tmp_path / "clean")


def test_changed_inputs_or_options_are_refused_naming_what_changed_and_restart_starts_over(tmp_path, monkeypatch):
    monkeypatch.setattr(data_sources, "CHUNK", CHUNK)
    srcs = _corpus(tmp_path / "c")
    _encoded(monkeypatch, stop_at=4)
    with pytest.raises(KeyboardInterrupt):
        prepare(srcs, "bytes", tmp_path / "out", workers=1, held_out=0.1)
    monkeypatch.undo()
    monkeypatch.setattr(data_sources, "CHUNK", CHUNK)
    with pytest.raises(ConfigError) as err:
        prepare(srcs, "bytes", tmp_path / "out", workers=1, held_out=0.2)
    assert f"--out {tmp_path / 'out'}: an interrupted prepare into it (3 tasks done, in {tmp_path / '.out.partial'})" \
           in str(err.value) and "--held-out 0.2 (it ran with 0.1)" in str(err.value), err.value
    assert "Run it as it was to resume it, or pass --restart to discard it and start over" in str(err.value)
    with open(srcs[1], "a") as f:
        f.write(" one more sentence")
    res = CliRunner().invoke(app, ["data", "prepare", *srcs, "--tokenizer", "bytes", "--out", str(tmp_path / "out"),
                                   "--workers", "1", "--held-out", "0.1"])
    assert res.exit_code == 2 and f"SRC: {srcs[1]} changed (" in res.stderr and "--held-out" not in res.stderr, \
        res.output
    # --skip-bad where it ran without: its tasks skipped no bad record, so it resumes (the plan now has it)
    encoded = _encoded(monkeypatch)
    prepare(srcs, "bytes", tmp_path / "again", workers=1, held_out=0.1)
    clean = tmp_path / "again"
    res = CliRunner().invoke(app, ["data", "prepare", *srcs, "--tokenizer", "bytes", "--out", str(tmp_path / "out"),
                                   "--workers", "1", "--held-out", "0.1", "--restart", "--skip-bad"])
    assert res.exit_code == 0, res.output
    assert len(encoded) == 2 * len(PREPARE.tasks(data_sources.discover(srcs), "text"))  # started over: every task
    assert _files(tmp_path / "out") == _files(clean)


def test_a_prepare_into_an_out_another_one_is_writing_is_refused(tmp_path):
    srcs = _corpus(tmp_path / "c")
    folder = tmp_path / ".out.partial"
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running prepare holds it
        with pytest.raises(ConfigError, match="another plait data prepare into it is running"):
            prepare(srcs, "bytes", tmp_path / "out", workers=1)
    finally:
        os.close(fd)
    prepare(srcs, "bytes", tmp_path / "out", workers=1)
    assert (tmp_path / "out" / "meta.json").is_file() and not folder.exists()


def test_a_full_disk_stops_the_prepare_with_one_line_and_the_same_command_resumes(tmp_path, monkeypatch):
    import errno

    from plait.data import shards

    monkeypatch.setattr(data_sources, "CHUNK", CHUNK)
    srcs = _corpus(tmp_path / "c")
    prepare(srcs, "bytes", tmp_path / "clean", workers=1, held_out=0.1)
    write, calls = shards.ShardFile.write, []

    def full(self, array):
        calls.append(self.name)
        if len(calls) == 200:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root / self.name))
        write(self, array)

    monkeypatch.setattr(shards.ShardFile, "write", full)
    args = ["data", "prepare", *srcs, "--tokenizer", "bytes", "--out", str(tmp_path / "out"), "--workers", "1",
            "--held-out", "0.1"]
    res = CliRunner().invoke(app, args)
    kept = len(list((tmp_path / ".out.partial" / "done").glob("*.npz")))
    assert res.exit_code == 1 and res.stderr == (
        f"error: No space left on device ({tmp_path / '.out.partial' / calls[-1]}); --out {tmp_path / 'out'} left as "
        f"it was; {kept} finished tasks kept in {tmp_path / '.out.partial'}: the same command resumes (--restart "
        "starts over)\n") and kept > 1, res.output  # was a traceback
    monkeypatch.setattr(shards.ShardFile, "write", write)
    assert CliRunner().invoke(app, args).exit_code == 0
    assert _files(tmp_path / "out") == _files(tmp_path / "clean")
