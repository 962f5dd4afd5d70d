"""The fit's minimiser follows valleys that run across the axes and stops only where no single or paired step
improves."""

import math

import pytest

from plait.plan.pattern_search import directions, pattern_search
from plait.plan.published import runs
from plait.plan.validation import UNIT, default_constants, fit, predict, with_values


def test_directions_are_each_coordinate_then_each_pair():
    assert directions(2) == [(1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)]
    assert len(directions(3)) == 6 + 3 * 4 and len(set(directions(3))) == 18


def test_a_kinked_diagonal_valley_is_followed_to_its_lowest_point():
    # every step of one coordinate from the line x = y climbs by 100 a unit; only both together go down it
    def f(p):
        x, y = p
        return 100 * abs(x - y) + abs(x + y - 2000)

    assert pattern_search(f, (0, 0), (-5000, -5000), (5000, 5000), 64) == (1000, 1000)


def test_a_narrow_tilted_smooth_valley_reaches_its_optimum():
    # the valley's floor is x = 2y (off the diagonals too): the optimum (1200, 600)
    calls = []

    def f(p):
        calls.append(p)
        x, y = p
        return 50 * (x - 2 * y) ** 2 + (x + y - 1800) ** 2

    x = pattern_search(f, (0, 0), (-4000, -4000), (4000, 4000), 64)
    assert x == (1200, 600)
    assert len(calls) < 4000


def test_bounds_hold_and_the_step_must_be_a_unit_or_more():
    assert pattern_search(lambda p: -p[0] - p[1], (0, 0), (-3, -3), (7, 5), 4) == (7, 5)
    with pytest.raises(ValueError, match="at least 1"):
        pattern_search(lambda p: 0.0, (0,), (0,), (1,), 0)


def test_a_point_no_step_improves_is_returned_as_it_is():
    assert pattern_search(lambda p: abs(p[0]) + abs(p[1]), (0, 0), (-9, -9), (9, 9), 8) == (0, 0)


def test_each_improving_poll_moves_and_the_search_ends():
    seen = []

    def f(p):
        seen.append(p)
        return (p[0] - 37) ** 2 + (p[1] + 11) ** 2 + (p[2] - 5) ** 2

    assert pattern_search(f, (0, 0, 0), (-100,) * 3, (100,) * 3, 16) == (37, -11, 5)
    assert len(seen) < 400


def _three_sources():
    """Fast runs (no pipelines) of three sources, A100 and H100: the fit's three constants all in play."""
    out = []
    for s in ("NVIDIA NeMo Megatron", "MosaicML llm-foundry", "torchtitan"):
        out += [r for r in runs() if r.source == s and r.layout.pp == 1][:5]
    return out


def test_the_fit_stops_where_no_step_of_one_or_two_constants_improves():
    # the real objective on a small set, all three constants: from the fitted values no step of one lattice unit
    # in any constant, or in any two together, lowers the mean |log error| (one constant at a time stopped short)
    rs, constants = _three_sources(), default_constants()
    values = fit(rs, constants)
    at = {c.name: round(math.log(values[c.name] / c.default) / UNIT) for c in constants}

    def loss(point):
        moved = {c.name: c.default * math.exp(point[c.name] * UNIT) for c in constants}
        return sum(abs(math.log(predict(with_values(r, constants, moved)) / r.step_s)) for r in rs) / len(rs)

    here = loss(at)
    for d in directions(len(constants)):
        step = {c.name: at[c.name] + k for c, k in zip(constants, d, strict=True)}
        assert loss(step) >= here, d
    assert all(values[c.name] != c.default for c in constants)
