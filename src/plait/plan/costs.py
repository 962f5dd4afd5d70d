"""What a pipeline chunk costs per micro-batch: the seconds ``plan.timing`` fills in and ``plan.estimate`` runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch of a chunk (or of a rank: the sum of its chunks). ``w_compute`` is the
    weight-gradient part of ``b_compute`` (the W of zero-bubble schedules)."""

    f_compute: float = 0.0
    b_compute: float = 0.0
    w_compute: float = 0.0
    f_tp: float = 0.0
    b_tp: float = 0.0
    recompute: float = 0.0
    p2p: float = 0.0
    layers: int = 0

    @property
    def forward(self) -> float:
        return self.f_compute + self.f_tp

    @property
    def backward(self) -> float:
        return self.b_compute + self.b_tp + self.recompute

    @property
    def weight(self) -> float:
        return self.w_compute

    def __add__(self, other: StageCosts) -> StageCosts:
        a, b = self, other
        return StageCosts(a.f_compute + b.f_compute, a.b_compute + b.b_compute, a.w_compute + b.w_compute,
                          a.f_tp + b.f_tp, a.b_tp + b.b_tp, a.recompute + b.recompute, max(a.p2p, b.p2p),
                          a.layers + b.layers)

    def times(self, k: float) -> StageCosts:
        """``k`` of these (``k`` layers), the same point-to-point transfer."""
        return StageCosts(self.f_compute * k, self.b_compute * k, self.w_compute * k, self.f_tp * k,
                          self.b_tp * k, self.recompute * k, self.p2p, int(self.layers * k))
