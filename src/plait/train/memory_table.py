"""The per-rank memory table ``plait train`` prints after its first step: measured bytes beside the planner's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Group


def memory_table(rows: list[dict], predicted: list[dict] | None = None, notes: Sequence[str] = ()) -> Group:
    """Per rank, measured bytes of a real step (``ParallelModel.memory_report``) as a rich table in MiB (the unit
    ``plait plan`` says small runs' memory in); with a prediction, each rank's row is followed by the planner's
    figures for its pipeline rank, a row of their own
    (one number a cell, so the table stays readable in 80 columns), and ``notes`` (what the prediction assumes,
    ``Prediction.notes``) under the table."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    pred = {p["pp_rank"]: p for p in predicted or []}
    title = ("memory per rank, MiB (each rank measured, then the planner's prediction)" if pred
             else "memory per rank, MiB (measured)")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0, 0, 1))
    kinds = ["params", "grads", "optimizer", "activations_peak"]
    if any(r.get("params_gathered_peak") is not None for r in rows):  # ZeRO-3: the working set of gathered weights
        kinds.append("params_gathered_peak")
    heads = {"activations_peak": "activations\npeak", "params_gathered_peak": "gathered\nparams peak"}
    axes = ("pp", "dp", "cp", "tp") if any(r.get("cp") for r in rows) else ("pp", "dp", "tp")  # cp only under CP
    for name in ("rank", "/".join(axes), *(heads.get(k, k) for k in kinds), "total"):
        t.add_column(name, justify="right")

    def cells(values: list[float]) -> list[str]:
        return [f"{b / 2**20:.2f}" for b in (*values, sum(values))]

    for r in rows:
        t.add_row(str(r["rank"]), "/".join(str(r[a]) for a in axes), *cells([r.get(k) or 0 for k in kinds]))
        if r["pp"] in pred:
            t.add_row("", "[dim]predicted[/]", *(f"[dim]{c}[/]" for c in cells([pred[r["pp"]].get(k, 0)
                                                                                  for k in kinds])))
    # the title a line of its own: as a table's title it would wrap at the table's width
    return Group(title, t, *(f"note: {n}" for n in notes))
