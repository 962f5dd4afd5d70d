"""Counts and choices in what plait prints: each count with its noun in the number it takes (1 shard, 2
shards), a list of choices as a person writes it (1, 2 or 4)."""

from __future__ import annotations


def counted(n: float, noun: str, shown: str | None = None) -> str:
    """``n`` and ``noun``, the noun plural unless ``n`` is 1: ``counted(1, "training shard")`` is "1 training
    shard", ``counted(1200, "document")`` "1,200 documents", ``counted(2, "process")`` "2 processes",
    ``counted(3, "micro-batch")`` "3 micro-batches". ``shown``: ``n`` as written (default ``f"{n:,}"``)."""
    if n == 1:
        word = noun
    elif noun.endswith(("s", "x", "z", "ch", "sh")):
        word = noun + "es"
    elif noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u"):
        word = noun[:-1] + "ies"
    else:
        word = noun + "s"
    return f"{f'{n:,}' if shown is None else shown} {word}"


def either(values: list[str]) -> str:
    """``values`` as a choice: ["1"] -> "1", ["1", "2"] -> "1 or 2", ["1", "2", "4"] -> "1, 2 or 4"."""
    return " or ".join(filter(None, (", ".join(values[:-1]), values[-1])))
