"""Zero-bubble schedules: ZB-H1 and its interleaved form ZB1P, ZB-V (Qi et al.), and DeepSeek's DualPipeV.

The backward pass is split into ``I`` (gradient w.r.t. the chunk's input, on the critical path) and
``W`` (gradient w.r.t. its weights, free to move); deferred ``W`` passes fill the pipeline bubbles.
"""

from __future__ import annotations

from collections import deque

from plait.schedules.actions import Action
from plait.schedules.generators import Order, depth_first


def zb_h1(p: int, m: int, v: int = 1, rounds: str = "equal") -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3): 1F1B with each B split into I and W.

    Rank ``r`` defers its first ``r`` weight passes to the cool-down, where 1F1B idles, so it holds
    at most ``P`` micro-batches in flight (1F1B's peak, on rank 0). With ``T_F = T_I = T_W`` the
    bubble shrinks from ``(P-1)(T_F+T_B)`` to ``(P-1)(T_F+T_I-T_W)``, about a third.

    With ``V > 1`` chunks per rank (round-robin, chunk ``c`` on rank ``c % P``) this is ZB1P, the
    interleaved variant of the same paper (PyTorch's ``ScheduleInterleavedZeroBubble``): micro-batches
    run depth first in rounds (``generators.round_widths``) as in interleaved 1F1B, with a warm-up of
    ``(V-1)·w + P-r-1`` chunk-forwards (``w`` the first round's width, capped at ``V·M``).
    """
    return depth_first(p, m, v, rounds, 1, _deferred_weights)


def _deferred_weights(r: int, warm: int, fwd: Order, bwd: Order) -> list[Action]:
    """Rank ``r``'s row of ZB-H1 / ZB1P: 1F1B's with each B split into I and W, its first ``r`` W deferred."""
    row = [Action("F", *pair) for pair in fwd[:warm]]
    pending: deque[Action] = deque()
    for k, pair in enumerate(bwd):
        if warm + k < len(fwd):
            row.append(Action("F", *fwd[warm + k]))
        row.append(Action("I", *pair))
        pending.append(Action("W", *pair))
        if k >= r:
            row.append(pending.popleft())
    return row + list(pending)


class _Row:
    """Builds one rank's list for a two-chunk (V-shaped) schedule, counting micro-batches per chunk."""

    def __init__(self, first: int, second: int, m: int) -> None:
        self.chunk = (first, second)
        self.m = m
        self.next = {(k, j): 0 for k in "FBIW" for j in (0, 1)}
        self.weights: deque[tuple[int, int]] = deque()  # (chunk slot, mb) of I passes awaiting W
        self.row: list[Action] = []

    def add(self, kind: str, j: int) -> None:
        """Append the next micro-batch of ``kind`` on chunk slot ``j`` (0 = first leg of the V)."""
        key = "B" if kind in "BI" else kind
        mb = self.next[(key, j)]
        self.next[(key, j)] = mb + 1
        if mb < self.m:  # generators may run past M; those steps are dropped
            self.row.append(Action(kind, self.chunk[j], mb))
            if kind == "I":
                self.weights.append((j, mb))

    def weight(self) -> None:
        """Append the oldest pending weight pass, if any."""
        if self.weights:
            j, mb = self.weights.popleft()
            self.row.append(Action("W", self.chunk[j], mb))

    def finish(self) -> list[Action]:
        while self.weights:
            self.weight()
        return self.row


def zbv(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", §6 / zero-bubble repo).

    Two chunks per rank in a V: rank ``r`` holds chunks ``r`` and ``2P-1-r``. Warm-up runs
    ``2(P-r)-1`` forwards of the first chunk, then ``r`` (second, first) forward pairs, then ``P-r``
    (F, I, W) triples on the second chunk; the steady phase alternates F-I-W on both chunks; the
    cool-down drains input gradients before weights. Peak memory equals 1F1B's (``P`` whole-stage
    micro-batches) and the bubble is near zero when ``T_F = T_I = T_W``. Micro-batches are generated as
    if ``M >= 2P-1`` and the surplus dropped, so any ``M >= 1`` works.
    """
    n = max(m, 2 * p - 1)
    out = []
    for r in range(p):
        b = _Row(r, 2 * p - 1 - r, m)
        for _ in range(2 * (p - r) - 1):
            b.add("F", 0)
        for _ in range(r):
            b.add("F", 1)
            b.add("F", 0)
        for _ in range(p - r):
            b.add("F", 1)
            b.add("I", 1)
            b.weight()
        while b.next[("F", 1)] < b.next[("F", 0)] or b.next[("F", 0)] < n:
            if b.next[("F", 0)] < n:
                b.add("F", 0)
            b.add("I", 0)
            b.weight()
            b.add("F", 1)
            b.add("I", 1)
            b.weight()
        for _ in range(r):
            b.add("I", 0)
            b.add("I", 1)
        for _ in range(p - r):
            b.add("I", 0)
            b.weight()
        out.append(_drain_by_chunk(b))
    return out


def _drain_by_chunk(b: _Row) -> list[Action]:
    """ZB-V's tail: remaining weight passes of the second chunk, then of the first."""
    for j in (1, 0):
        b.row += [Action("W", b.chunk[j], mb) for jj, mb in b.weights if jj == j]
    b.weights.clear()
    return b.row


def dualpipev(p: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3 report 2024; deepseek-ai/DualPipe ``dualpipev.py``), needs ``M >= 2P``.

    V-shaped placement like ZB-V. The steady phase pairs a forward of one chunk with a full backward
    of the other; DualPipe overlaps each pair's compute and communication, plait records the pair as two
    consecutive actions (F, then B). The tail splits backwards into I/W to fill the drain bubble.
    """
    out = []
    for r in range(p):
        b = _Row(r, 2 * p - 1 - r, m)
        for _ in range(2 * (p - r - 1)):                 # 1: forwards of the first leg
            b.add("F", 0)
        for _ in range(r + 1):                           # 2: F0 F1
            b.add("F", 0)
            b.add("F", 1)
        for _ in range(p - r - 1):                       # 3: I1 W F1
            b.add("I", 1)
            b.weight()
            b.add("F", 1)
        for _ in range(m - 2 * p + r + 1):               # 4: (F0,B1) (F1,B0) pairs
            b.add("F", 0)
            b.add("B", 1)
            b.add("F", 1)
            b.add("B", 0)
        for _ in range(p - r - 1):                       # 5: B1 (F1,B0)
            b.add("B", 1)
            b.add("F", 1)
            b.add("B", 0)
        split = False
        for i in range(r + 1):                           # 6: B1 B0, second half zero-bubble
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            b.add("I" if split else "B", 1)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            b.add("I" if split else "B", 0)
        for _ in range(p - r - 1):                       # 7: W B0
            b.weight()
            b.add("I" if split else "B", 0)
        out.append(b.finish())                           # 8: remaining W
    return out
