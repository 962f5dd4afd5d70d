"""ASCII Gantt chart of a simulated schedule: true to time, idle gaps visible, micro-batch numbers inside.

Each rank is a row; time runs left to right at a fixed, "nice" time per column (1, 2, 2.5 or 5 times a
power of ten) chosen so the chart fits ``width`` columns. A step is a block of its kind's fill
character (F ``=``, B ``#``, I ``+``, W ``~``) that starts with its micro-batch number when the block
is wide enough; ``.`` is idle. ``width`` bounds the time axis (the rank labels come on
top). Blocks shorter than a column may be hidden by a neighbour.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from plait.words import counted

if TYPE_CHECKING:
    from plait.sim.engine import SimResult

FILL = {"F": "=", "B": "#", "I": "+", "W": "~"}
IDLE = "."
STYLE = {"F": "bold white on blue", "B": "bold white on green", "I": "bold black on yellow",
         "W": "bold white on magenta", IDLE: "dim"}
LEGEND = "F forward '='   B backward '#'   I input-grad '+'   W weight-grad '~'   idle '.'"


def nice_step(makespan: float, width: int) -> float:
    """Smallest time per column from {1, 2, 2.5, 5}·10^k that fits ``makespan`` in ``width`` columns."""
    raw = max(makespan, 1e-12) / max(width, 1)
    base = 10.0 ** math.floor(math.log10(raw))
    for mult in (1.0, 2.0, 2.5, 5.0, 10.0):
        if base * mult >= raw * (1 - 1e-9):
            return base * mult
    return base * 10


def _rows(result: SimResult, width: int, colour: bool) -> tuple[list[list[tuple[str, str]]], float, int]:
    """Per rank, a list of (character, kind-or-idle) cells; also the time per column and column count.

    Without colour a block needs one column beyond its number, or it shows only its fill character.
    """
    step = nice_step(result.makespan, width)
    cols = max(1, math.ceil(result.makespan / step - 1e-9))
    grid = [[(IDLE, IDLE)] * cols for _ in range(result.schedule.num_ranks)]
    for r, act, t0, t1 in result.timeline:
        a, b = round(t0 / step), min(cols, round(t1 / step))
        if b <= a:  # narrower than a column: show it only where the rank is otherwise idle
            if a < cols and grid[r][a][1] == IDLE:
                grid[r][a] = (FILL[act.kind], act.kind)
            continue
        label = str(act.microbatch)
        room = b - a - len(label) - (0 if colour else 1)
        text = label + FILL[act.kind] * (b - a - len(label)) if room >= 0 else FILL[act.kind] * (b - a)
        grid[r][a:b] = [(ch, act.kind) for ch in text]
    return grid, step, cols


def _scale(step: float, cols: int, indent: int) -> list[str]:
    """A ruler with a tick every 10 columns and the time at each tick."""
    ticks = "".join("|" if c % 10 == 0 else "-" for c in range(cols + 1))
    labels = [" "] * (cols + 12)
    for c in range(0, cols + 1, 10):
        text = f"{c * step:g}"
        labels[c:c + len(text)] = text
    return [" " * indent + ticks, " " * indent + "".join(labels).rstrip()]


def _header(result: SimResult, step: float) -> str:
    s = result.schedule
    return (f"{s.name}: {counted(s.num_ranks, 'rank')} x {counted(s.virtual, 'chunk')}, "
            f"{counted(s.microbatches, 'micro-batch')}; "
            f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}; one column = {step:g}")


def render_text(result: SimResult, width: int = 100) -> str:
    """The chart as plain text (see the module docstring for the notation)."""
    grid, step, cols = _rows(result, width, colour=False)
    name = [f"rank {r:>{len(str(len(grid) - 1))}} |" for r in range(len(grid))]
    lines = [_header(result, step)]
    lines += [n + "".join(ch for ch, _ in row) + "|" for n, row in zip(name, grid, strict=True)]
    lines += _scale(step, cols, len(name[0]) - 1)
    lines.append(LEGEND)
    return "\n".join(lines)


def render_rich(result: SimResult, width: int = 100) -> Any:
    """The same chart as a ``rich.text.Text``, with one colour per kind of step."""
    from rich.text import Text

    grid, step, cols = _rows(result, width, colour=True)
    out = Text(_header(result, step) + "\n")
    for r, row in enumerate(grid):
        out.append(f"rank {r:>{len(str(len(grid) - 1))}} |")
        for ch, kind in row:
            out.append(ch, style=STYLE[kind])
        out.append("|\n")
    pad = len(f"rank {len(grid) - 1} |") - 1
    out.append("\n".join(_scale(step, cols, pad)) + "\n")
    for kind, fill in FILL.items():
        out.append(f" {fill}{fill} ", style=STYLE[kind])
        out.append(f" {kind} {_KIND_WORD[kind]}  ")
    out.append(" .. idle")
    return out


_KIND_WORD = {"F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad"}
