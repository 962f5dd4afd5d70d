"""The pipeline simulator: times a schedule with ``Costs`` and accounts for bubbles and activation memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.schedules import Action, Schedule
from plait.schedules.execute import execute
from plait.schedules.validate import check_structure, deadlock_error
from plait.sim.costs import Costs


def bubble_fraction(makespan: float, busy: list[float]) -> float:
    """Idle share of device time averaged over ranks, ``mean_r (makespan - busy_r) / makespan`` (0 for an empty
    schedule)."""
    if makespan <= 0:
        return 0.0
    return sum(makespan - b for b in busy) / (makespan * len(busy))


@dataclass
class SimResult:
    """What ``simulate`` measured. Times are in the units of the ``Costs``.

    ``bubble_fraction`` is the idle share of device time averaged over ranks,
    ``mean_r (makespan - busy_r) / makespan``. ``peak_activations[r]`` is the largest number of
    micro-batches whose activations rank ``r`` holds at once, in whole-stage micro-batches (a chunk
    counts ``1/V``): a micro-batch is held on a chunk from the start of its ``F`` until the end of its
    ``B`` or, for a split backward, until the end of its ``W`` (the runtime keeps the autograd graph,
    and so the inputs the weight gradient needs, alive until ``W``).
    """

    schedule: Schedule
    costs: Costs
    makespan: float
    busy: list[float]
    peak_activations: list[float]
    timeline: list[tuple[int, Action, float, float]] = field(repr=False)

    @property
    def idle(self) -> list[float]:
        """Idle time per rank: ``makespan - busy``."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.makespan, self.busy)

    def to_ascii(self, width: int = 100) -> str:
        """Gantt chart true to time, at most ``width`` columns of time axis (see ``plait.sim.gantt``)."""
        from plait.sim.gantt import render_text

        return render_text(self, width)

    def to_rich(self, width: int = 100) -> Any:
        """The Gantt chart as a ``rich.text.Text`` with one colour per kind of step."""
        from plait.sim.gantt import render_rich

        return render_rich(self, width)

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto trace (``{"traceEvents": [...]}``); one cost unit is shown as 1 ms."""
        from plait.sim.export import chrome_trace

        return chrome_trace(self)

    def to_png(self, path: str | Path, title: str | None = None) -> Path:
        """Draw the timeline with matplotlib (imported here) and save it to ``path``."""
        from plait.sim.export import save_png

        return save_png(self, path, title)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        """The figures as plain JSON-able data (with ``timeline=True``, also every step)."""
        s = self.schedule
        out: dict[str, Any] = {
            "schedule": s.name, "num_ranks": s.num_ranks, "num_stages": s.num_stages,
            "virtual": s.virtual, "microbatches": s.microbatches, "costs": self.costs.to_dict(),
            "makespan": self.makespan, "bubble_fraction": self.bubble_fraction,
            "busy": self.busy, "idle": self.idle, "peak_activations": self.peak_activations,
        }
        if timeline:
            out["timeline"] = [[r, str(a), t0, t1] for r, a, t0, t1 in self.timeline]
        return out


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Simulate ``schedule``: every rank runs its actions in order, each starting when the rank is free
    and its inputs exist (plus ``costs.p2p`` for inputs from another rank).

    Raises ``plait.ConfigError`` (with the per-rank grid) if the schedule is malformed or deadlocks.
    Linear in the number of actions.
    """
    costs = costs if costs is not None else Costs()
    durations = costs.durations(schedule)
    check_structure(schedule)
    run = execute(schedule, durations, costs.p2p)
    if not run.finished:
        raise deadlock_error(schedule, run)
    timeline: list[tuple[int, Action, float, float]] = []
    busy, peaks = [], []
    for r, row in enumerate(schedule.actions):
        starts, ends = run.starts[r], run.ends[r]
        timeline.extend(zip([r] * len(row), row, starts, ends, strict=True))
        busy.append(sum(e - s for s, e in zip(starts, ends, strict=True)))
        peaks.append(_peak_chunks(row) / schedule.virtual)
    makespan = max((e[-1] for e in run.ends if e), default=0.0)
    return SimResult(schedule, costs, makespan, busy, peaks, timeline)


def _peak_chunks(row: list[Action]) -> int:
    """Most (chunk, micro-batch) activations alive at once: +1 at an F's start, -1 at a B's or W's end.

    A rank runs one step at a time, so list order is time order and frees at an end precede the next
    step's allocation.
    """
    live = peak = 0
    for kind, _, _ in row:
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind == "B" or kind == "W":
            live -= 1
    return peak
