"""PyTorch pipelining's compute-only CSV schedule format: export and import.

``torch.distributed.pipelining`` writes ``pipeline_order`` with ``csv.writer``: one row per rank, one
cell per step, each cell an action's compact form (``0F0``, ``1B0``, ``3I2``, ``3W2``) or empty for an
idle step; ``_load_csv`` parses it back with ``_Action.from_str``. Torch's DualPipeV also writes
overlapped pairs as ``(0F1;3B0)OVERLAP_F_B``; plait reads those as two consecutive actions.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import TYPE_CHECKING

from plait.errors import ConfigError
from plait.schedules.actions import Action

if TYPE_CHECKING:
    from plait.schedules.schedule import Schedule

_OVERLAP_RE = re.compile(r"^\s*\((.*)\)\s*OVERLAP_F_B\s*$")


def to_csv(schedule: Schedule, path: str | Path | None = None) -> str:
    """Rows of compact actions, one per rank, as torch's ``_dump_csv(format="compute_only")`` writes."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in schedule.actions:
        writer.writerow([str(a) for a in row])
    text = buf.getvalue()
    if path is not None:
        with open(path, "w", newline="") as fh:
            fh.write(text)
    return text


def _parse_cell(cell: str, rank: int, col: int) -> list[Action]:
    cell = cell.strip()
    if not cell:
        return []
    match = _OVERLAP_RE.match(cell)
    parts = match.group(1).split(";") if match else [cell]
    try:
        return [Action.parse(p) for p in parts if p.strip()]
    except ConfigError as exc:
        raise ConfigError(f"CSV row {rank} (rank {rank}), column {col}: {exc}") from None


def _infer_placement(rows: list[list[Action]]) -> dict[int, int]:
    placement: dict[int, int] = {}
    for r, row in enumerate(rows):
        for a in row:
            other = placement.setdefault(a.stage, r)
            if other != r:
                raise ConfigError(f"CSV: chunk {a.stage} has actions on rank {other} and rank {r}")
    return placement


def from_csv(text_or_path: str | Path, name: str = "csv") -> Schedule:
    """Build a Schedule from torch's compute-only CSV (a path, or the CSV text itself).

    The chunk -> rank placement, chunk count and micro-batch count are inferred from the cells, like
    torch's ``_validate_and_set_stage_mapping``; the result is validated.
    """
    from plait.schedules.schedule import Schedule

    text = str(text_or_path)
    is_text = isinstance(text_or_path, str) and ("\n" in text or ("," in text and not Path(text).exists()))
    if not is_text:
        with open(text_or_path, newline="") as fh:
            text = fh.read()
    rows = [[a for col, cell in enumerate(line) for a in _parse_cell(cell, r, col)]
            for r, line in enumerate(csv.reader(io.StringIO(text)))]
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise ConfigError("CSV: no rows (expected one row of actions per rank)")
    chunk_rank = _infer_placement(rows)
    num_chunks = max(chunk_rank) + 1
    if sorted(chunk_rank) != list(range(num_chunks)):
        missing = sorted(set(range(num_chunks)) - set(chunk_rank))
        raise ConfigError(f"CSV: chunks {missing} have no actions (chunks must be 0..{num_chunks - 1})")
    p = len(rows)
    if num_chunks % p:
        raise ConfigError(f"CSV: {num_chunks} chunks over {p} ranks; chunks must be a multiple of ranks")
    mbs = max(a.microbatch for row in rows for a in row) + 1
    sched = Schedule(name=name, num_ranks=p, virtual=num_chunks // p, microbatches=mbs,
                     placement=tuple(chunk_rank[c] for c in range(num_chunks)), actions=rows)
    return sched.validate()
