"""Where a published source's step goes wrong: per micro-batch or per step.

Runs of one source that share the model, the GPUs, the global batch, the training settings and every layout
field but the data-parallel degree differ only in how many micro-batches each pipeline runs a step (``m``). Over
such a group a pipelined step is close to ``a·m + b``: ``a`` what each micro-batch costs on the busiest stage,
``b`` what a step pays once (the pipeline's fill and drain, the gradients' reduction, the optimizer). Fitting that
line to the published step times and to the predicted ones, by least squares over the group, says which of the
two the model misses: a slope off means a micro-batch is costed wrong (a kernel, a collective inside the layers),
an intercept off with the slope right means something paid once a step (the bubble, the step's end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from plait.plan.estimate import estimate
from plait.plan.published import PublishedRun


@dataclass(frozen=True)
class Split:
    """One group's fit, ``seconds = per_microbatch·m + per_step``, published and predicted (constants as
    shipped)."""

    source: str
    label: str  # the group's model and layout, without its data-parallel degree
    microbatches: tuple[int, ...]  # m of each run, in the set's order
    published: tuple[float, float]  # (seconds per micro-batch, seconds per step)
    predicted: tuple[float, float]

    @property
    def slope_ratio(self) -> float:
        """Predicted over published seconds per micro-batch."""
        return self.predicted[0] / self.published[0]

    @property
    def step_gap_s(self) -> float:
        """Predicted minus published seconds per step (negative: the model misses something paid once a
        step)."""
        return self.predicted[1] - self.published[1]


def line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) through ``points`` (x, y); at least two distinct x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("line needs at least two distinct x")
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def _key(run: PublishedRun) -> tuple[str, ...]:
    """What a group's runs share: everything but the data-parallel degree and the GPU count that follows."""
    layout = tuple((f.name, getattr(run.layout, f.name)) for f in fields(run.layout) if f.name != "dp")
    c = run.cluster
    return (run.source, repr(run.model), c.gpu.name, str(c.gpus_per_node), repr(c.interconnect), c.attention,
            repr(layout), repr(run.training))


def microbatch_splits(rs: Sequence[PublishedRun], least: int = 3) -> list[Split]:
    """Each group of ``rs`` whose runs differ only in their data-parallel degree and take at least ``least``
    distinct micro-batch counts, fitted published and predicted (``Split``), in the set's order."""
    groups: dict[tuple[str, ...], list[PublishedRun]] = {}
    for r in rs:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for g in groups.values():
        estimates = [estimate(r.model, r.cluster, r.layout, r.training) for r in g]
        ms = tuple(e.microbatches for e in estimates)
        if len(set(ms)) < least:
            continue
        lay = g[0].layout
        label = (f"{g[0].model.name} t{lay.tp} p{lay.pp}" + (f" v{lay.virtual_stages}" if lay.virtual_stages > 1
                 else "") + f" mbs{lay.microbatch_size} batch {g[0].training.global_batch}")
        out.append(Split(g[0].source, label, ms, line([(m, r.step_s) for m, r in zip(ms, g, strict=True)]),
                         line([(m, e.step_time_s) for m, e in zip(ms, estimates, strict=True)])))
    return out


def format_splits(splits: Sequence[Split]) -> str:
    lines = ["per micro-batch and per step (runs of one layout at several DP degrees; seconds = a x micro-batches "
             "+ b, least squares; constants as shipped):"]
    for s in splits:
        (pa, pb), (ma, mb) = s.published, s.predicted
        lines.append(f"  {s.source[:28]:28} {s.label:38} m {','.join(map(str, s.microbatches)):21} published "
                     f"{pa:.4f} s/mb + {pb:6.2f} s, predicted {ma:.4f} + {mb:6.2f}: a x{s.slope_ratio:.3f}, "
                     f"b {s.step_gap_s:+.2f} s")
    return "\n".join(lines)
