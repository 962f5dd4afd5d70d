"""The rank side of a calibration: every section's kernels (alone, then shared) and collectives."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from plait.calibrate import collectives as coll
from plait.calibrate import kernels as k
from plait.calibrate import tp_block
from plait.plan import eager
from plait.plan.profile import COLLECTIVES, Curve, HostProfile, Rate, Section, TPBlock

TIMEOUT = datetime.timedelta(seconds=300)


def _pick(sizes: tuple, quick: bool) -> tuple:
    """The sizes a calibration measures: all, or every other one when ``quick``."""
    return sizes[::2] if quick else sizes


def total_steps(counts: list[int], quick: bool = False) -> int:
    """Progress ticks of a calibration of ``counts`` (for the progress bar): one per kernel figure of every
    kernel phase (alone at a thread count not measured before, shared with more than one process), per
    collective and group size, per TP layer timed."""
    kernels = (len(_pick(k.GEMM_SHAPES, quick)) + len(_pick(k.ATTENTION_SHAPES, quick))
               + len(_pick(k.ELEMENT_SIZES, quick)) + len(eager.CALIBRATION_BLOCKS) + 3)  # overhead, stream, optimizer
    total = 0
    threads: set[int] = set()
    for p in sorted(counts):
        total += kernels * ((_threads(p) not in threads) + (p > 1))
        threads.add(_threads(p))
        total += sum(len(COLLECTIVES) - (0 if g == 2 else 1) for g in coll.group_sizes(p))
        total += 2 * len(tp_block.group_sizes(p)) * len(eager.TP_CALIBRATION_BLOCKS)  # with and without SP
    return total


def _threads(processes: int) -> int:
    from plait.distributed.launch import worker_threads

    return worker_threads(processes)


def _kernels(device: torch.device, tick, quick: bool = False, optimizer: bool = True, shared: bool = False) -> dict:
    """This process's kernel figures (see ``plan.profile.Section``); ``quick``: every other size (both
    calibration blocks always); ``optimizer``: time the optimizer step too; ``shared``: every process is
    measuring at once, so each figure is the mean of its calls, not their median (``kernels.timed``)."""
    stat = "mean" if shared else "median"
    dtype = torch.float32
    out: dict = {"matmul": [], "attention": [], "elementwise": [], "block": []}
    for shape in _pick(k.GEMM_SHAPES, quick):
        out["matmul"].append((k.gemm_flops(shape), k.gemm_rate(shape, device, dtype, stat), 1 / 3))
        tick(f"matmul {shape[0]}x{shape[1]}x{shape[2]}")
    for s, h in _pick(k.ATTENTION_SHAPES, quick):
        rate, share = k.attention_rate(s, h, device, dtype, stat)
        out["attention"].append((float(s * h), rate, share))
        tick(f"attention s={s} d={h}")
    overhead = k.op_overhead(device, dtype, stat)
    out["overhead"] = overhead
    tick("kernel overhead")
    for n in _pick(k.ELEMENT_SIZES, quick):
        size, rate, share = k.elementwise_rate(n, overhead, device, dtype, stat)
        out["elementwise"].append((size, rate, share))
        tick(f"element-wise mix, {n} elements")
    out["stream"] = k.stream_bandwidth(device, stat)
    tick("memory bandwidth")
    for shape in eager.CALIBRATION_BLOCKS:
        out["block"].append(k.block_time(shape, device, dtype, stat))
        tick(f"decoder layer {'x'.join(map(str, shape[:3]))}")
    out["optimizer"] = k.optimizer_times(device) if optimizer else (0.0, 0.0)
    tick("optimizer step")
    return out


def _mean_figures(parts: list[dict]) -> dict:
    """The figures of several processes measured at once, averaged."""
    out: dict = {}
    for key in ("matmul", "attention", "elementwise", "block"):
        rows = zip(*(p[key] for p in parts), strict=True)
        out[key] = [(r[0][0], sum(x[1] for x in r) / len(r), sum(x[2] for x in r) / len(r)) for r in rows]
    for key in ("overhead", "stream"):
        out[key] = sum(p[key] for p in parts) / len(parts)
    out["optimizer"] = tuple(sum(x) / len(parts) for x in zip(*(p["optimizer"] for p in parts), strict=True))
    return out


def _rates(alone: dict, shared: dict) -> dict[str, Rate]:
    """Each kind's Rate; its forward share the mean of the sizes' (alone), the decoder layers' that of the
    largest block (the smaller one's rest is mostly kernels' fixed costs, which the forward dominates: its
    share came out 0.8 on a 2-core host, the larger's and real layers' 0.36-0.5)."""
    rates = {}
    for key in ("matmul", "attention", "elementwise", "block"):
        pts = sorted(zip(alone[key], shared[key], strict=True), key=lambda ab: ab[0][0])
        share = pts[-1][0][2] if key == "block" else sum(a[2] for a, _ in pts) / len(pts)
        rates[key] = Rate(tuple(a[0] for a, _ in pts), tuple(a[1] for a, _ in pts), tuple(b[1] for _, b in pts),
                          share)
    return rates


def _probe(world_group, device: torch.device) -> float:
    """The host's speed now (``kernels.reference_rate``) on rank 0 while every other rank waits (collective);
    0.0 on the other ranks."""
    dist.barrier(group=world_group)
    rate = k.reference_rate(device) if dist.get_rank() == 0 else 0.0
    dist.barrier(group=world_group)
    return rate


AloneAt = dict[int, tuple[dict | None, float]]  # threads -> (figures of one process alone, the speed then)


def measure_section(p: int, groups: dict, world_group, device: torch.device, tick, alone_at: AloneAt,
                    quick: bool = False) -> tuple[Section | None, list[float], list[float]]:
    """The section of ``p`` processes (collective over the world): the Section on rank 0 (else None), the
    host's speed probed before, between and after its phases (kernels alone, kernels shared, collective
    curves, TP layers), and the speed during each of the four phases (the mean of the probes either side).

    ``alone_at`` maps a thread count to the kernel figures of one process alone at it and the speed they were
    measured at; a section whose thread count an earlier one measured takes those (the same measurement: one
    process, the same threads, the others waiting) and measures it once more only where it is new. One
    process measures nothing shared: its shared figures are those alone."""
    rank = dist.get_rank()
    threads = _threads(p)
    torch.set_num_threads(threads)
    probes = [_probe(world_group, device)]
    if threads not in alone_at:
        figures = _kernels(device, tick, quick) if rank == 0 else None
        probes.append(_probe(world_group, device))
        alone_at[threads] = (figures, (probes[-2] + probes[-1]) / 2)
    alone, alone_speed = alone_at[threads]
    if p == 1:
        return (_make_section(p, alone, alone, {}, {}) if rank == 0 else None), probes, [alone_speed] * 4
    mine = _kernels(device, tick if rank == 0 else (lambda what: None), quick, optimizer=False, shared=True) \
        if rank < p else None
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine, group=world_group)
    shared = _mean_figures([x for x in parts[:p]]) if rank == 0 else None
    probes.append(_probe(world_group, device))
    quiet = tick if rank == 0 else (lambda what: None)
    curves = coll.curves(p, groups, world_group, device, quiet, quick)
    probes.append(_probe(world_group, device))
    layers = tp_block.measure_all(p, groups, world_group, device, quiet, quick)
    probes.append(_probe(world_group, device))
    phases = [alone_speed] + [(a + b) / 2 for a, b in zip(probes[-4:], probes[-3:], strict=False)]
    return (_make_section(p, alone, shared, curves, layers) if rank == 0 else None), probes, phases


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
    section comes with the speed during its four phases (alone, shared, curves, TP; ``measure_section``),
    and each phase is scaled by the mean speed over its own (``Section.at_speed``): the host's speed drifts
    over seconds to minutes, and a section measured in a slow minute would otherwise cost every layout of
    that process count slow."""
    mean = sum(probes) / len(probes)
    out = {p: sec.at_speed(*(mean / x for x in phases)) for p, (sec, phases) in sections.items()}
    return out, mean, (max(probes) - min(probes)) / mean


Measured = tuple[Section, list[float], list[float]]  # a section, the speed probes around its phases, the
# speed during each of its four phases (``measure_section``)


def measure_world(processes: int, ticks: str | None, alone_at: AloneAt) -> tuple[Measured, AloneAt] | None:
    """Entry of each rank of a launch of ``processes`` processes (``plait.distributed.launch.run_world``):
    initialises the default group if needed and measures the section of that many processes, as
    ``plait train`` runs them: in a world of their own. Returns, on rank 0, the section as measured and
    ``alone_at`` with what this launch added (for the next launch)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=TIMEOUT)
    measured = _measure_sections([processes], ticks, alone_at)
    return (measured[processes], alone_at) if measured else None


def _measure_sections(counts: list[int], ticks: str | None, alone_at: AloneAt,
                      quick: bool = False) -> dict[int, Measured]:
    """Every section of ``counts`` measured in the current world (every rank calls it; ranks beyond a
    section wait); on rank 0 each as ``measure_section`` returns it, else {}."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
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
        measured = {p: measure_section(p, groups, world_group, device, tick, alone_at, quick) for p in sorted(counts)}
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
    measured = _measure_sections(counts, ticks, {}, quick)
    return assemble(measured, facts) if dist.get_rank() == 0 else None
