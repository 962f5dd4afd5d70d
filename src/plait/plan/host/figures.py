"""The figures of a calibrated host (``plan.host.profile``): a kernel's speed alone and shared (``Rate``), a
collective's seconds against bytes (``Curve``), a tensor-parallel layer timed with and without its collectives
(``TPBlock``), and the names of the kinds measured. Pure Python."""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

from plait.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
KERNELS = ("matmul", "attention", "elementwise")
BLOCK = "block"  # optional kind (format >= 2): decoder layers' seconds beyond GEMMs and attention
LAYER = "layer"  # optional kind (format >= 4): the same decoder layers' whole seconds, alone and shared
SELECTIVE = "recomputed_core"  # optional kind (format >= 5): what recomputing those layers' attention cores adds
SECONDS_KINDS = (BLOCK, LAYER, SELECTIVE)  # kinds whose figures are seconds, not speeds


@dataclass(frozen=True)
class Curve:
    """Seconds of a collective vs bytes (per rank), measured points; linear between, α + β·bytes beyond."""

    bytes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.bytes) != len(self.seconds) or len(self.bytes) < 2:
            raise ConfigError("profile: a collective needs >= 2 (bytes, seconds) points of equal count")
        if list(self.bytes) != sorted(self.bytes):
            raise ConfigError("profile: collective sizes must be increasing")

    @property
    def latency(self) -> float:
        """α: the fitted time of an empty message (the smallest size measured, less its bytes' share)."""
        return max(self.seconds[0] - self.bytes[0] / self.bandwidth, 0.0)

    @property
    def bandwidth(self) -> float:
        """1/β: bytes per second between the two largest sizes measured."""
        db, dt = self.bytes[-1] - self.bytes[-2], self.seconds[-1] - self.seconds[-2]
        return db / dt if dt > 0 else math.inf

    def __call__(self, nbytes: float) -> float:
        b, s = self.bytes, self.seconds
        if nbytes <= b[0]:
            return s[0] if nbytes > 0 else 0.0
        if nbytes >= b[-1]:
            return s[-1] + (nbytes - b[-1]) / self.bandwidth
        i = bisect.bisect_right(b, nbytes)
        w = (nbytes - b[i - 1]) / (b[i] - b[i - 1])
        return s[i - 1] + w * (s[i] - s[i - 1])


@dataclass(frozen=True)
class Rate:
    """A kernel's speed for one process: ``alone`` and ``shared`` (all P processes at it), per unit of work
    (FLOP/s for matmul and attention, bytes/s for element-wise kernels), at each measured ``size``."""

    sizes: tuple[float, ...]
    alone: tuple[float, ...]
    shared: tuple[float, ...]
    forward_share: float = 1 / 3  # the forward's part of forward + backward time

    @property
    def slowdown(self) -> float:
        """How many times slower a call runs with every process at it than alone: the median over the measured
        sizes of ``alone / shared`` (of a speed; of the kinds that hold seconds, ``SECONDS_KINDS``, its
        inverse, and ``at`` is right for both).

        Each size's ratio is a short measurement (``plait.calibrate.kernels.BUDGET_S`` of calls alone, then
        the processes' span over half as many rounds together) that moves much more between calibrations than
        the median over the kind's sizes does (docs/planner-log.md, entry 20). Sharing slows every size of a
        kind alike (the cores go round the processes), so the median is the figure."""
        return statistics.median(a / s for a, s in zip(self.alone, self.shared, strict=True))

    def at(self, size: float, shared: bool) -> float:
        """Interpolated in log(size); flat beyond the measured sizes. ``shared``: the figure alone over the
        ``slowdown``."""
        if shared:
            return self.at(size, False) / self.slowdown
        values = self.alone
        if len(values) == 1 or size <= self.sizes[0]:
            return values[0]
        if size >= self.sizes[-1]:
            return values[-1]
        i = bisect.bisect_right(self.sizes, size)
        w = math.log(size / self.sizes[i - 1]) / math.log(self.sizes[i] / self.sizes[i - 1])
        return values[i - 1] + w * (values[i] - values[i - 1])


@dataclass(frozen=True)
class TPBlock:
    """A tensor-parallel decoder layer timed on every ``group``-rank TP group of the section at once
    (``sequence_parallel`` or not; ``plait.calibrate.tp_block``): ``seconds``, the mean of its forward +
    backward on one rank, and ``twin_s``, of the same kernels without collectives (timed in alternating
    rounds with it). ``shape`` is the layer's (batch, sequence, hidden, heads, KV heads),
    one of ``plan.host.shapes.TP_CALIBRATION_BLOCKS``."""

    shape: tuple[int, ...]
    group: int
    sequence_parallel: bool
    seconds: float
    twin_s: float
