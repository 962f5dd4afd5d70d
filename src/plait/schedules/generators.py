"""Classic schedules: GPipe, 1F1B, interleaved 1F1B (Megatron) and looped BFS.

Each generator returns ``actions[rank]`` for a placement fixed by ``build_schedule``; parameter checks
live there. Notation: ``P`` ranks, ``M`` micro-batches, ``V`` chunks per rank.
"""

from __future__ import annotations

from plait.schedules.actions import Action


def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards; with ``M = 1`` the naive schedule."""
    return [[Action(k, r, mb) for k in "FB" for mb in range(m)] for r in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): warm-up of ``P-r-1`` forwards, then alternate.

    Rank ``r`` keeps at most ``min(P - r, M)`` micro-batches of activations.
    """
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        row = [Action("F", r, mb) for mb in range(warm)]
        for k in range(m - warm):
            row += [Action("F", r, warm + k), Action("B", r, k)]
        row += [Action("B", r, k) for k in range(m - warm, m)]
        out.append(row)
    return out


def interleaved_order(p: int, m: int, v: int, reverse: bool) -> list[tuple[int, int]]:
    """Megatron's depth-first order of (local chunk, micro-batch) on every rank.

    Micro-batches go in groups of ``P`` (of ``M`` when ``M < P``): for each group, chunk 0 runs the
    whole group, then chunk 1, ... (backwards: chunk ``V-1`` first).
    """
    order: list[tuple[int, int]] = []
    for g0 in range(0, m, p):
        group = range(g0, min(g0 + p, m))
        for j in range(v):
            chunk = v - 1 - j if reverse else j
            order.extend((chunk, mb) for mb in group)
    return order


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2): ``V`` chunks per rank, chunk ``c`` on rank ``c % P``.

    Warm-up on rank ``r`` is ``2(P-r-1) + (V-1)·min(P, M)`` chunk-forwards (capped at ``V·M``), then one
    forward and one backward alternate. Bubble ``(P-1)/(V·M+P-1)`` when ``M % P == 0``.

    Megatron requires ``M % P == 0`` (or ``M <= P``). Otherwise plait generates the schedule for ``M``
    rounded up to a multiple of ``P`` and drops the surplus micro-batches: a subsequence of a
    deadlock-free in-order schedule stays deadlock-free (its dependencies are a subset).
    """
    if m > p and m % p:
        full = interleaved_1f1b(p, -(-m // p) * p, v)
        return [[a for a in row if a.microbatch < m] for row in full]
    fwd, bwd = interleaved_order(p, m, v, False), interleaved_order(p, m, v, True)
    total = m * v
    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * min(p, m), total)

        def f(k: int, r: int = r) -> Action:
            return Action("F", fwd[k][0] * p + r, fwd[k][1])

        def b(k: int, r: int = r) -> Action:
            return Action("B", bwd[k][0] * p + r, bwd[k][1])

        row = [f(k) for k in range(warm)]
        for k in range(total - warm):
            row += [f(warm + k), b(k)]
        row += [b(k) for k in range(total - warm, total)]
        out.append(row)
    return out


def looped_bfs(p: int, m: int, v: int) -> list[list[Action]]:
    """Looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"): round-robin chunks; every
    micro-batch goes through a chunk before the rank moves to its next chunk, forwards then backwards.
    """
    out = []
    for r in range(p):
        chunks = [j * p + r for j in range(v)]
        row = [Action("F", c, mb) for c in chunks for mb in range(m)]
        row += [Action("B", c, mb) for c in reversed(chunks) for mb in range(m)]
        out.append(row)
    return out
