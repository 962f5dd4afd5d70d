"""Counts, choices and meshes in what plait prints: each count with its noun in the number it takes (1 shard, 2
shards), a list of choices as a person writes it (1, 2 or 4), a layout's mesh as ``tp 2 x pp 2 x dp 1``."""

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


def mesh(tp: int, pp: int, dp: int | str, cp: int = 1, cp_comm: str | None = None) -> str:
    """A layout's mesh in words: ``tp 2 x pp 2 x dp 1``, with ``x cp 2`` after the tp where there is context
    parallelism (``x cp 2 (ring)`` given its K/V exchange ``cp_comm``). ``dp``: its size, or words that stand for
    one not yet known (``to fill --nproc``)."""
    cp_words = f" x cp {cp}{f' ({cp_comm})' if cp_comm else ''}" if cp > 1 else ""
    return f"tp {tp}{cp_words} x pp {pp} x dp {dp}"
