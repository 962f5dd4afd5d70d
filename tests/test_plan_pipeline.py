"""The planner's pipeline figures come from plait.sim; its large-M extrapolation matches exact runs."""

import pytest

from plait.plan.pipeline import profile
from plait.schedules import build_schedule
from plait.sim import Costs, simulate


@pytest.mark.parametrize(
    "name, pp, m, v",
    [("1f1b", 8, 45, 1), ("1f1b", 4, 30, 1), ("interleaved-1f1b", 4, 40, 2), ("interleaved-1f1b", 4, 36, 4),
     ("zb-h1", 8, 37, 1), ("zbv", 4, 29, 2), ("gpipe", 4, 22, 1), ("looped-bfs", 4, 20, 2)],
)
def test_extrapolation_equals_exact_simulation(name, pp, m, v):
    f, b, w, p2p = 0.5, 1.2, 0.45, 0.025  # ratios 2.4, 0.9, 0.05: unchanged by the 2-digit rounding
    approx = profile(name, pp, m, v, f, b, w if name in ("zb-h1", "zbv") else None, p2p)
    exact = profile(name, pp, m, v, f, b, w if name in ("zb-h1", "zbv") else None, p2p, exact=True)
    assert approx.simulated_m != (m,)  # the extrapolation was used
    assert approx.makespan == pytest.approx(exact.makespan, rel=1e-9)
    assert approx.bubble_fraction == pytest.approx(exact.bubble_fraction, rel=1e-9, abs=1e-12)
    assert approx.peak == pytest.approx(exact.peak)


def test_profile_is_the_simulator():
    p = profile("1f1b", 4, 8, 1, 1.0, 2.0, None, 0.0, exact=True)
    r = simulate(build_schedule("1f1b", stages=4, microbatches=8), Costs(1.0, 2.0, None, 0.0))
    assert p.makespan == r.makespan and p.peak == tuple(r.peak_activations)
    # and, with free communication, the textbook bubble (p-1)/(m+p-1) (Narayanan et al. 2021)
    assert p.bubble_fraction == pytest.approx(3 / 11)


def test_no_pipeline():
    p = profile("1f1b", 1, 10, 1, 1.0, 2.0, None, 0.0)
    assert p.makespan == 30.0 and p.bubble_fraction == 0.0 and p.peak == (1.0,)
