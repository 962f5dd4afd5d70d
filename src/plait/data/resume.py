"""Resuming an interrupted ``plait data prepare``.

A prepare works in a hidden folder beside ``--out`` (``.NAME.partial``), locked while it runs. Its ``prepare.json``
holds what the dataset is made from: each input file's size and modification time, how they are cut into tasks,
and the options that decide the bytes written (tokenizer, EOS, held-out share, fields, chat rendering). Each
finished task leaves ``done/NNNNNN.npz``: its document lengths, skipped records, input hash, and the size and
BLAKE2b of each shard file it wrote (on disk before the record is). A prepare into the same ``--out`` from the
same inputs with the same options keeps every task whose shards still have their recorded size and hash and
does the rest; tasks are cut and encoded alike whatever the number of workers, so the dataset is byte for byte
the one an uninterrupted prepare writes. Other inputs or options are refused naming what changed; ``restart``
empties the folder first.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.format import FORMAT, SPLITS
from plait.data.shards import Written, file_digest
from plait.data.skipped import Skipped
from plait.data.sources import BadRecord, Source, Task
from plait.errors import ConfigError
from plait.words import counted

PLAN = "prepare.json"
RECORDS = "done"
LAYOUT = 1  # of prepare.json and the task records
SHOWN = 3  # changed files named in a refusal


@dataclass
class TaskResult:
    """What a finished task gives the parent, and what a resumed prepare keeps of it."""

    index: int
    source: int
    lengths: dict[str, np.ndarray]  # split -> int64 document lengths (EOS included)
    loss_tokens: dict[str, int]  # split -> tokens in the loss (with --chat; else every token)
    skipped: Skipped
    digest: bytes
    nbytes: int
    written: list[Written] = field(default_factory=list)  # its shard files


def work_folder(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def plan(found: list[Source], todo: list[Task], options: dict[str, Any]) -> dict:
    """What a prepare's bytes depend on: ``options`` (flag -> value, JSON), the input files and the task cut."""
    files = [[str(f), *_stamp(f)] for s in found for f in _files(s)]
    cut = json.dumps([[t.kind, t.path, t.start, t.stop, t.files] for t in todo]).encode()
    return {"layout": LAYOUT, "format": FORMAT, "options": options, "files": files,
            "tasks": hashlib.blake2b(cut, digest_size=16).hexdigest()}


def _files(s: Source) -> list[Path]:
    return sorted(p for p in s.files[0].rglob("*") if p.is_file()) if s.kind == "hf" else s.files


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


class Work:
    """The locked work folder of a prepare into ``out`` (``open_work``)."""

    def __init__(self, out: Path, folder: Path, fd: int):
        self.out, self.folder, self.fd = out, folder, fd

    def record(self, r: TaskResult) -> None:
        """Keep a finished task (its shards are on disk already): written aside, then renamed into place."""
        info = {"index": r.index, "source": r.source, "loss_tokens": r.loss_tokens, "digest": r.digest.hex(),
                "nbytes": r.nbytes, "reasons": r.skipped.reasons,
                "examples": [[b.path, b.offset, b.line, b.why] for b in r.skipped.examples],
                "written": [[w.file, w.bytes, w.blake2b] for w in r.written]}
        path = self.folder / RECORDS / f"{r.index:06d}.npz"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, info=np.frombuffer(json.dumps(info).encode(), np.uint8),
                     train=np.asarray(r.lengths["train"], np.int64),
                     held_out=np.asarray(r.lengths["held_out"], np.int64))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def clear(self) -> None:
        """The resume records gone: the folder is the dataset alone, to be renamed into place."""
        shutil.rmtree(self.folder / RECORDS, ignore_errors=True)
        (self.folder / PLAN).unlink(missing_ok=True)

    def release(self, failed: bool = False, resumable: bool = True) -> None:
        """Unlocked; after a ``failed`` prepare that finished no task or has none left (not ``resumable``), the
        folder is removed: there is nothing to resume."""
        if failed and not (resumable and any((self.folder / RECORDS).glob("*.npz"))):
            shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self.fd)


def open_work(out: Path, want: dict, restart: bool) -> tuple[Work, dict[int, TaskResult]]:
    """The work folder of a prepare into ``out``, locked, with the tasks kept from an interrupted prepare of the
    same ``want`` (``plan``) whose shards are intact; ConfigError when one of another plan is there (unless
    ``restart``, which empties it) or another prepare holds it."""
    folder = work_folder(out)
    folder.mkdir(exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != folder.stat().st_ino:
            raise BlockingIOError  # renamed into place meanwhile by the prepare that held it
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        raise ConfigError(f"--out {out}: another plait data prepare into it is running (it holds {folder}); wait for "
                          "it to end, or choose another --out") from None
    work = Work(out, folder, fd)
    try:
        had = _read_plan(folder / PLAN)
        if had is not None and not restart:
            changes = _changes(had, want)
            if changes:
                kept = counted(len(list((folder / RECORDS).glob("*.npz"))), "task")
                raise ConfigError(f"--out {out}: an interrupted prepare into it ({kept} done, in {folder}) read "
                                  f"other inputs or options: {'; '.join(changes)}. Run it as it was to resume it, or "
                                  "pass --restart to discard it and start over")
            if want != had:  # --skip-bad now, not then: it holds from here on
                _write_plan(folder / PLAN, want)
            return work, _kept(folder)
        for child in folder.iterdir():  # new, restarted, or left before its plan was written
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        for name in (*SPLITS, RECORDS):
            (folder / name).mkdir()
        _write_plan(folder / PLAN, want)
        return work, {}
    except BaseException:
        work.release()
        raise


def _read_plan(path: Path) -> dict | None:
    try:
        had = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return had if isinstance(had, dict) and had.get("layout") == LAYOUT else None


def _write_plan(path: Path, want: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(want, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _changes(had: dict, want: dict) -> list[str]:
    """What differs between the interrupted prepare's plan and this one's, in the user's words."""
    out = []
    for flag, now in want["options"].items():
        then = had["options"].get(flag)
        if flag == "--skip-bad" and then is False:
            continue  # its tasks skipped no bad record: --skip-bad now gives the same bytes
        if now != then and flag in ("--tokenizer", "--chat-template"):
            out.append(f"{flag}: another {flag[2:].replace('-', ' ')} (fingerprint {now}, it ran with {then})")
        elif now != then:
            out.append(f"{flag} {_shown(now)} (it ran with {_shown(then)})")
    old = {f[0]: f[1:] for f in had["files"]}
    new = {f[0]: f[1:] for f in want["files"]}
    files = [f"{p} is new" for p in new if p not in old] + [f"{p} is gone" for p in old if p not in new]
    for p in new.keys() & old.keys():
        if new[p][0] != old[p][0]:
            files.append(f"{p} changed ({old[p][0]:,} bytes then, {new[p][0]:,} now)")
        elif new[p][1] != old[p][1]:
            files.append(f"{p} was modified since")
    more = f" and {len(files) - SHOWN} more" if len(files) > SHOWN else ""
    out += [f"SRC: {', '.join(sorted(files)[:SHOWN])}{more}"] if files else []
    if not out and (had["tasks"], had.get("format")) != (want["tasks"], want["format"]):
        out.append("the inputs are cut into tasks otherwise (another plait version)")
    return out


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return json.dumps(value) if not isinstance(value, str) else value


def _kept(folder: Path) -> dict[int, TaskResult]:
    """The recorded tasks whose shards have their recorded size and hash; the other records, the shards no kept
    record names and the writes in flight when the prepare stopped are removed (those tasks are done again)."""
    kept: dict[int, TaskResult] = {}
    for path in sorted((folder / RECORDS).iterdir()):
        r = _load(path) if path.suffix == ".npz" else None
        if r is not None and all(_intact(folder, w) for w in r.written):
            kept[r.index] = r
        else:
            path.unlink()
    names = {w.file for r in kept.values() for w in r.written}
    for split in SPLITS:
        for shard in (folder / split).iterdir():
            if f"{split}/{shard.name}" not in names:
                shard.unlink()
    return kept


def _load(path: Path) -> TaskResult | None:
    try:
        with np.load(path) as z:
            info = json.loads(bytes(z["info"]))
            lengths = {s: np.asarray(z[s], np.int64) for s in SPLITS}
    except (OSError, ValueError, KeyError):
        return None
    bad = [BadRecord(*e) for e in info["examples"]]
    return TaskResult(info["index"], info["source"], lengths, info["loss_tokens"], Skipped(info["reasons"], bad),
                      bytes.fromhex(info["digest"]), info["nbytes"], [Written(*w) for w in info["written"]])


def _intact(folder: Path, w: Written) -> bool:
    path = folder / w.file
    return path.is_file() and path.stat().st_size == w.bytes and file_digest(path).hex() == w.blake2b


def kept_note(out: Path) -> str:
    """For a stopped prepare: how many tasks its work folder keeps for the next (empty when none)."""
    folder = work_folder(out)
    n = len(list((folder / RECORDS).glob("*.npz"))) if (folder / RECORDS).is_dir() else 0
    return (f"; {counted(n, 'finished task')} kept in {folder}: the same command resumes (--restart starts over)"
            if n else "")
