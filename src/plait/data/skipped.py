"""The records ``plait data prepare --skip-bad`` skips (and the blank ones it always skips): how many of each
reason, and a few examples by ``file:line`` for the summary and ``meta.json``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from plait.data.sources import BadRecord, where

EXAMPLES = 5  # skipped records kept by file and line, per task and per source


def reason(why: str) -> str:
    """The kind of a bad record: its ``why`` without the particulars (a column, the fields, a row, the fix)."""
    return why.split(" (", 1)[0].split(";", 1)[0]


def tally(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """``counts`` added up by key, the largest first."""
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(total.most_common())


def examples(bad: list[BadRecord]) -> list[BadRecord]:
    """Up to EXAMPLES of ``bad`` in their order: the first of each reason, then the earliest of the others."""
    first: dict[str, BadRecord] = {}
    for b in bad:
        first.setdefault(reason(b.why), b)
    keep = {id(b) for b in list(first.values())[:EXAMPLES]}
    for b in bad:
        if len(keep) >= EXAMPLES:
            break
        keep.add(id(b))
    return [b for b in bad if id(b) in keep]


@dataclass
class Skipped:
    """The records a task skipped: how many of each reason, and its examples (``where`` resolved by the parent)."""

    reasons: dict[str, int]
    examples: list[BadRecord]

    @classmethod
    def of(cls, bad: list[BadRecord]) -> Skipped:
        return cls(tally({reason(b.why): 1} for b in bad), examples(bad))

    @property
    def count(self) -> int:
        return sum(self.reasons.values())


def source_meta(parts: list[Skipped]) -> dict:
    """A source's skipped records in ``meta.json``: their number, the number of each reason (the most frequent
    first) and the examples as ``file:line: why``."""
    return {"skipped": sum(p.count for p in parts), "skipped_reasons": tally(p.reasons for p in parts),
            "skipped_examples": [f"{where(b)}: {b.why}" for b in examples([b for p in parts for b in p.examples])]}
