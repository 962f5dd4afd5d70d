"""Processes of one host sharing its cores: the forward/backward part of a step as ``plait.sim.shared`` runs a
schedule on a calibrated host whose processes outnumber its cores."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.plan.config import Layout, Training
from plait.plan.costs import Span, StageCosts
from plait.plan.host.compute import whole_layers
from plait.plan.host.shapes import CALIBRATION_BLOCKS, PIPELINE_CALIBRATION_MICROBATCHES
from plait.plan.model import Model
from plait.plan.pipeline import SPLIT_BACKWARD
from plait.plan.timing import chunk_costs

if TYPE_CHECKING:
    from plait.plan.host.costs import HostCosts


def shared_host(costs: HostCosts, model: Model, layout: Layout, precision: str, chunks: list[StageCosts], m: int,
                rounds: str | None) -> Span:
    """(makespan, mean busy wall time, slow-down of work every process does at once) of the forward/
    backward part on a calibrated host whose processes time-slice its effective cores (``shared_cores``;
    ``plait.sim.shared``)."""
    from plait.schedules import build_schedule
    from plait.sim.shared import simulate_shared

    shared = chunk_costs(costs.shared_twin(), model, layout, Training(1, precision=precision))
    p = costs.processes
    cores = shared_cores(chunks, shared, p, costs.cores)
    stretch = max(1.0, p / cores)
    per_stage = layout.tp * layout.dp * layout.cp  # the processes of one pipeline rank compute together
    if layout.pp == 1:  # every process computes all the time: shared speeds throughout
        c = shared[0]
        wall = m * (c.forward + c.backward)
        return Span(wall, wall, stretch)
    sched = build_schedule(layout.schedule, stages=layout.pp, microbatches=m, virtual=layout.virtual_stages,
                           rounds=rounds)
    cpu, comm = action_costs(chunks, layout.schedule in SPLIT_BACKWARD)
    r = simulate_shared(sched, cpu, comm, chunks[0].p2p, cores / per_stage, handoff(costs))
    return Span(r.makespan, sum(r.busy) / len(r.busy), stretch)


def handoff(costs: HostCosts) -> float:
    """How many times slower than the cores' sharing alone a calibrated host's pipeline ranks run while they
    outnumber its cores (``plait.sim.shared``'s ``handoff``): the slow-down at which the simulator gives the
    calibration's pipeline (``plait.calibrate.pipeline_block``: two-stage 1F1B pipelines of the larger
    calibration layer, the section's processes in pairs) its measured time over its twin's (the same work
    without hand-offs), the layers costed as measured (``LAYER``: alone, shared and the forward's share).
    1 where the profile timed no pipeline (the processes did not outnumber the cores, or an older profile)."""
    from plait.schedules import build_schedule
    from plait.sim.shared import simulate_shared

    sec = costs.section
    whole = whole_layers(sec)
    if whole is None or sec.pipeline_s <= 0 or sec.pipeline_twin_s <= 0 or sec.processes % 2:
        return 1.0
    alone, shared, share = whole.alone[-1], whole.shared[-1], whole.forward_share
    replicas = sec.processes // 2
    cores = min(float(sec.processes), costs.cores, sec.processes * alone / shared) / replicas
    b, s, h, *_ = CALIBRATION_BLOCKS[-1]
    p2p = sec.collective("p2p", 2, 4.0 * b * s * h)
    m = PIPELINE_CALIBRATION_MICROBATCHES
    sched = build_schedule("1f1b", stages=2, microbatches=m)
    cpu = {"F": [alone * share] * 2, "B": [alone * (1 - share)] * 2, "I": [0.0] * 2, "W": [0.0] * 2}
    comm = {kind: [0.0] * 2 for kind in "FBIW"}
    target = sec.pipeline_s / sec.pipeline_twin_s * m * shared  # the twin: m layers, every process at once

    def span(x: float) -> float:
        return simulate_shared(sched, cpu, comm, p2p, cores, x).makespan

    if span(1.0) >= target:
        return 1.0
    lo, hi = 1.0, 2.0
    while span(hi) < target and hi < 16:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-4:  # far finer than the pipeline's own measurement (a few percent)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < target else (lo, mid)
    return (lo + hi) / 2


def action_costs(chunks: list[StageCosts], split: bool) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(compute, TP communication): seconds per action kind (F, B, I, W) and chunk, as ``plait.sim.shared``
    runs a schedule on a calibrated host; ``split``: the schedule splits backwards into I and W (the input
    half is the backward less the weight gradients)."""
    cpu = {"F": [c.f_compute for c in chunks], "B": [c.b_compute + c.recompute for c in chunks],
           "I": [c.b_compute - c.w_compute + c.recompute if split else 0.0 for c in chunks],
           "W": [c.w_compute for c in chunks]}
    comm = {"F": [c.f_tp for c in chunks], "B": [c.b_tp for c in chunks], "I": [c.b_tp for c in chunks],
            "W": [0.0] * len(chunks)}
    return cpu, comm


def shared_cores(alone: list[StageCosts], shared: list[StageCosts], processes: int,
                 most: float | None = None) -> float:
    """The cores a calibrated host gives ``processes`` processes computing at once, counted in processes at
    their speed alone. ``alone`` and ``shared`` are the same chunks costed at the calibration's two speeds
    (``timing.chunk_costs``): each process computes ``shared/alone`` as fast as alone (speeds; the costs'
    ratio the other way up), so together they run like ``processes·shared/alone`` processes alone, at
    most ``processes`` and at most ``most`` (the host's cores over a process's threads: a calibration whose
    shared phase ran while the host was faster than its mean can read more). ``plait.sim.shared``
    time-slices that many cores."""
    alone_work = sum(c.f_compute + c.b_compute + c.recompute for c in alone)
    shared_work = sum(c.f_compute + c.b_compute + c.recompute for c in shared)
    p = float(processes)
    cap = p if most is None else min(p, most)
    return min(cap, p * alone_work / shared_work) if shared_work > 0 else cap
