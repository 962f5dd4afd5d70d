"""The documents of one task of ``plait data prepare`` (plait.data.sources cuts the tasks): JSON lines read one
line at a time, plain text files one at a time, Parquet row groups and ``datasets`` rows by column.

A line or file is held once, as it is read: a very long record costs its bytes, then its text as a string while
the JSON is parsed, never the whole task beside it. The task's bytes are hashed as they are read (the source's
hash in ``meta.json``).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.data.chat import BadChat, ChatRenderer, Spans, no_messages_hint
from plait.data.sources import BINARY, BLANK, BadRecord, Task, field_flag, hf_dataset, pyarrow_parquet
from plait.errors import ConfigError, json_kind

BLOCK = 1 << 20  # bytes of a JSON-lines task read at a time; a longer line is read whole, once


@dataclass
class Read:
    """What a task read: its documents, the character spans of each in the loss (``chat`` only, else None),
    the hash of its raw bytes (text and JSON lines; for the source's hash) and the bad records skipped.
    ``keys``: for each document, the document whose text decides whether it is held out (a chat record's last:
    its documents stay together)."""

    docs: list[str]
    spans: list[Spans] | None
    bad: list[BadRecord]
    skipped: int = 0  # records skipped: bad ones, blank ones, binary files
    keys: list[int] = field(default_factory=list)
    hash: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))

    def add(self, value: list[tuple[str, Spans]] | str) -> None:
        if isinstance(value, list):  # a chat record's documents
            assert self.spans is not None
            last = len(self.docs) + len(value) - 1
            for text, spans in value:
                self.keys.append(last)
                self.docs.append(text)
                self.spans.append(spans)
        else:
            self.keys.append(len(self.docs))
            self.docs.append(value)

    def skip(self, rec: BadRecord) -> None:
        self.bad.append(rec)
        self.skipped += 1


def read_task(task: Task, field: str, skip_bad: bool, chat: ChatRenderer | None = None) -> Read:
    """The documents of a task: each record's ``field`` as text, or with ``chat`` its messages rendered by the
    chat template. A bad record raises BadRecord unless ``skip_bad``."""
    out = Read([], [] if chat is not None else None, [])
    if task.kind == "jsonl":
        with open(task.path, "rb") as f:
            for i, record, why in _records(f, task.start, task.stop, out.hash):
                value, why = _text_of(record, field, chat) if record is not None else (None, why)
                if value is None:
                    _bad(out, BadRecord(task.path, task.start, i, why), skip_bad)
                elif isinstance(value, str) and (not value or value.isspace()):
                    out.skip(BadRecord(task.path, task.start, i, BLANK))
                else:
                    out.add(value)
        return out
    if task.kind == "text":
        for name in task.files:
            raw = Path(name).read_bytes()
            out.hash.update(raw)
            if b"\0" in raw[:1024]:
                out.skip(BadRecord(name, 0, 0, BINARY))
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:  # Latin-1, say: never trained on as U+FFFD characters
                _bad(out, BadRecord(name, exc.start, 0, not_utf8(raw, exc.start)), skip_bad)
                continue
            del raw  # the text alone from here on
            if text and not text.isspace():
                out.add(text)
            else:  # an empty file (an empty __init__.py, say), as a blank record
                out.skip(BadRecord(name, 0, 0, BLANK))
        return out
    values, first = _column(task, field, chat is not None)
    for i, v in enumerate(values):
        row = f" (row {i} of row group {task.start})" if task.kind == "parquet" else ""
        at = first + i  # the row in the whole file or dataset
        if chat is not None:
            try:
                out.add(chat.documents(v))
            except BadChat as exc:
                _bad(out, BadRecord(task.path, -1, at, f"{exc}{row}"), skip_bad)
        elif isinstance(v, str) and not v.strip():
            out.skip(BadRecord(task.path, -1, at, f"{BLANK}{row}"))
        elif isinstance(v, str):
            out.add(v)
        else:
            _bad(out, BadRecord(task.path, -1, at, f"{field!r} is {json_kind(v)}, not text{row}"), skip_bad)
    return out


def _records(f: io.BufferedReader, start: int, stop: int, digest: Any) -> Iterator[tuple[int, Any, str]]:
    """(line, record, "") for each non-blank JSON line of bytes [start, stop) of ``f`` (the line counted from
    ``start``), or (line, None, why) for one that is not UTF-8 or not JSON; every byte goes into ``digest``.
    Each line's bytes are let go once decoded, its text once parsed."""
    i = -1
    for line in _lines(f, start, stop):
        i += 1
        digest.update(line)
        if not line or line.isspace():
            continue
        try:
            end = len(line) - line.endswith(b"\n")  # the line without its newline, as json.loads sees it
            text = str(memoryview(line)[:end], json.detect_encoding(line), "surrogatepass")  # and decodes it
        except UnicodeDecodeError as exc:
            yield i, None, not_utf8(line, exc.start)
            continue
        del line
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            yield i, None, f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"  # "starting at"
            continue
        del text
        yield i, record, ""


def _lines(f: io.BufferedReader, start: int, stop: int) -> Iterator[bytes]:
    """The lines of bytes [start, stop) of ``f`` (each with its newline; the last may have none), read BLOCK
    bytes at a time; a line longer than that is found first, then read in one piece (never joined from parts,
    which would hold it twice)."""
    pos = start
    while pos < stop:
        f.seek(pos)
        block = f.read(min(BLOCK, stop - pos))
        cut = 0
        while (nl := block.find(b"\n", cut)) >= 0:
            yield block[cut:nl + 1]
            cut = nl + 1
        if pos + len(block) >= stop:  # the range's end: the rest (if any) is its last line
            if cut < len(block):
                yield block[cut:]
            return
        if cut > 0:  # the partial line is read again from its start with the next block
            pos += cut
            continue
        end = _line_end(f, pos + len(block), stop)
        del block
        f.seek(pos)
        yield f.read(end - pos)
        pos = end


def _line_end(f: io.BufferedReader, pos: int, stop: int) -> int:
    """Where the line running through ``pos`` ends (after its newline), or ``stop``."""
    buf = bytearray(BLOCK)
    f.seek(pos)
    while pos < stop:
        n = f.readinto(buf)
        if not n:
            break
        nl = buf.find(b"\n", 0, min(n, stop - pos))
        if nl >= 0:
            return pos + nl + 1
        pos += n
    return stop


def _bad(out: Read, rec: BadRecord, skip_bad: bool) -> None:
    if not skip_bad:
        raise rec
    out.skip(rec)


def _column(task: Task, field: str, chat: bool) -> tuple[list, int]:
    """A task's values of ``field`` and the row of the first in its file (Parquet) or dataset."""
    if task.kind == "parquet":
        parquet = pyarrow_parquet().ParquetFile(task.path)
        first = sum(parquet.metadata.row_group(g).num_rows for g in range(task.start))
        return parquet.read_row_group(task.start, columns=[field]).column(field).to_pylist(), first
    ds = hf_dataset(Path(task.path))
    if field not in ds.column_names:
        raise ConfigError(f"{task.path}: no column {field!r} (columns: {', '.join(ds.column_names)}); "
                          f"choose {field_flag(chat)}")
    return ds[task.start:task.stop][field], task.start


def _text_of(record: Any, field: str, chat: ChatRenderer | None
             ) -> tuple[str | list[tuple[str, Spans]] | None, str]:
    """A JSON record's document (text, or with ``chat`` the rendered messages and their spans), else why not."""
    if not isinstance(record, dict):
        return None, f"{json_kind(record)}, not an object with a {field!r} field"
    if field not in record:
        hint = "" if chat is not None else no_messages_hint(record, field)
        return None, (f"no {field!r} field (fields: {', '.join(list(record)[:8]) or 'none'}); choose "
                      f"{field_flag(chat is not None)}{hint}")
    value = record[field]
    if chat is not None:
        try:
            return chat.documents(value, record.get("tools")), ""
        except BadChat as exc:
            return None, str(exc)
    if not isinstance(value, str):
        return None, f"{field!r} is {json_kind(value)}, not text"
    return value, ""


def not_utf8(raw: bytes, at: int) -> str:
    """Why a record or file whose byte ``at`` breaks UTF-8 is refused: that byte and its column in its line."""
    column = at - (raw.rfind(b"\n", 0, at) + 1) + 1
    return (f"not UTF-8 text (byte 0x{raw[at]:02x} at column {column}); convert the file to UTF-8 (iconv -f "
            "ENCODING -t UTF-8)")
