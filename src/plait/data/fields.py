"""``plait data prepare --text-field``: the field (JSON lines) or column (Parquet, ``datasets``) each source's
text is read from. ``--text-field FIELD`` names it for every SRC, ``--text-field SRC=FIELD`` for one SRC as
given on the command line (repeatable); a SRC of JSON lines whose first records have none of its field is
refused before anything is tokenized, naming the fields they have."""

from __future__ import annotations

import json

from plait.data.chat import ChatSpec, no_messages_hint
from plait.data.sources import Source
from plait.errors import ConfigError

DEFAULT = "text"
SAMPLE = 20  # records of a source's first file looked at for its field


def parse_fields(given: list[str], srcs: list[str]) -> tuple[str, dict[str, str]]:
    """(the field of every SRC, {SRC: its own field}) from the --text-field values ``given``."""
    default: str | None = None
    own: dict[str, str] = {}
    for value in given:
        src = max((s for s in srcs if value.startswith(s + "=")), key=len, default=None)
        if src is None and "=" in value:
            raise ConfigError(f"--text-field {value}: {value.rsplit('=', 1)[0]} is no SRC of this prepare "
                              f"({', '.join(srcs)}); give --text-field FIELD for every SRC, or SRC=FIELD with SRC "
                              "as given on the command line")
        field = value if src is None else value[len(src) + 1:]
        if not field:
            raise ConfigError(f"--text-field {value}: no field named; give --text-field FIELD or SRC=FIELD")
        if src is None and default is not None and field != default:
            raise ConfigError(f"--text-field {default} and --text-field {field}: one field for every SRC; name a "
                              "SRC's own with --text-field SRC=FIELD")
        if src is not None and own.get(src, field) != field:
            raise ConfigError(f"--text-field {src}={own[src]} and {value}: one field for each SRC")
        if src is None:
            default = field
        else:
            own[src] = field
    return default or DEFAULT, own


def check_fields(default: str, own: dict[str, str], chat: ChatSpec | None, found: list[Source]) -> None:
    """ConfigError for a --text-field that nothing would read (with ``chat``; on plain text, whose files are
    each one document) and for a JSON-lines SRC whose first records have no such field. Sets each source's own
    ``field``."""
    if chat is not None and (own or default != DEFAULT):
        flag = f"--text-field {default}" if default != DEFAULT else f"--text-field {next(iter(own))}=..."
        raise ConfigError(f"{flag}: --chat reads --messages-field ({chat.field}) instead; leave --text-field out")
    if default != DEFAULT and all(s.kind == "text" for s in found):
        raise ConfigError(f"--text-field {default} names a field of JSON lines, Parquet or datasets records, "
                          f"but every SRC is plain text (each file one document): leave --text-field out")
    for src, field in own.items():
        if all(s.kind == "text" for s in found if s.path == src):
            raise ConfigError(f"--text-field {src}={field}: SRC {src} is plain text (each file one document), "
                              "which has no fields: leave it out")
    several = len({s.path for s in found}) > 1
    for s in found:
        s.field = own.get(s.path) if chat is None else None
        if s.kind == "jsonl" and chat is None:
            _has_field(s, s.field or default, s.field is not None, several)


def _has_field(s: Source, field: str, own: bool, several: bool) -> None:
    """ConfigError when none of the first SAMPLE objects of the source's first file has ``field`` (``own``: the
    SRC's own --text-field; ``several``: SRCs, which --text-field SRC=FIELD tells apart)."""
    seen: dict[str, None] = {}
    first: dict | None = None
    with open(s.files[0], "rb") as f:
        for line in _first_lines(f):
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a bad line: named by file:line when it is read (or skipped with --skip-bad)
            if isinstance(record, dict):
                if field in record:
                    return
                first = first if first is not None else record
                seen.update(dict.fromkeys(record))
    if first is not None:
        how = (f"another --text-field {s.path}=FIELD" if own else
               f"--text-field {s.path}=FIELD for this SRC (--text-field FIELD names every SRC's)" if several else
               "--text-field FIELD")
        raise ConfigError(f"SRC {s.path}: its records have no {field!r} field (the first of {s.files[0]} have: "
                          f"{', '.join(list(seen)[:12])}); choose {how}{no_messages_hint(first, field)}")


def _first_lines(f) -> list[bytes]:
    """Up to SAMPLE non-blank lines from the start of a file, none longer than 1 MB (a longer one is left out)."""
    out: list[bytes] = []
    while len(out) < SAMPLE:
        line = f.readline(1 << 20)
        if not line:
            break
        if line.endswith(b"\n") and line.strip():
            out.append(line)
        elif not line.endswith(b"\n") and len(line) >= 1 << 20:
            while line and not line.endswith(b"\n"):  # the rest of a long line
                line = f.readline(1 << 20)
        elif line.strip():
            out.append(line)
    return out
