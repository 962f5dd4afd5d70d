"""Measured pipeline timelines: gather them from every stage, show them beside the simulated ones.

``ParallelModel.train_step(..., trace=True)`` records the start and end of every action on every rank
(after a barrier, so ranks share a time origin; a start is taken once the action's inputs arrived, so
waiting shows as idle). ``trace_report(pm)`` gathers them, measures per-chunk costs from them
(``Costs.measure``), simulates the same schedule with those costs and returns both timelines as
``SimResult``s — so the Gantt, Chrome trace and PNG renderers work on measured data too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from plait.distributed.collectives import collective
from plait.sim import Costs, SimResult, simulate

if TYPE_CHECKING:
    from plait.parallel_model import ParallelModel

MS = 1000.0  # timelines are reported in milliseconds


@dataclass
class TraceReport:
    """A measured step beside the simulator's prediction for the same schedule and measured costs."""

    measured: SimResult
    simulated: SimResult

    def rows(self) -> list[dict]:
        """Per pipeline rank: measured and predicted busy time and bubble."""
        out = []
        for r in range(len(self.measured.busy)):
            m_idle = self.measured.idle[r] / self.measured.makespan if self.measured.makespan else 0.0
            s_idle = self.simulated.idle[r] / self.simulated.makespan if self.simulated.makespan else 0.0
            out.append({"rank": r, "busy_ms": self.measured.busy[r], "measured_bubble": m_idle,
                        "predicted_bubble": s_idle, "peak_activations": self.measured.peak_activations[r]})
        return out

    def summary(self) -> dict:
        return {"measured_makespan_ms": self.measured.makespan, "simulated_makespan_ms": self.simulated.makespan,
                "measured_bubble": self.measured.bubble_fraction,
                "predicted_bubble": self.simulated.bubble_fraction,
                "ratio": self.measured.makespan / self.simulated.makespan if self.simulated.makespan else 0.0,
                "ranks": self.rows()}

    def to_text(self, width: int = 100) -> str:
        lines = ["measured:", self.measured.to_ascii(width), "", "simulated with measured costs:",
                 self.simulated.to_ascii(width), ""]
        s = self.summary()
        lines.append(f"makespan: measured {s['measured_makespan_ms']:.2f} ms, simulated "
                     f"{s['simulated_makespan_ms']:.2f} ms (x{s['ratio']:.3f}); bubble: measured "
                     f"{s['measured_bubble']:.1%}, predicted {s['predicted_bubble']:.1%}")
        for row in s["ranks"]:
            lines.append(f"  rank {row['rank']}: bubble measured {row['measured_bubble']:.1%}, predicted "
                         f"{row['predicted_bubble']:.1%}, peak activations {row['peak_activations']:g}")
        return "\n".join(lines)

    def write_chrome_trace(self, path: str | Path) -> Path:
        """One JSON file with the measured timeline (pid 0) and the simulated one (pid 1)."""
        measured = self.measured.to_chrome_trace()["traceEvents"]
        simulated = self.simulated.to_chrome_trace()["traceEvents"]
        for ev in simulated:
            ev["pid"] = 1
        for ev in measured:
            ev["pid"] = 0
        names = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": n}}
                 for p, n in ((0, "measured"), (1, "simulated"))]
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": names + measured + simulated}))
        return path


def gather_timeline(pm: ParallelModel) -> tuple[list[tuple], list[float]]:
    """All pipeline ranks' last traced step as (pp_rank, action, start_ms, end_ms), and peaks per rank.

    Collective over the pipeline group; every rank gets the same result.
    """
    stats = pm.last_stats
    if stats is None or not stats.timeline and pm.schedule.actions[pm.ctx.pp_rank]:
        raise RuntimeError("no traced step: call train_step(..., trace=True) first")
    mine = [(pm.ctx.pp_rank, a, s * MS, e * MS) for a, s, e in stats.timeline]
    parts: list = [None] * pm.ctx.pp_size
    if pm.ctx.pp_size > 1:
        collective("pp all-gather of the traced timelines", pm.ctx.pp_group,
                   lambda: dist.all_gather_object(parts, (mine, stats.peak_stored), group=pm.ctx.pp_group))
    else:
        parts = [(mine, stats.peak_stored)]
    timeline = [row for part, _ in parts for row in part]
    return timeline, [peak for _, peak in parts]


def trace_report(pm: ParallelModel, p2p_ms: float = 0.0) -> TraceReport:
    """Measured vs simulated timeline of ``pm``'s last traced step (collective over the pipeline group)."""
    timeline, peaks = gather_timeline(pm)
    origin = min((s for _, _, s, _ in timeline), default=0.0)
    timeline = [(r, a, s - origin, e - origin) for r, a, s, e in timeline]
    schedule = pm.schedule
    costs = Costs.measure(schedule, timeline, p2p=p2p_ms)
    busy = [0.0] * schedule.num_ranks
    for r, _a, s, e in timeline:
        busy[r] += e - s
    makespan = max((e for *_, e in timeline), default=0.0)
    measured = SimResult(schedule, costs, makespan, busy, peaks, sorted(timeline, key=lambda t: (t[0], t[2])))
    return TraceReport(measured=measured, simulated=simulate(schedule, costs))
