"""The rank side of a calibration: every section's kernels (alone and shared, in pairs) and collectives."""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from plait.calibrate import collectives as coll
from plait.calibrate import kernels as k
from plait.calibrate import pipeline_block, tp_block, usable_cores
from plait.devices import synchronize
from plait.distributed.collectives import collective
from plait.distributed.default_group import default_device, ensure_default_group
from plait.plan.host import shapes
from plait.plan.host.figures import BLOCK, COLLECTIVES, LAYER, SELECTIVE, Curve, Rate, TPBlock
from plait.plan.host.profile import HostProfile, Section

TIMEOUT = datetime.timedelta(seconds=300)


def _pick(sizes: tuple, quick: bool) -> tuple:
    """The sizes a calibration measures: all, or every other one when ``quick``."""
    return sizes[::2] if quick else sizes


def total_steps(counts: list[int], quick: bool = False) -> int:
    """Progress ticks of a calibration of ``counts`` (for the progress bar): one per kernel figure of every
    section (alone, or alone and shared in pairs), per collective and group size, per TP layer timed, per
    pipeline timed."""
    kernels = (len(_pick(k.GEMM_SHAPES, quick)) + len(_pick(k.ATTENTION_SHAPES, quick))
               + len(_pick(k.ELEMENT_SIZES, quick)) + len(shapes.CALIBRATION_BLOCKS) + 3)  # overhead, stream, optimizer
    total = 0
    for p in sorted(counts):
        total += kernels
        total += sum(len(COLLECTIVES) - (0 if g == 2 else 1) for g in coll.group_sizes(p))
        total += 2 * len(tp_block.group_sizes(p)) * len(shapes.TP_CALIBRATION_BLOCKS)  # with and without SP
        total += pipeline_block.oversubscribed(p, _threads(p), usable_cores())
    return total


def _threads(processes: int) -> int:
    from plait.distributed.launch import worker_threads

    return worker_threads(processes)


Figure = tuple[float, ...]
Measure = Callable[[k.Kernel], tuple[Figure, Figure]]  # a kernel -> its figures (alone, shared)
PAIRS = 2  # alone-then-shared pairs a kernel is timed in when several processes share the cores


def _kernels(device: torch.device, tick, measure: Measure, quick: bool = False) -> tuple[dict, dict]:
    """This process's kernel figures (see ``plan.host.profile.Section``), (alone, shared), as ``measure`` takes
    them; ``quick``: every other size (both calibration blocks always)."""
    dtype = torch.float32
    kinds = ("matmul", "attention", "elementwise", BLOCK, "overhead", "stream")
    alone: dict = {key: [] for key in kinds}
    shared: dict = {key: [] for key in kinds}

    def take(key: str, kernel: k.Kernel) -> None:
        a, s = measure(kernel)
        alone[key].append(a)
        shared[key].append(s)
        tick(kernel.label)

    for shape in _pick(k.GEMM_SHAPES, quick):
        take("matmul", k.gemm(shape, device, dtype))
    for s, h in _pick(k.ATTENTION_SHAPES, quick):
        take("attention", k.attention(s, h, device, dtype))
    take("overhead", k.op_overhead(device, dtype))
    for n in _pick(k.ELEMENT_SIZES, quick):
        take("elementwise", k.elementwise(n, device, dtype))
    take("stream", k.stream(device))
    for shape in shapes.CALIBRATION_BLOCKS:
        take(BLOCK, k.block(shape, device, dtype))
    for out in (alone, shared):
        out["overhead"], out["stream"] = out["overhead"][0][0], out["stream"][0][0]  # one figure of one value
    return alone, shared


def _alone(device: torch.device) -> Measure:
    """One process alone: each figure alone, and the same as its shared one (nothing shares the cores)."""
    def measure(kernel: k.Kernel) -> tuple[Figure, Figure]:
        figure = k.measure_alone(kernel, device)
        return figure, figure
    return measure


def paired(device: torch.device, group) -> Measure:
    """Every process of ``group`` at once (collective over it; the figures are rank 0's). Each kernel is timed
    in ``PAIRS`` pairs: rank 0 alone for its budget's share (the others waiting), then every process at it
    at once for half as many rounds (with twice the processes the cores hold, about as long), one call
    after another, each call's shared seconds the group's span over its rounds (the slowest process's: a
    process the scheduler favoured finishes early, and the others then run faster; the span is what the
    work of all of them took). The figure shared is the pairs' smaller: something else on the host only ever
    slows a window down, and one slowed pair of two would move a mean by half of it (a decoder layer's
    shared seconds over alone read 1.33 in one calibration of two processes, where eleven others read
    0.99-1.04); the figure alone is the median of its calls for the same reason. Alone and shared a moment
    apart see the same machine, so the host's drift between them, over seconds, does not reach their
    ratio. (Tried instead: sweeps over all the kernels, alone then shared, with no barrier between kernels
    shared. Each process's own times averaged, four processes on two cores read 1.66-2.04 effective cores
    over five calibrations, against 1.61-1.72 here; the slowest process's own times, 1.16-1.37: the slowest
    of four unaligned samples.)"""
    rank = dist.get_rank()

    def measure(kernel: k.Kernel) -> tuple[Figure, Figure]:
        k.warm_up(kernel, device, rounds=1)  # every process at once; the pairs' rounds are medians and spans
        alone: k.Rounds = []
        shared: k.Rounds = []
        for _ in range(PAIRS):
            count = torch.zeros(1, dtype=torch.int64, device=device)
            collective("calibration's barrier before a kernel timed alone", group, lambda: dist.barrier(group=group))
            if rank == 0:
                mine = k.time_rounds(kernel, device, kernel.budget / PAIRS, 2)
                alone += mine
                count += (len(mine) + 1) // 2
            collective("calibration's broadcast of a kernel's shared rounds", group,
                       partial(dist.broadcast, count, src=0, group=group))
            shared.append(_together(kernel, device, group, int(count.item())))
        together = kernel.figure(shared, min)
        return (kernel.figure(alone, statistics.median) if rank == 0 else together), together  # only 0 timed alone

    return measure


def _together(kernel: k.Kernel, device: torch.device, group, rounds: int) -> dict[str, float]:
    """Each of ``kernel``'s calls ``rounds`` times on every process of ``group`` at once, one call after the
    other: its seconds are the group's span over ``rounds``, the parts it reports this process's mean."""
    out: dict[str, float] = {}
    for name, call in kernel.calls.items():
        parts: dict[str, float] = {}
        collective("calibration's barrier before a kernel timed shared", group, lambda: dist.barrier(group=group))
        t0 = time.perf_counter()
        for _ in range(rounds):
            for part, seconds in (call() or {}).items():
                parts[part] = parts.get(part, 0.0) + seconds
        synchronize(device)
        span = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        collective("calibration's all-reduce of a shared kernel's span", group,
                   partial(dist.all_reduce, span, op=dist.ReduceOp.MAX, group=group))
        out[name] = float(span.item()) / rounds
        out.update({part: seconds / rounds for part, seconds in parts.items()})
    return out


def _rates(alone: dict, shared: dict) -> dict[str, Rate]:
    """Each kind's Rate; its forward share the mean of the sizes' (alone), the decoder layers' that of the
    largest block (the smaller one's rest is mostly kernels' fixed costs, which the forward dominates, so its
    share stands for no real layer's). The decoder layers' whole seconds, alone and shared as measured, are
    the ``layer`` kind; what recomputing their attention cores added, alone, the ``recomputed_core`` kind,
    shared as the whole layer shared the cores (its shared figure the alone one times the layer's shared over
    alone: a difference of two spans of a few rounds each is too noisy to be read shared; docs/planner-log.md,
    entry 22)."""
    rates = {}
    for key in ("matmul", "attention", "elementwise", BLOCK):
        pts = sorted(zip(alone[key], shared[key], strict=True), key=lambda ab: ab[0][0])
        share = pts[-1][0][2] if key == BLOCK else sum(a[2] for a, _ in pts) / len(pts)
        rates[key] = Rate(tuple(a[0] for a, _ in pts), tuple(a[1] for a, _ in pts), tuple(b[1] for _, b in pts),
                          share)
        if key == BLOCK:
            rates[LAYER] = Rate(tuple(a[0] for a, _ in pts), tuple(a[3] for a, _ in pts),
                                tuple(b[3] for _, b in pts), pts[-1][0][4])
            rates[SELECTIVE] = Rate(tuple(a[0] for a, _ in pts), tuple(a[5] for a, _ in pts),
                                    tuple(a[5] * (b[3] / a[3]) for a, b in pts), pts[-1][0][4])
    return rates


def _probe(world_group, device: torch.device) -> float:
    """The host's speed now (``kernels.reference_rate``) on rank 0 while every other rank waits (collective);
    0.0 on the other ranks."""
    collective("calibration's barrier before probing the host's speed", world_group,
               lambda: dist.barrier(group=world_group))
    rate = k.reference_rate(device) if dist.get_rank() == 0 else 0.0
    collective("calibration's barrier after probing the host's speed", world_group,
               lambda: dist.barrier(group=world_group))
    return rate


def measure_section(p: int, groups: dict, world_group, device: torch.device, tick,
                    quick: bool = False) -> tuple[Section | None, list[float], list[float]]:
    """The section of ``p`` processes (collective over the world): the Section on rank 0 (else None), the
    host's speed probed before, between and after its phases, and the speed during each of its three phases
    (kernels alone and shared with the optimizer step, collective curves, TP layers: the mean of the probes
    either side; one process has only the first).

    One process measures nothing shared: its shared figures are those alone. With more, every kernel is
    timed alone and shared in pairs (``paired``), and the optimizer step alone, the others waiting."""
    rank = dist.get_rank()
    torch.set_num_threads(_threads(p))
    quiet = tick if rank == 0 else (lambda what: None)
    probes = [_probe(world_group, device)]
    figures: tuple[dict, dict] | None = None
    if rank < p:
        measure = _alone(device) if p == 1 else paired(device, groups[(p, p)][0])
        figures = _kernels(device, quiet, measure, quick)
    collective("calibration's barrier before timing the optimizer step", world_group,
               lambda: dist.barrier(group=world_group))
    optimizer = k.optimizer_times(device) if rank == 0 else (0.0, 0.0)
    quiet("optimizer step")
    probes.append(_probe(world_group, device))
    speed = (probes[-2] + probes[-1]) / 2
    pipeline = (0.0, 0.0)
    if p == 1:
        curves: dict = {}
        layers: dict = {}
    else:
        curves = coll.curves(p, groups, world_group, device, quiet, quick)
        probes.append(_probe(world_group, device))
        layers = tp_block.measure_all(p, groups, world_group, device, quiet, quick)
        if pipeline_block.oversubscribed(p, _threads(p), usable_cores()):
            pipeline = pipeline_block.measure(p, world_group, device,
                                              pipeline_block.BUDGET_S / 4 if quick else pipeline_block.BUDGET_S)
            quiet(f"pipeline of {p} processes")
        probes.append(_probe(world_group, device))
    phases = [speed] * 3
    if p > 1:
        phases[1:] = [(a + b) / 2 for a, b in zip(probes[1:-1], probes[2:], strict=True)]
    if rank != 0:
        return None, probes, phases
    assert figures is not None
    alone, shared = figures
    section = _make_section(p, {**alone, "optimizer": optimizer}, shared, curves, layers)
    return replace(section, pipeline_s=pipeline[0], pipeline_twin_s=pipeline[1]), probes, phases


def _make_section(p: int, alone: dict | None, shared: dict | None, curves: dict, layers: dict) -> Section:
    assert alone is not None and shared is not None  # measured on rank 0
    blocks = tuple(TPBlock(shape, g, sp, secs, twin) for (shape, g, sp), (secs, twin) in sorted(layers.items()))
    return Section(p, _threads(p), _rates(alone, shared), alone["overhead"], shared["stream"],
                   {key: Curve(tuple(b), tuple(s)) for key, (b, s) in curves.items()}, alone["optimizer"][0], blocks,
                   alone["optimizer"][1])


def at_mean_speed(sections: dict[int, tuple[Section, list[float]]],
                  probes: list[float]) -> tuple[dict[int, Section], float, float]:
    """Every section brought to the host's mean speed over the calibration, with that speed (the mean of
    ``probes``, FLOP/s of ``kernels.reference_rate``) and how far it moved ((max - min) / mean). Each
    section comes with the speed during its three phases (kernels, curves, TP; ``measure_section``),
    and each phase is scaled by the mean speed over its own (``Section.at_speed``): the host's speed drifts
    over seconds to minutes, and a section measured in a slow minute would otherwise cost every layout of
    that process count slow."""
    mean = sum(probes) / len(probes)
    out = {p: sec.at_speed(*(mean / x for x in phases)) for p, (sec, phases) in sections.items()}
    return out, mean, (max(probes) - min(probes)) / mean


Measured = tuple[Section, list[float], list[float]]  # a section, the speed probes around its phases, the
# speed during each of its three phases (``measure_section``)


def measure_world(processes: int, ticks: str | None) -> Measured | None:
    """Entry of each rank of a launch of ``processes`` processes (``plait.distributed.launch.run_world``):
    initialises the default group if needed and measures the section of that many processes, as
    ``plait train`` runs them: in a world of their own. Returns the section as measured on rank 0."""
    ensure_default_group(TIMEOUT.total_seconds())
    measured = _measure_sections([processes], ticks)
    return measured[processes] if measured else None


def _measure_sections(counts: list[int], ticks: str | None, quick: bool = False) -> dict[int, Measured]:
    """Every section of ``counts`` measured in the current world (every rank calls it; ranks beyond a
    section wait); on rank 0 each as ``measure_section`` returns it, else {}."""
    device = default_device()
    world_group = dist.group.WORLD
    counts = [p for p in counts if p <= dist.get_world_size()]
    groups = coll.make_groups(counts)
    rank = dist.get_rank()
    log = Path(ticks) if ticks and rank == 0 else None

    def tick(what: str) -> None:
        if log is not None:
            with log.open("a") as f:
                f.write(what + "\n")

    threads = torch.get_num_threads()
    try:
        measured = {p: measure_section(p, groups, world_group, device, tick, quick) for p in sorted(counts)}
    finally:
        torch.set_num_threads(threads)
    return {p: (s, probes, phases) for p, (s, probes, phases) in measured.items() if s is not None}


def assemble(measured: dict[int, Measured], facts: dict) -> HostProfile:
    """The profile of sections measured in that order (process count -> ``Measured``), every section at
    the mean of all their probes' speeds (``at_mean_speed``)."""
    probes = [x for _, r, _ in measured.values() for x in r]  # in the order measured
    sections, speed, moved = at_mean_speed({p: (s, phases) for p, (s, _, phases) in measured.items()}, probes)
    return HostProfile({**facts, "speed_flops": speed, "speed_moved": moved, "speed_probes": probes}, sections)


def measure_in_world(counts: list[int], ticks: str | None, facts: dict, quick: bool = False) -> HostProfile | None:
    """Measure ``counts`` in the current world (every rank calls it; ranks beyond a section wait) and return
    the profile on rank 0. ``quick`` measures every other size (for tests: a few seconds instead of about
    ten). ``plait calibrate`` measures each count in a launch of its own instead (``measure_world``)."""
    measured = _measure_sections(counts, ticks, quick)
    return assemble(measured, facts) if dist.get_rank() == 0 else None
