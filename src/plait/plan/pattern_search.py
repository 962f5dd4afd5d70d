"""A pattern search on an integer lattice: the minimiser ``plan.validation`` fits the GPU model's constants with.

The fitted objective (a mean absolute log error over published runs) is flat along valleys where one constant
trades off against another, and has kinks where a run's error changes sign; it has no gradient to follow, and
moving one coordinate at a time stops wherever a valley runs across the axes. This search polls every coordinate
and every pair of coordinates together, so it moves along a valley that runs diagonally to the axes too, and it
only stops where no such step of one lattice unit improves the objective.

Points are integer tuples, so the same point is the same key wherever a search reaches it (a caller can memoise
the objective across searches).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import combinations

Point = tuple[int, ...]


def directions(n: int) -> list[Point]:
    """Each coordinate alone (+1, -1), then each pair of coordinates together (four signs), in that order."""
    out: list[Point] = []
    for i in range(n):
        for sign in (1, -1):
            out.append(tuple(sign if k == i else 0 for k in range(n)))
    for i, j in combinations(range(n), 2):
        for si, sj in ((1, 1), (-1, -1), (1, -1), (-1, 1)):
            out.append(tuple(si if k == i else sj if k == j else 0 for k in range(n)))
    return out


def _clip(p: Sequence[int], low: Point, high: Point) -> Point:
    return tuple(min(max(x, lo), hi) for x, lo, hi in zip(p, low, high, strict=True))


def _primitive(d: Sequence[int]) -> Point:
    g = math.gcd(*d)
    return tuple(x // g for x in d)


def _line(f: Callable[[Point], float], x: Point, fx: float, d: Point, m: int, low: Point, high: Point
          ) -> tuple[float, Point] | None:
    """The lowest of ``x + m·d``, ``x + 2m·d``, ... (doubling while ``f`` keeps falling), or None when the first
    is not below ``fx``."""
    best = None
    while True:
        y = _clip([a + m * b for a, b in zip(x, d, strict=True)], low, high)
        if y == x or (best and y == best[1]):
            return best
        fy = f(y)
        if fy >= (best[0] if best else fx):
            return best
        best = (fy, y)
        m *= 2


def pattern_search(f: Callable[[Point], float], start: Point, low: Point, high: Point, step: int,
                   trail: int = 5) -> Point:
    """A point of the lattice box ``[low, high]`` where ``f`` is least as far as single and paired steps, and the
    search's own path, tell.

    From ``start``, steps of ``step`` units along ``directions`` are polled, the direction that last lowered ``f``
    first; the search moves to the first point lower than where it stands and goes on that way, a step and then
    twice as far, four times, while that lowers ``f`` further. When no poll point is lower, it looks along the line
    from points it passed (1, 2, 4, ... moves back, ``trail`` of them) to where it stands, both ways: the floor of
    a valley it came down in a zigzag, whatever the valley's angle to the axes; one unit along that line, then twice
    as far, four times, while ``f`` keeps falling. Only when that fails too does it halve the step. It returns when
    a step of one unit lowers nothing: from the point returned, no single or paired step of one unit (inside the
    box) improves ``f``. Deterministic. ``step`` must be at least 1.
    """
    if step < 1:
        raise ValueError(f"step must be at least 1 lattice unit, got {step}")
    x = _clip(start, low, high)
    fx = f(x)
    ds = directions(len(x))
    path = [x]
    while step >= 1:
        best = _poll(f, x, fx, ds, step, low, high) or _along_the_path(f, x, fx, path, ds, trail, low, high)
        if best is None:
            step //= 2
            continue
        fx, x = best
        path.append(x)
    return x


def _poll(f: Callable[[Point], float], x: Point, fx: float, ds: list[Point], step: int, low: Point, high: Point
          ) -> tuple[float, Point] | None:
    """The first of ``ds`` (``step`` units) that lowers ``f``, followed on (``_line``); it goes first in ``ds``."""
    for d in ds:
        y = _clip([a + step * b for a, b in zip(x, d, strict=True)], low, high)
        if y != x and (fy := f(y)) < fx:
            ds.remove(d)
            ds.insert(0, d)
            return _line(f, y, fy, d, step, low, high) or (fy, y)
    return None


def _along_the_path(f: Callable[[Point], float], x: Point, fx: float, path: list[Point], ds: list[Point],
                    trail: int, low: Point, high: Point) -> tuple[float, Point] | None:
    """The first line from a point of ``path`` (1, 2, 4, ... back) through ``x``, either way, that lowers ``f``
    (its direction reduced to the shortest lattice step), followed on; the poll's own directions are left out."""
    tried = set(ds)
    for back in (2 ** i for i in range(trail) if 2 ** i < len(path)):
        ahead = _primitive([a - b for a, b in zip(x, path[-1 - back], strict=True)])
        for d in (ahead, tuple(-a for a in ahead)):
            if d not in tried:
                tried.add(d)
                moved = _line(f, x, fx, d, 1, low, high)
                if moved:
                    return moved
    return None
