"""The planner's view of a pipeline: bubble and activations in flight, from plait.sim, cached."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Micro-batch counts above SIM_CAP·pp are not simulated: with uniform stages every schedule here
# reaches a periodic steady state once M >= pp (one F and one B per rank per period; Narayanan et
# al. 2021 §2.2), so makespan and peak in-flight micro-batches are affine in M. We simulate two
# counts M1 ≡ M (mod pp) in [SIM_CAP·pp, (SIM_CAP+1)·pp) and M2 = M1 + pp and extrapolate linearly;
# tests/test_plan_pipeline.py checks this against the exact simulation.
#
# Interleaved 1F1B and ZB1P with equal rounds and M % pp != 0 (``build_schedule(rounds="equal")``) are
# not periodic in M: round widths ceil(M/floor(M/pp)) change with M. Their makespan is still affine
# with free communication (the bubble is (pp-1)/(V·M+pp-1) at every M >= pp); with a p2p latency the
# extrapolation is off by up to ~1%. Their peaks are counted at the true M instead (``_equal_round_peaks``).
SIM_CAP = 2
#: schedules whose micro-batches go in depth-first rounds (``build_schedule(rounds=...)``)
ROUND_SCHEDULES = ("interleaved-1f1b", "zb-h1")
# Cost ratios are rounded to this many significant digits before they key the cache.
RATIO_DIGITS = 2


@dataclass(frozen=True)
class PipelineProfile:
    """One pipeline replica's step: ``makespan`` (s), ``bubble_fraction`` and per-rank ``peak`` in
    micro-batches of a whole stage (as ``plait.sim`` reports them), and ``simulated_m``."""

    makespan: float
    bubble_fraction: float
    peak: tuple[float, ...]
    simulated_m: tuple[int, ...]


def _round(x: float) -> float:
    return float(f"{x:.{RATIO_DIGITS}g}") if x else 0.0


@lru_cache(maxsize=8192)
def _simulate(name: str, pp: int, m: int, v: int, bwd: float, weight: float | None,
              p2p: float, rounds: str | None = None) -> tuple[float, float, tuple[float, ...]]:
    """Run the simulator once with forward = 1 (costs are ratios to the forward)."""
    from plait.schedules import build_schedule
    from plait.sim import Costs, simulate

    sched = build_schedule(name, stages=pp, microbatches=m, virtual=v, rounds=rounds)
    r = simulate(sched, Costs(forward=1.0, backward=bwd, weight=weight, p2p=p2p))
    return float(r.makespan), float(r.bubble_fraction), tuple(float(x) for x in r.peak_activations)


def profile(name: str, pp: int, m: int, v: int, forward: float, backward: float,
            weight: float | None, p2p: float, exact: bool = False,
            rounds: str | None = None) -> PipelineProfile:
    """Simulate schedule ``name`` with uniform stages costing ``forward``/``backward`` seconds per
    micro-batch (``weight`` the W part of a split backward, ``p2p`` one transfer).

    ``exact`` simulates the true M (no extrapolation, no rounding of the ratios). ``rounds``: see
    ``build_schedule`` (interleaved-1f1b and zb-h1 only).
    """
    if pp == 1:  # no pipeline: micro-batches run one after the other (gradient accumulation)
        return PipelineProfile(m * (forward + backward), 0.0, (1.0,), ())
    rnd = (lambda x: x) if exact else _round
    bwd, p2 = rnd(backward / forward), rnd(p2p / forward)
    w = None if weight is None else rnd(weight / forward)
    cap = SIM_CAP * pp
    if exact or m < cap + pp:
        span, bubble, peak = _simulate(name, pp, m, v, bwd, w, p2, rounds)
        return PipelineProfile(span * forward, bubble, peak, (m,))
    m1 = cap + (m - cap) % pp
    m2 = m1 + pp
    s1, _, k1 = _simulate(name, pp, m1, v, bwd, w, p2, rounds)
    s2, _, k2 = _simulate(name, pp, m2, v, bwd, w, p2, rounds)
    frac = (m - m1) / pp
    span = s1 + (s2 - s1) * frac
    peak = tuple(a + (b - a) * frac for a, b in zip(k1, k2, strict=True))
    if m % pp and rounds != "padded" and name in ROUND_SCHEDULES:
        peak = _equal_round_peaks(name, pp, m, v)
    busy = m * (1.0 + bwd)  # per rank, in forward units (a split backward B = I + W)
    bubble = 1.0 - busy / span if span > 0 else 0.0
    return PipelineProfile(span * forward, bubble, peak, (m1, m2))


def _equal_round_peaks(name: str, pp: int, m: int, v: int) -> tuple[float, ...]:
    """Peaks of interleaved-1f1b / ZB1P with equal rounds: the first round is ``ceil(M/floor(M/pp))``
    wide, which is not affine in M, so they are counted from the schedule's order at the true M."""
    from plait.schedules.generators import depth_first_peaks

    return tuple(depth_first_peaks(pp, m, v, "equal", deferred_weights=name == "zb-h1"))


def cache_clear() -> None:
    _simulate.cache_clear()
