"""The planner's view of a pipeline: makespan, idle time and activations in flight, from plait.sim, cached."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from plait.plan.stages import placement as stages_placement

# Micro-batch counts above a few pp are not simulated one by one: once M >= pp every schedule here
# reaches a periodic steady state (one F and one B per rank per period; Narayanan et al. 2021 §2.2), so
# makespan and peak activations are affine in M. We simulate three counts M1, M1 + pp, M1 + 2·pp with
# M1 ≡ M (mod pp) in [SIM_CAP·pp, (SIM_CAP+1)·pp), check that every figure is affine in them (else slide
# the window up by 1, 2, 4, ... pp, then simulate M itself) and extrapolate. Costs are the exact per-chunk
# seconds, never rounded; tests/test_plan_pipeline.py checks the extrapolation against exact simulations.
SIM_CAP = 1
_AFFINE_TOL = 1e-9
#
# Interleaved 1F1B and ZB1P with equal rounds and M % pp != 0 (``build_schedule(rounds="equal")``) are
# not periodic in M: round widths ceil(M/floor(M/pp)) change with M. Their makespan is still affine
# with free communication (the bubble is (pp-1)/(V·M+pp-1) at every M >= pp; with a p2p latency the
# extrapolation is off by up to ~1%), so it is extrapolated; their peaks are counted on the schedule's
# order at the true M (``_peak_bytes``, no timing).
#: schedules whose micro-batches go in depth-first rounds (``build_schedule(rounds=...)``)
ROUND_SCHEDULES = ("interleaved-1f1b", "zb-h1")
#: schedules whose backward splits into input gradients (I) and weight gradients (W)
SPLIT_BACKWARD = frozenset({"zb-h1", "zbv", "dualpipev"})


@dataclass(frozen=True)
class PipelineProfile:
    """One pipeline replica's forward/backward part of a step: ``makespan`` (s), per-rank ``busy`` (s),
    per-rank ``peak`` activations in micro-batches of a whole stage (as ``plait.sim`` counts them),
    per-rank ``peak_bytes`` (with each chunk's bytes per micro-batch), and the ``simulated_m``."""

    makespan: float
    busy: tuple[float, ...]
    peak: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    simulated_m: tuple[int, ...]

    @property
    def idle(self) -> float:
        """Idle time of the average rank: makespan less its busy time."""
        return self.makespan - sum(self.busy) / len(self.busy)


@lru_cache(maxsize=8192)
def _simulate(name: str, pp: int, m: int, v: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
              weight: tuple[float, ...] | None, p2p: float, nbytes: tuple[float, ...],
              rounds: str | None = None) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(makespan, peak micro-batches per rank, peak bytes per rank) of one exact simulation: the timing
    core of ``plait.sim.simulate`` (``schedules.execute``) on a schedule the generators built, so the
    structural checks ``simulate`` repeats for schedules from elsewhere are skipped."""
    from plait.schedules.execute import execute
    from plait.sim import Costs

    sched = schedule(name, pp, m, v, rounds)
    costs = Costs(forward=list(fwd), backward=list(bwd), weight=None if weight is None else list(weight), p2p=p2p)
    run = execute(sched, costs.durations(sched), p2p)
    if not run.finished:  # never for a generated schedule; simulate() raises the explanatory error
        from plait.sim import simulate

        simulate(sched, costs)
    makespan = max((e[-1] for e in run.ends if e), default=0.0)
    ones = tuple(1.0 / v for _ in range(pp * v))
    return float(makespan), _peak_bytes(sched, ones), _peak_bytes(sched, nbytes)


@lru_cache(maxsize=1024)
def schedule(name: str, pp: int, m: int, v: int, rounds: str | None = None):
    """``build_schedule`` cached (the planner never changes a schedule it builds)."""
    from plait.schedules import build_schedule

    return build_schedule(name, stages=pp, microbatches=m, virtual=v, rounds=rounds)


def _peak_bytes(sched, nbytes: tuple[float, ...]) -> tuple[float, ...]:
    """Most bytes each rank holds at once: a chunk's bytes from an F's start to its B's (or W's) end, as
    ``plait.sim`` counts micro-batches (list order is time order on a rank)."""
    out = []
    for row in sched.actions:
        live = peak = 0.0
        for kind, chunk, _ in row:
            if kind == "F":
                live += nbytes[chunk]
                peak = max(peak, live)
            elif kind in ("B", "W"):
                live -= nbytes[chunk]
        out.append(peak)
    return tuple(out)


def profile(name: str, pp: int, m: int, v: int, forward: Sequence[float], backward: Sequence[float],
            weight: Sequence[float] | None, p2p: float, nbytes: Sequence[float] | None = None,
            exact: bool = False, rounds: str | None = None) -> PipelineProfile:
    """Simulate schedule ``name`` with per-chunk costs (``forward[c]``, ``backward[c]`` seconds per
    micro-batch; ``weight[c]`` the W part of a split backward; ``p2p`` one transfer) and ``nbytes[c]``
    activation bytes one micro-batch leaves on chunk ``c``. ``exact`` simulates the true M. ``rounds``: see
    ``build_schedule`` (interleaved-1f1b and zb-h1 only)."""
    k = pp * v
    fwd, bwd = tuple(map(float, forward)), tuple(map(float, backward))
    w = None if weight is None else tuple(map(float, weight))
    nb = tuple(map(float, nbytes)) if nbytes is not None else (0.0,) * k
    placement = stages_placement(name, pp, v)
    busy = [0.0] * pp
    for c in range(k):
        busy[placement[c]] += m * (fwd[c] + bwd[c])
    if pp == 1:  # no pipeline: micro-batches run one after the other (gradient accumulation)
        return PipelineProfile(busy[0], tuple(busy), (1.0,), (sum(nb),), ())
    cap = SIM_CAP * pp
    uneven = name in ROUND_SCHEDULES and v > 1 and m % pp and rounds != "padded"  # equal rounds, M % P != 0
    if not exact:
        for slide in (0, 1, 2, 4, 8, 16):  # later windows when the first have not reached steady state
            m1 = cap + (m - cap) % pp + slide * pp
            if m < m1 + 2 * pp:
                break
            runs = [_simulate(name, pp, mi, v, fwd, bwd, w, p2p, nb, rounds) for mi in (m1, m1 + pp, m1 + 2 * pp)]
            series = ([[r[0] for r in runs]] + [[r[1][i] for r in runs] for i in range(pp)]
                      + [[r[2][i] for r in runs] for i in range(pp)])
            frac = (m - m1) / pp
            if uneven:  # the makespan extrapolated, the peaks counted on the order at the true M
                sched = schedule(name, pp, m, v, rounds)
                ones = tuple(1.0 / v for _ in range(k))
                span = series[0][0] + (series[0][1] - series[0][0]) * frac
                return PipelineProfile(max(span, makespan_floor(name, pp, m, v, fwd, bwd)), tuple(busy),
                                       _peak_bytes(sched, ones), _peak_bytes(sched, nb), (m1, m1 + pp, m1 + 2 * pp))
            if all(_affine(s) for s in series):
                ext = [s[0] + (s[1] - s[0]) * frac for s in series]
                return PipelineProfile(max(ext[0], makespan_floor(name, pp, m, v, fwd, bwd)), tuple(busy),
                                       tuple(ext[1:1 + pp]), tuple(ext[1 + pp:]),
                                       (m1, m1 + pp, m1 + 2 * pp))
    span, peak, pbytes = _simulate(name, pp, m, v, fwd, bwd, w, p2p, nb, rounds)
    return PipelineProfile(span, tuple(busy), peak, pbytes, (m,))


def makespan_floor(name: str, pp: int, m: int, v: int, forward: Sequence[float], backward: Sequence[float]) -> float:
    """A makespan no schedule ``name`` beats: a rank's busy time, plus the forwards of the chunks before its first
    (it waits for them on the first micro-batch) and, unless the backward is split (zero-bubble schedules fill
    that tail with W), their backwards after its last (Narayanan et al. 2021, §2.2: (p-1)(F+B)/v with uniform
    stages). An extrapolated makespan is never reported below it: the steady state the three simulated counts
    show may not be the one the true M reaches."""
    placement = stages_placement(name, pp, v)
    split = name in SPLIT_BACKWARD
    busy, first = [0.0] * pp, [len(placement)] * pp
    before = [0.0]  # before[c]: what the chunks below c cost one micro-batch
    for c, r in enumerate(placement):
        busy[r] += forward[c] + backward[c]
        first[r] = min(first[r], c)
        before.append(before[-1] + forward[c] + (0.0 if split else backward[c]))
    return max(m * busy[r] + before[first[r]] for r in range(pp))


def _affine(s: list[float]) -> bool:
    return abs((s[2] - s[1]) - (s[1] - s[0])) <= _AFFINE_TOL * max(abs(s[2]), 1e-30)


def simulations() -> int:
    """How many distinct exact simulations the cache holds (what a search or a benchmark has run)."""
    return _simulate.cache_info().currsize
