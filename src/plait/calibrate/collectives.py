"""Collective timings: all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point over groups of
consecutive ranks, every group of a size busy at once (as the TP groups of a run are)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from plait.devices import synchronize
from plait.distributed.collectives import collective
from plait.plan.host.figures import COLLECTIVES
from plait.tensor_parallel import comms

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # bytes of the full tensor (fp32)
BUDGET_S = 0.04


def group_sizes(processes: int) -> list[int]:
    """Group sizes measured for a section of ``processes`` ranks: every divisor >= 2."""
    return [g for g in range(2, processes + 1) if processes % g == 0]


def make_groups(counts: list[int]) -> dict[tuple[int, int], list]:
    """(processes, group size) -> the groups [0, g), [g, 2g), ... of the first ``processes`` ranks.

    Collective: every rank of the world creates every group, in the same order.
    """
    out: dict[tuple[int, int], list] = {}
    for p in counts:
        for g in group_sizes(p):
            out[(p, g)] = [dist.new_group(list(range(i, i + g))) for i in range(0, p, g)]
    return out


def _one(op: str, nbytes: int, group, size: int, rank_in: int, device: torch.device):
    """A closure running ``op`` once on a tensor of ``nbytes`` (in full) over ``group``."""
    n = max(size, nbytes // 4 // size * size)  # elements, divisible by the group size
    full = torch.ones(n, device=device)
    part = torch.ones(n // size, device=device)
    if op == "all_reduce":  # the runtime's own collectives (tensor_parallel.comms), copies included
        return lambda: comms.all_reduce(full, group)
    if op == "all_gather":
        return lambda: comms.all_gather(part, 0, group)
    if op == "reduce_scatter":
        return lambda: comms.reduce_scatter(full, 0, group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: collective("calibration's timed all-to-all", group,
                                  lambda: dist.all_to_all_single(out, full, group=group))
    peer = rank_in ^ 1  # p2p: pairs (0, 1), (2, 3), ... of the group, one sends and the other receives
    ranks = dist.get_process_group_ranks(group)
    if peer >= size:
        return lambda: None
    if rank_in % 2 == 0:
        return lambda: dist.send(full, ranks[peer], group=group)
    return lambda: dist.recv(full, ranks[peer], group=group)


def measure(op: str, nbytes: int, groups: list, processes: int, world_group, device: torch.device) -> float:
    """Seconds of one ``op`` of ``nbytes`` on every group at once (slowest rank), or 0.0 on idle ranks.

    Collective over the whole world: the ranks beyond ``processes`` wait at the barriers.
    """
    rank = dist.get_rank()
    mine = next((g for g in groups if rank in dist.get_process_group_ranks(g)), None) if rank < processes else None
    fn = None
    reps = torch.zeros(1, device=device)
    if mine is not None:
        members = dist.get_process_group_ranks(mine)
        fn = _one(op, nbytes, mine, len(members), members.index(rank), device)
        fn()  # warm-up (and connection set-up)
        t0 = time.perf_counter()
        fn()  # every member calls it as often as the others: a collective must match on every rank
        reps[0] = max(3, min(200, int(BUDGET_S / max(time.perf_counter() - t0, 1e-6))))
    collective("calibration's broadcast of a collective's repetitions", world_group,  # the same on every group
               lambda: dist.broadcast(reps, src=0, group=world_group))
    collective("calibration's barrier before a timed collective", world_group,
               lambda: dist.barrier(group=world_group))
    elapsed = 0.0
    if fn is not None:
        t0 = time.perf_counter()
        for _ in range(int(reps[0])):
            fn()
        synchronize(device)
        elapsed = (time.perf_counter() - t0) / int(reps[0])
    worst = torch.tensor([elapsed], device=device)
    collective("calibration's all-reduce of a timed collective's slowest time", world_group,
               lambda: dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=world_group))
    return float(worst[0])


def curves(processes: int, groups: dict, world_group, device: torch.device, tick=lambda what: None,
           quick: bool = False) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """(op, group size) -> (bytes, seconds) for a section of ``processes`` ranks (collective); ``quick``:
    every other size."""
    sizes = SIZES[::2] if quick else SIZES
    out = {}
    for g in group_sizes(processes):
        for op in COLLECTIVES:
            if op == "p2p" and g != 2:
                continue  # a message between two ranks: pairs only
            secs = [measure(op, b, groups[(processes, g)], processes, world_group, device) for b in sizes]
            out[(op, g)] = ([float(b) for b in sizes], secs)
            tick(f"{op} over {g} of {processes} processes")
    return out
