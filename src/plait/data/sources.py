"""Raw text sources of ``plait data prepare`` and their documents: JSON lines, Parquet, HF ``datasets`` folders,
plain text files; cut into tasks a worker process reads on its own.

A task is a byte range of a JSON-lines file (whole lines), a Parquet row group, a row range of a
``save_to_disk`` folder, or a group of text files (one document each). Tasks are cut the same way whatever
the number of workers, and their outputs are concatenated in task order, so a dataset does not depend on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from plait.errors import ConfigError, require_extra

CHUNK = 4 << 20  # bytes of input per task
LINE_BLOCK = 1 << 20  # bytes read at a time while counting the lines before a bad record
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
#: why a record whose text is empty or blank is skipped (always, and counted): its EOS alone would be trained on
BLANK = "blank text, no document"
#: why a file with a NUL byte near its start is skipped (always, and counted): it is no text
BINARY = "binary (a NUL byte in its first KB), not text"
#: compressed or archived files by suffix, and the command that unpacks one (FILE: the file)
PACKED = {".gz": ("gzip", "gunzip -k FILE"), ".tgz": ("a tar archive", "tar -xzf FILE"),
          ".bz2": ("bzip2", "bunzip2 -k FILE"), ".xz": ("xz", "unxz -k FILE"), ".zst": ("zstd", "zstd -d FILE"),
          ".zstd": ("zstd", "zstd -d FILE"), ".lz4": ("lz4", "lz4 -d FILE"), ".zip": ("a zip archive", "unzip FILE"),
          ".tar": ("a tar archive", "tar -xf FILE"), ".7z": ("a 7z archive", "7z x FILE")}


@dataclass
class Source:
    """One input path as the user named it: its kind and the files it stands for."""

    path: str
    kind: str  # "jsonl", "parquet", "hf", "text"
    files: list[Path]
    bytes: int = 0
    field: str | None = None  # its own field (JSON lines) or column to read; None: the prepare's


@dataclass
class Task:
    index: int
    source: int  # index into the source list
    kind: str
    path: str  # the file (jsonl, parquet) or folder (hf); text: the first file
    start: int = 0  # jsonl: byte offset; parquet: row group; hf: first row
    stop: int = 0  # jsonl: byte end; hf: end row
    files: list[str] = field(default_factory=list)  # text: the files, one document each
    nbytes: int = 0  # input bytes it accounts for (progress)
    field: str = "text"  # the field (column) its records' text or messages are read from


class BadRecord(Exception):
    """A record without a usable text field: where it is (``where`` resolved by the parent) and why."""

    def __init__(self, path: str, offset: int, line: int, why: str):
        super().__init__(path, offset, line, why)
        self.path, self.offset, self.line, self.why = path, offset, line, why


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSON_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def discover(paths: list[str], flag: str = "SRC") -> list[Source]:
    """The sources named on the command line: files by suffix, folders recursively (sorted; hidden files and
    folders left out), HF folders whole. ConfigError for a file two SRCs name, and for a prepared dataset inside
    a folder (its shards and meta.json are no text); each names ``flag`` (plait train's raw --data too)."""
    out: list[Source] = []
    named: dict[Path, int] = {}  # every file read -> the SRC that names it
    for i, raw in enumerate(paths):
        p = Path(raw)
        if is_hf_folder(p):
            files = sorted(f for f in p.rglob("*") if f.is_file())
            out.append(Source(raw, "hf", [p], sum(f.stat().st_size for f in files)))
        elif p.is_dir():
            files = sorted((f for f in p.rglob("*") if f.is_file() and not _hidden(f.relative_to(p))),
                           key=lambda f: f.relative_to(p).as_posix())
            _no_prepared(raw, files, flag)
            for kind in ("jsonl", "parquet", "text"):
                mine = [f for f in files if _kind(f) == kind]
                if mine:
                    out.append(Source(raw, kind, mine, sum(f.stat().st_size for f in mine)))
        elif p.is_file():
            files = [p]
            out.append(Source(raw, _kind(p), files, p.stat().st_size))
        else:
            raise ConfigError(f"{flag} {raw}: no such file or directory")
        for f in files:
            _not_packed(f"{flag} {raw}", f, p.is_dir())
            first = named.setdefault(f.resolve(), i)
            if first != i:
                raise ConfigError(f"SRC {raw}: {f} is read already as part of SRC {paths[first]}, and would be read "
                                  "twice; name each file once (plait train --data WEIGHT:DIR weighs datasets)")
    return out


def _not_packed(named: str, path: Path, in_folder: bool) -> None:
    """ConfigError for a compressed or archived file, which would read as binary: the command that unpacks it.
    ``named``: the flag and path that name it (``SRC web``)."""
    suffix = path.suffix.lower()
    if suffix not in PACKED:
        return
    what, command = PACKED[suffix]
    move = f", or move it out of {named.split(' ', 1)[1]}" if in_folder else ""
    compressed = what if what.startswith("a ") else f"{what}-compressed"
    raise ConfigError(f"{named}: {path} is {compressed}, which plait does not read; unpack it first "
                      f"({command.replace('FILE', str(path))}) and name what it holds{move}")


def _hidden(relative: Path) -> bool:
    """Whether a path inside a SRC folder lies in a hidden file or folder (.git, editors' files, ...)."""
    return any(part.startswith(".") for part in relative.parts)


def _no_prepared(raw: str, files: list[Path], flag: str) -> None:
    """ConfigError when the folder ``raw`` (given as ``flag``) holds a prepared dataset (a meta.json beside
    train/*.bin)."""
    for f in files:
        if f.name == "meta.json" and (f.parent / "train").is_dir():
            fix = (f"move it out of {raw} (--out outside SRC), or name the files to read" if flag == "SRC" else
                   f"give {flag} {f.parent} to train on it, or move it out of {raw}")
            raise ConfigError(f"{flag} {raw} holds a prepared dataset, {f.parent}, whose shards and meta.json are no "
                              f"text to read: {fix}")


def tasks(sources: list[Source], field: str, chat: bool = False) -> list[Task]:
    """Every source cut into tasks, in order; their records read by ``field`` (a source's own, if it has one)."""
    out: list[Task] = []
    for si, src in enumerate(sources):
        own = src.field or field
        if src.kind == "jsonl":
            for f in src.files:
                _not_an_array(f)
                for a, b in _line_ranges(f):
                    out.append(Task(len(out), si, "jsonl", str(f), a, b, nbytes=b - a, field=own))
        elif src.kind == "parquet":
            for f in src.files:
                groups = _parquet_groups(f, own, chat, src.path)
                size = f.stat().st_size
                for g in range(groups):
                    out.append(Task(len(out), si, "parquet", str(f), g, nbytes=size // max(1, groups), field=own))
        elif src.kind == "hf":
            rows = len(hf_dataset(src.files[0]))
            per = max(1, rows * CHUNK // max(1, src.bytes))
            for a in range(0, rows, per):
                b = min(rows, a + per)
                out.append(Task(len(out), si, "hf", str(src.files[0]), a, b, nbytes=src.bytes * (b - a) // rows,
                                field=own))
        else:
            group: list[str] = []
            size = 0
            for f in src.files:
                group.append(str(f))
                size += f.stat().st_size
                if size >= CHUNK:
                    out.append(Task(len(out), si, "text", group[0], files=group, nbytes=size))
                    group, size = [], 0
            if group:
                out.append(Task(len(out), si, "text", group[0], files=group, nbytes=size))
    return out


def _not_an_array(path: Path) -> None:
    """ConfigError for a JSON file holding one array of records (``[{...}, ...]``): records are read one per line."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        lines = path.with_name(path.stem + ("-lines.jsonl" if path.suffix.lower() == ".jsonl" else ".jsonl"))
        raise ConfigError(f"SRC {path}: one JSON array, but .json/.jsonl/.ndjson files are read as JSON lines (one "
                          f"object per line); convert it first: jq -c '.[]' {path} > {lines}")


def _line_ranges(path: Path) -> Iterator[tuple[int, int]]:
    """Byte ranges of about CHUNK bytes, each ending after a newline (or at the end of the file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = 0
        while start < size:
            f.seek(min(size, start + CHUNK))
            f.readline()  # to the end of the line the cut fell in
            stop = min(size, f.tell()) if start + CHUNK < size else size
            yield start, stop
            start = stop


def _parquet_groups(path: Path, field: str, chat: bool, src: str) -> int:
    pq = pyarrow_parquet()
    try:
        meta = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"SRC {path}: not a readable Parquet file ({exc})") from None
    names = meta.schema_arrow.names
    if field not in names:
        how = field_flag(chat) + ("" if chat else f" COLUMN, or --text-field {src}=COLUMN for this SRC alone")
        raise ConfigError(f"{path}: no column {field!r} (columns: {', '.join(names)}); choose {how}")
    return meta.num_row_groups


def pyarrow_parquet():
    require_extra("data", ("pyarrow",), "reading .parquet files")
    import pyarrow.parquet as pq

    return pq


def hf_dataset(path: Path):
    require_extra("data", ("datasets",), f"reading the Hugging Face datasets folder {path}")
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ConfigError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(ds)}); name a "
                              "split's folder instead")
        ds = ds["train"]
    return ds


def field_flag(chat: bool) -> str:
    """The option naming the field a record is read by."""
    return "--messages-field" if chat else "--text-field"


def where(rec: BadRecord) -> str:
    """``file:line`` of a bad JSON line (counting the lines before its task), or ``file row N``."""
    if rec.offset < 0:
        return f"{rec.path} row {rec.line}"
    before, left = 0, rec.offset
    with open(rec.path, "rb") as f:  # block by block: a record deep in a large file costs no memory
        while left > 0:
            block = f.read(min(left, LINE_BLOCK))
            if not block:
                break
            before, left = before + block.count(b"\n"), left - len(block)
    return f"{rec.path}:{before + rec.line + 1}"
