"""Export a simulated timeline: Chrome/Perfetto trace JSON and a PNG drawn with matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.schedules.actions import KIND_NAMES

if TYPE_CHECKING:
    from plait.sim.engine import SimResult

COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#DDAA33", "W": "#AA4499"}
_US_PER_UNIT = 1000.0  # one cost unit is drawn as one millisecond


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """Trace Event Format (``ph: "X"`` complete events, one thread per rank) that Perfetto and
    ``chrome://tracing`` load. Times are in microseconds, one cost unit = 1 ms."""
    s = result.schedule
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": f"plait {s.name}"}}
    ]
    for r in range(s.num_ranks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for r, act, t0, t1 in result.timeline:
        events.append({
            "name": str(act), "cat": KIND_NAMES[act.kind], "ph": "X", "pid": 0, "tid": r,
            "ts": t0 * _US_PER_UNIT, "dur": (t1 - t0) * _US_PER_UNIT,
            "args": {"kind": act.kind, "chunk": act.stage, "microbatch": act.microbatch},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": result.to_dict()}


def save_png(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Draw one bar per step, one row per rank (rank 0 on top), and save to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = result.schedule
    fig_w = min(24.0, 6.0 + 0.15 * len(result.timeline) / max(s.num_ranks, 1))
    fig, ax = plt.subplots(figsize=(fig_w, 1.0 + 0.5 * s.num_ranks))
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r, act, t0, t1 in result.timeline:
        bars.setdefault((r, act.kind), []).append((t0, t1 - t0))
    for (r, kind), spans in bars.items():
        ax.broken_barh(spans, (s.num_ranks - 1 - r - 0.4, 0.8), facecolors=COLOURS[kind],
                       edgecolor="white", linewidth=0.5)
    if len(result.timeline) <= 1024:  # micro-batch numbers on the bars that are wide enough
        for r, act, t0, t1 in result.timeline:
            if t1 - t0 >= result.makespan / 120:
                ax.text((t0 + t1) / 2, s.num_ranks - 1 - r, str(act.microbatch), ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks(range(s.num_ranks), [f"rank {r}" for r in reversed(range(s.num_ranks))])
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    ax.set_title(title or f"{s.name}: P={s.num_ranks}, V={s.virtual}, M={s.microbatches}; "
                 f"bubble {result.bubble_fraction:.1%}, makespan {result.makespan:g}")
    kinds = sorted({a.kind for _, a, _, _ in result.timeline}, key="FBIW".index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=KIND_NAMES[k]) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(kinds), frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
