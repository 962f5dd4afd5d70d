"""``Costs``: how long each kind of pipeline step takes, per micro-batch, for the simulator."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from plait.errors import FieldError, is_number, plain_number, plain_numbers

if TYPE_CHECKING:
    from plait.schedules import Schedule

Cost = float | Sequence[float]


@dataclass
class Costs:
    """Times of one micro-batch through one whole pipeline stage (a rank's share of the model).

    A chunk of a rank holding ``V`` chunks costs ``1/V`` of it. A split backward costs
    ``I = backward - weight`` and ``W = weight``; ``weight=None`` means ``backward / 2``. ``p2p`` is
    added when a dependency was produced on another rank (the send/receive latency).

    Each of ``forward``, ``backward`` and ``weight`` may be a number or a list for unbalanced stages:
    length ``num_ranks`` gives the time of each rank's whole share (its chunks cost ``1/V`` of it);
    length ``num_ranks * virtual`` gives the time of each chunk directly. Units are arbitrary
    (traces read them as milliseconds). Costs measured from real runs will plug in through a
    constructor (a later ``Costs.measure(...)``) returning this same dataclass.
    """

    forward: Cost = 1.0
    backward: Cost = 2.0
    weight: Cost | None = None
    p2p: float = 0.0

    def __post_init__(self) -> None:
        plain_numbers(self)

    @classmethod
    def measure(cls, schedule: Schedule, timeline: Sequence[tuple[int, Any, float, float]],
                p2p: float = 0.0) -> Costs:
        """Costs measured from a real run's timeline (see ``measure_costs``)."""
        return measure_costs(schedule, timeline, p2p)

    def to_dict(self) -> dict[str, Any]:
        return {k: ([plain_number(x) for x in v] if isinstance(v, Sequence) else v) for k, v in asdict(self).items()}

    def durations(self, schedule: Schedule) -> dict[str, list[float]]:
        """Per-kind, per-chunk durations for ``schedule``: ``{"F": [...], "B": ..., "I": ..., "W": ...}``."""
        if not _ok(self.p2p):
            raise FieldError("p2p", self.p2p, "must be a finite number >= 0")
        f = _per_chunk("forward", self.forward, schedule)
        b = _per_chunk("backward", self.backward, schedule)
        w = [x / 2 for x in b] if self.weight is None else _per_chunk("weight", self.weight, schedule)
        for c, (bc, wc) in enumerate(zip(b, w, strict=True)):
            if wc > bc * (1 + 1e-12):
                raise FieldError("weight", self.weight, f"the weight-gradient part ({wc:g} on chunk {c}) cannot "
                                                        f"exceed the whole backward ({bc:g}); give one <= the backward")
        return {"F": f, "B": b, "I": [max(bc - wc, 0.0) for bc, wc in zip(b, w, strict=True)], "W": w}


def _ok(x: Any) -> bool:
    return is_number(x) and x >= 0


def _per_chunk(name: str, value: Cost, schedule: Schedule) -> list[float]:
    p, v, n = schedule.num_ranks, schedule.virtual, schedule.num_stages
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, numbers.Real)):
        raise FieldError(name, value, "must be a number or a list of numbers")
    values = list(value) if isinstance(value, Sequence) else [value]
    if not all(_ok(x) for x in values):
        raise FieldError(name, value, "times must be finite numbers >= 0")
    if len(values) == 1 and not isinstance(value, Sequence):
        return [float(values[0]) / v] * n
    if len(values) == p:
        return [float(values[schedule.placement[c]]) / v for c in range(n)]
    if len(values) == n:
        return [float(x) for x in values]
    raise FieldError(name, value, f"a list of {len(values)} times; give one per rank ({p}) or one per chunk ({n})")


def measure_costs(schedule: Schedule, timeline: Sequence[tuple[int, Any, float, float]], p2p: float = 0.0) -> Costs:
    """Per-chunk ``Costs`` from a measured timeline of ``(rank, action, start, end)`` (median per step kind).

    Closes the loop between the runtime and the simulator: simulate the schedule with these costs and
    compare the predicted bubble with the measured one. A split backward gives ``backward = I + W``.
    """
    samples: dict[tuple[str, int], list[float]] = {}
    for _rank, action, start, end in timeline:
        samples.setdefault((action.kind, action.stage), []).append(end - start)

    def med(kind: str, chunk: int) -> float | None:
        values = sorted(samples.get((kind, chunk), []))
        return values[len(values) // 2] if values else None

    n = schedule.num_stages
    forward = [med("F", c) or 0.0 for c in range(n)]
    split = any(kind in ("I", "W") for kind, _ in samples)
    if split:
        weight = [med("W", c) or 0.0 for c in range(n)]
        backward = [(med("I", c) or med("B", c) or 0.0) + w for c, w in enumerate(weight)]
        return Costs(forward=forward, backward=backward, weight=weight, p2p=p2p)
    return Costs(forward=forward, backward=[med("B", c) or 0.0 for c in range(n)], p2p=p2p)

