"""Classic schedules: GPipe, 1F1B, interleaved 1F1B (Megatron) and looped BFS.

Each generator returns ``actions[rank]`` for a placement fixed by ``build_schedule``; parameter checks
live there. Notation: ``P`` ranks, ``M`` micro-batches, ``V`` chunks per rank.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.schedules.actions import Action

#: (global chunk, micro-batch) pairs of one rank, in the order it runs them
Order = list[tuple[int, int]]


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


#: How interleaved schedules group micro-batches into rounds when ``M % P != 0`` (see ``round_widths``).
ROUNDS = ("equal", "padded")


def round_widths(p: int, m: int, rounds: str = "equal") -> list[int]:
    """Micro-batches per round of a depth-first (interleaved) schedule, in order.

    A round is a group of consecutive micro-batches that goes through a rank's chunk 0, then its chunk
    1, ... before the next round starts. ``M <= P``: one round of ``M``. Otherwise:

    * ``"equal"``: ``n = floor(M/P)`` rounds whose widths differ by at most one, wider ones first
      (``M = 10, P = 4``: 5, 5; ``M = 9``: 5, 4). Every round is at least ``P`` wide, so a rank's next
      chunk never waits for data and the bubble is ``(P-1)/(V·M+P-1)``. This is PyTorch's
      ``ScheduleInterleaved1F1B`` whenever ``M % n == 0``, which it requires; wider-first keeps the
      warm-up sized by the first round, which covers every later one.
    * ``"padded"``: rounds of ``P`` and a last partial one (``M = 10, P = 4``: 4, 4, 2), Megatron's
      grouping. The short round stalls the pipeline, but a rank holds fewer micro-batches, because
      the warm-up is sized by a round of ``P`` instead of one up to ``2P-1`` wide.
    """
    if m <= p:
        return [m]
    if rounds == "padded":
        return [p] * (m // p) + ([m % p] if m % p else [])
    n = m // p
    q, rem = divmod(m, n)
    return [q + 1] * rem + [q] * (n - rem)


def depth_first_order(widths: list[int], v: int, reverse: bool) -> list[tuple[int, int]]:
    """(local chunk, micro-batch) in Megatron's depth-first order: each round through chunk 0, 1, ...

    Backwards (``reverse``) take the chunks from ``V-1`` down to 0.
    """
    order: list[tuple[int, int]] = []
    g0 = 0
    for width in widths:
        group = range(g0, g0 + width)
        for j in range(v):
            chunk = v - 1 - j if reverse else j
            order.extend((chunk, mb) for mb in group)
        g0 += width
    return order


def drop_surplus(rows: list[list[Action]], m: int) -> list[list[Action]]:
    """Delete the steps of micro-batches ``>= m``. An in-order schedule that never deadlocks stays so
    without them: the dependency graph of what remains is a subgraph of the original one."""
    return [[a for a in row if a.microbatch < m] for row in rows]


def warmup_forwards(p: int, r: int, m: int, v: int, first_round: int, hops: int) -> int:
    """Chunk-forwards rank ``r`` runs before its first backward in a depth-first schedule:
    ``(V-1)·w + hops·(P-r-1)``, capped at ``V·M`` (``hops`` 2 for interleaved 1F1B, 1 for ZB1P)."""
    return min((v - 1) * first_round + hops * (p - r - 1), v * m)


def depth_first_peaks(p: int, m: int, v: int, rounds: str, deferred_weights: bool) -> list[float]:
    """Per rank, the most micro-batches held at once (a chunk counts ``1/V``) by ``interleaved_1f1b``
    (``deferred_weights=False``) or ``zero_bubble.zb_h1``, counted from the order alone, without building it.

    A rank holds a micro-batch from its F to its B (or W). After the warm-up each F is followed by one
    release (B; in ZB1P a W, from the ``r``-th step on), so the count peaks at ``warm + 1`` (``+ r``
    deferred weight passes in ZB1P), or at ``V·M`` if every forward runs first. Exact for ``"equal"``
    rounds and for any ``M`` that is a multiple of ``P`` or at most ``P``.
    """
    w0 = round_widths(p, m, rounds)[0]
    out = []
    for r in range(p):
        warm = warmup_forwards(p, r, m, v, w0, 1 if deferred_weights else 2)
        out.append(min(warm + 1 + (r if deferred_weights else 0), v * m) / v)
    return out


def depth_first(p: int, m: int, v: int, rounds: str, hops: int,
                row: Callable[[int, int, Order, Order], list[Action]]) -> list[list[Action]]:
    """The rows of a depth-first schedule of ``V`` chunks per rank, chunk ``c`` on rank ``c % P``, micro-batches
    in rounds (``round_widths``): rank ``r``'s row is ``row(r, warm, fwd, bwd)``, ``warm`` its warm-up
    chunk-forwards (``warmup_forwards`` with ``hops``), ``fwd`` and ``bwd`` the (global chunk, micro-batch) pairs
    of its forwards and backwards in depth-first order. ``rounds="padded"`` with ``M % P != 0``: the schedule of ``M``
    rounded up to a multiple of ``P``, its surplus micro-batches dropped (``drop_surplus``)."""
    if rounds == "padded" and m > p and m % p:
        return drop_surplus(depth_first(p, -(-m // p) * p, v, rounds, hops, row), m)
    widths = round_widths(p, m, rounds)
    fwd, bwd = depth_first_order(widths, v, False), depth_first_order(widths, v, True)
    return [row(r, warmup_forwards(p, r, m, v, widths[0], hops), [(c * p + r, mb) for c, mb in fwd],
                [(c * p + r, mb) for c, mb in bwd]) for r in range(p)]


def interleaved_1f1b(p: int, m: int, v: int, rounds: str = "equal") -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2): ``V`` chunks per rank, chunk ``c`` on rank ``c % P``.

    Micro-batches run depth first in rounds (``round_widths``). Warm-up on rank ``r`` is
    ``2(P-r-1) + (V-1)·w`` chunk-forwards, ``w`` the first round's width (capped at ``V·M``); then one
    forward and one backward alternate. Bubble ``(P-1)/(V·M+P-1)`` for every ``M >= P`` with equal
    rounds. ``rounds="padded"`` generates the schedule for ``M`` rounded up to a multiple of ``P`` and
    drops the surplus micro-batches (see ``drop_surplus``): Megatron's order, fewer micro-batches held.
    """
    return depth_first(p, m, v, rounds, 2, _one_forward_one_backward)


def _one_forward_one_backward(r: int, warm: int, fwd: Order, bwd: Order) -> list[Action]:
    """Rank ``r``'s row of interleaved 1F1B: ``warm`` forwards, then one forward and one backward alternate, then
    the backwards left."""
    f, b = [Action("F", *pair) for pair in fwd], [Action("B", *pair) for pair in bwd]
    steady = [a for k in range(len(f) - warm) for a in (f[warm + k], b[k])]
    return f[:warm] + steady + b[len(b) - warm:]


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
