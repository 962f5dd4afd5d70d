"""Depth-first rounds of interleaved-1f1b and ZB1P (zb-h1 with V > 1) for any M: equal vs padded rounds."""

from __future__ import annotations

import pytest

from plait.schedules import build_schedule
from plait.schedules.actions import Action
from plait.schedules.generators import depth_first, depth_first_peaks, drop_surplus, round_widths
from plait.sim import Costs, simulate

COSTS = Costs(forward=1.0, backward=2.0)


def _sizes(max_p: int = 8):
    for p in range(2, max_p + 1):
        for m in range(p, 3 * p + 2):
            yield p, m


def test_depth_first_hands_each_rank_its_warm_up_and_its_chunks_in_depth_first_order():
    """The one scaffold of interleaved 1F1B and ZB1P: each rank's row builder gets its warm-up and the global
    chunks it holds (c·P + r) in depth-first order, forwards chunk 0 first, backwards the last chunk first; padded
    rounds with M % P != 0 are the rounded-up schedule without the surplus micro-batches."""
    seen = {}

    def forwards(r, warm, fwd, bwd):
        seen[r] = (warm, fwd, bwd)
        return [Action("F", *pair) for pair in fwd]

    rows = depth_first(2, 3, 2, "equal", 2, forwards)  # one round of 3 micro-batches
    assert seen[1] == (3, [(1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (3, 2)],
                       [(3, 0), (3, 1), (3, 2), (1, 0), (1, 1), (1, 2)])
    assert seen[0][0] == 5 and [a.stage for a in rows[0]] == [0, 0, 0, 2, 2, 2]
    padded = depth_first(2, 3, 2, "padded", 2, forwards)  # rounds of 2: micro-batches 0-1, then 2 (3 dropped)
    assert padded == drop_surplus(depth_first(2, 4, 2, "equal", 2, forwards), 3)
    assert [(a.stage, a.microbatch) for a in padded[0]] == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (2, 2)]


def test_round_widths():
    assert round_widths(4, 10) == [5, 5] and round_widths(4, 10, "padded") == [4, 4, 2]
    assert round_widths(4, 9) == [5, 4]  # torch refuses 9 % 2; wider rounds first
    assert round_widths(8, 15) == [15] and round_widths(4, 3) == [3] and round_widths(4, 12) == [4, 4, 4]
    for p, m in _sizes():
        widths = round_widths(p, m)
        assert sum(widths) == m and len(widths) == m // p and min(widths) >= p and max(widths) - min(widths) <= 1


@pytest.mark.parametrize("name", ["interleaved-1f1b", "looped-bfs"])
def test_equal_rounds_reach_the_closed_form_bubble_for_every_m(name):
    """(P-1)/(V·M+P-1) (Narayanan et al. 2021, §2.2) for every M >= P, not only multiples of P."""
    checked = 0
    for p, m in _sizes():
        for v in (2, 3, 4):
            r = simulate(build_schedule(name, p, m, v).validate(), COSTS)
            assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1)), (name, p, m, v)
            checked += m % p != 0
    assert checked > 100


def test_padded_rounds_hold_fewer_micro_batches_for_a_larger_bubble():
    # the figures: P=4 M=10 V=2 36.5 vs 34.5; P=8 M=18 V=3 69.67 vs 61; P=8 M=15 peak 11.5 vs 15
    for p, m, v, equal_span, padded_span in ((4, 10, 2, 34.5, 36.5), (8, 18, 3, 61.0, 69.0 + 2 / 3)):
        eq = simulate(build_schedule("interleaved-1f1b", p, m, v), COSTS)
        pad = simulate(build_schedule("interleaved-1f1b", p, m, v, rounds="padded"), COSTS)
        assert (eq.makespan, pad.makespan) == pytest.approx((equal_span, padded_span))
    eq = simulate(build_schedule("interleaved-1f1b", 8, 15, 2), COSTS)
    pad = simulate(build_schedule("interleaved-1f1b", 8, 15, 2, rounds="padded"), COSTS)
    assert (eq.peak_activations[0], pad.peak_activations[0]) == (15.0, 11.5)
    # with M % P == 0 (or M <= P) the two are the same schedule
    for m in (3, 4, 8):
        assert (build_schedule("interleaved-1f1b", 4, m, 2).actions
                == build_schedule("interleaved-1f1b", 4, m, 2, rounds="padded").actions)


def test_zb1p_validates_runs_every_action_once_and_reaches_zbv():
    for p, m in _sizes(6):
        for v in (2, 3):
            for rounds in ("equal", "padded"):
                s = build_schedule("zb-h1", p, m, v, rounds=rounds).validate()  # each F, I, W once; no deadlock
                assert sum(map(len, s.actions)) == 3 * p * v * m
                assert {a.kind for row in s.actions for a in row} == {"F", "I", "W"}
    zb1p = simulate(build_schedule("zb-h1", 4, 8, 2), COSTS)
    assert zb1p.makespan == simulate(build_schedule("zbv", 4, 8), COSTS).makespan == 25.5
    assert zb1p.makespan < simulate(build_schedule("zb-h1", 4, 8), COSTS).makespan
    assert zb1p.makespan < simulate(build_schedule("interleaved-1f1b", 4, 8, 2), COSTS).makespan
    # V = 1 is ZB-H1 unchanged
    assert [str(a) for a in build_schedule("zb-h1", 3, 4, 1).actions[0]] == [
        "0F0", "0F1", "0F2", "0I0", "0W0", "0F3", "0I1", "0W1", "0I2", "0W2", "0I3", "0W3"]


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-h1"])
def test_depth_first_peaks_count_what_the_simulator_measures(name):
    for p, m in _sizes(6):
        for v in (1, 2, 3):
            r = simulate(build_schedule(name, p, m, v), Costs(1.0, 2.0, p2p=0.3))
            peaks = depth_first_peaks(p, m, v, "equal", deferred_weights=name == "zb-h1")
            assert peaks == pytest.approx(r.peak_activations), (p, m, v)
