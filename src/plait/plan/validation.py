"""Leave-one-source-out validation of the datasheet GPU model on the published runs (``plan.published``).

Every fitted constant is fitted with one source held out, and the held-out source's runs are predicted with
those constants: that error is the yardstick. The in-fit error (every source in the fit) is reported beside
it. Fitting minimises the mean absolute log error of the step time over all the constants together (a pattern
search, ``fit``), through the public ``estimate`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from plait.plan.cluster import Cluster
from plait.plan.estimate import estimate
from plait.plan.pattern_search import pattern_search
from plait.plan.published import MemoryStatement, PublishedRun, memory_statements, sources


@dataclass(frozen=True)
class Constant:
    """A fitted constant: ``apply(run, value)`` returns the run as the model costs it with that value;
    ``uses(run)`` says whether the value changes that run's prediction (else the run is not evaluated while
    fitting it). Where no run of a fit uses it, it takes the value fitted for ``fallback`` (another constant of
    the same fit), else ``default``: never the shipped value, which the held-out source helped fit."""

    name: str
    default: float
    low: float
    high: float
    apply: Callable[[PublishedRun, float], PublishedRun]
    uses: Callable[[PublishedRun], bool]
    fallback: str | None = None
    gpu: str | None = None  # the GPU type whose runs alone it changes (a GEMM ceiling); None: every run's


def _on_gpu(run: PublishedRun, **fields: Any) -> PublishedRun:
    """``run`` with its GPU entry's model constants changed."""
    c = run.cluster
    cluster = Cluster(replace(c.gpu, **fields), c.n_gpus, c.gpus_per_node, c.interconnect, c.profile,
                      c.max_memory_fraction, flash_attention=c.attention)
    return replace(run, cluster=cluster)


def matmul_ceiling(gpu: str, low: float = 0.4, high: float = 0.9, fallback: str | None = None) -> Constant:
    """The best share of ``gpu``'s datasheet peak its GEMMs reach (``GPU.matmul_efficiency``); with no run of
    ``gpu`` in a fit, the ceiling fitted for ``fallback`` (a GPU type that has runs)."""

    def apply(run: PublishedRun, value: float) -> PublishedRun:
        return _on_gpu(run, matmul_efficiency=value) if run.gpu == gpu else run

    return Constant(f"matmul_efficiency[{gpu}]", (low + high) / 2, low, high, apply, lambda r: r.gpu == gpu,
                    f"matmul_efficiency[{fallback}]" if fallback else None, gpu)


def shared(field: str, low: float, high: float) -> Constant:
    """A model constant every GPU type shares (``GPU.<field>``), fitted as one value."""
    return Constant(field, (low + high) / 2, low, high,
                    lambda run, value: _on_gpu(run, **{field: value}), lambda r: True)


def default_constants() -> list[Constant]:
    """What is fitted: one matmul ceiling per GPU type in the set and the element-wise traffic."""
    return [matmul_ceiling("a100-80gb"), matmul_ceiling("h100-sxm", fallback="a100-80gb"),
            shared("elementwise_traffic", 0.2, 3.0)]


def predict(run: PublishedRun) -> float:
    """Predicted step seconds of ``run`` as it stands (its constants applied)."""
    return estimate(run.model, run.cluster, run.layout, run.training).step_time_s


def with_values(run: PublishedRun, constants: Sequence[Constant], values: dict[str, float]) -> PublishedRun:
    for c in constants:
        if c.name in values:
            run = c.apply(run, values[c.name])
    return run


# The fit's lattice: a constant at ``k`` units is ``default · exp(k · UNIT)`` (steps of about 0.2%); the search
# starts ``FIRST_STEP`` units (about 6%) a step and halves down to one unit.
UNIT = 2.0 ** -9
FIRST_STEP = 32

Cache = dict[tuple[PublishedRun, tuple[tuple[str, int], ...]], float]


def _units(c: Constant, value: float, rounding: Callable[[float], int]) -> int:
    return rounding(math.log(value / c.default) / UNIT)


def _value(c: Constant, k: int) -> float:
    return c.default * math.exp(k * UNIT)


def fit(rs: Sequence[PublishedRun], constants: Sequence[Constant], cache: Cache | None = None) -> dict[str, float]:
    """Constants minimising the mean |log(predicted/published)| over ``rs``, all together: a pattern search
    (``plan.pattern_search``) on the lattice of ``UNIT`` steps inside each constant's bounds, from the defaults, so
    that from the values returned no step of one unit in any constant, or in any two together, lowers the mean.
    A constant no run in ``rs`` uses takes its fallback's fitted value, else its default (``Constant``).
    ``cache`` keeps each run's prediction by the lattice point of the constants it uses; fits that share it
    (leave-one-source-out's) reuse one another's predictions."""
    cache = {} if cache is None else cache
    free = [c for c in constants if any(c.uses(r) for r in rs)]
    used = [(r, [i for i, c in enumerate(free) if c.uses(r)]) for r in rs]

    def prediction(r: PublishedRun, mine: list[int], point: tuple[int, ...]) -> float:
        key = (r, tuple((free[i].name, point[i]) for i in mine))
        if key not in cache:
            cache[key] = predict(with_values(r, free, {free[i].name: _value(free[i], point[i]) for i in mine}))
        return cache[key]

    def loss(point: tuple[int, ...]) -> float:
        return sum(abs(math.log(prediction(r, mine, point) / r.step_s)) for r, mine in used) / len(rs)

    low = tuple(_units(c, c.low, math.ceil) for c in free)
    high = tuple(_units(c, c.high, math.floor) for c in free)
    best = pattern_search(loss, tuple(0 for _ in free), low, high, FIRST_STEP) if free else ()
    values = {c.name: c.default for c in constants}
    values.update({c.name: _value(c, k) for c, k in zip(free, best, strict=True)})
    for c in constants:
        if c.fallback and c.fallback in values and c not in free:
            values[c.name] = values[c.fallback]
    return values


@dataclass(frozen=True)
class Row:
    """One run's prediction: with every source in the fit, and with its own source held out."""

    run: PublishedRun
    in_fit_s: float
    held_out_s: float

    @property
    def in_fit_error(self) -> float:
        return self.in_fit_s / self.run.step_s - 1

    @property
    def held_out_error(self) -> float:
        return self.held_out_s / self.run.step_s - 1


@dataclass(frozen=True)
class Report:
    """Per-run rows, the constants fitted on everything, and those fitted without each source."""

    rows: list[Row]
    in_fit: dict[str, float]
    held_out: dict[str, dict[str, float]]  # source -> constants fitted without it

    @staticmethod
    def _stats(errors: list[float]) -> tuple[float, float]:
        absolute = [abs(e) for e in errors]
        return 100 * sum(absolute) / len(absolute), 100 * max(absolute)

    def in_fit_stats(self) -> tuple[float, float]:
        """(mean |error| %, max |error| %) with every source in the fit."""
        return self._stats([r.in_fit_error for r in self.rows])

    def held_out_stats(self) -> tuple[float, float]:
        """(mean |error| %, max |error| %) of each run predicted with its source held out."""
        return self._stats([r.held_out_error for r in self.rows])

    def by_source(self) -> dict[str, tuple[float, float]]:
        """Held-out (mean, max) |error| % per source."""
        out: dict[str, list[float]] = {}
        for r in self.rows:
            out.setdefault(r.run.source, []).append(r.held_out_error)
        return {s: self._stats(e) for s, e in out.items()}


def leave_one_source_out(rs: Sequence[PublishedRun], constants: Sequence[Constant] | None = None) -> Report:
    """Fit on all runs (in-fit), then once per source without it, predicting the held-out source's runs (the
    fits share one cache of predictions: ``fit``)."""
    constants = list(constants if constants is not None else default_constants())
    rs = list(rs)
    cache: Cache = {}
    everything = fit(rs, constants, cache)
    held: dict[str, dict[str, float]] = {}
    held_s: dict[int, float] = {}
    for s in sources(rs):
        values = fit([r for r in rs if r.source != s], constants, cache)
        held[s] = values
        for i, r in enumerate(rs):
            if r.source == s:
                held_s[i] = predict(with_values(r, constants, values))
    rows = [Row(r, predict(with_values(r, constants, everything)), held_s[i]) for i, r in enumerate(rs)]
    return Report(rows, everything, held)


def format_report(report: Report) -> str:
    """The per-run table (published, in-fit and held-out predictions), per-source and overall errors."""
    lines = [f"{'source':28} {'run':36} {'published':>10} {'in-fit':>8} {'err':>7} {'held-out':>9} {'err':>7}"]
    for r in report.rows:
        lines.append(f"{r.run.source[:28]:28} {r.run.label[:36]:36} {r.run.step_s:>9.2f}s {r.in_fit_s:>7.2f}s "
                     f"{100 * r.in_fit_error:>+6.1f}% {r.held_out_s:>8.2f}s {100 * r.held_out_error:>+6.1f}%")
    lines.append("")
    for s, (mean, worst) in report.by_source().items():
        fitted = ", ".join(f"{k} {v:.3f}" for k, v in report.held_out[s].items())
        lines.append(f"held out {s}: mean |error| {mean:.1f}%, max {worst:.1f}% (fitted without it: {fitted})")
    (fm, fx), (hm, hx) = report.in_fit_stats(), report.held_out_stats()
    n, k = len(report.rows), len(sources([r.run for r in report.rows]))
    lines.append(f"in-fit ({', '.join(f'{k_} {v:.3f}' for k_, v in report.in_fit.items())}): "
                 f"mean |error| {fm:.1f}%, max {fx:.1f}%")
    lines.append(f"held-out (leave one source out, {n} runs from {k} sources): mean |error| {hm:.1f}%, "
                 f"max {hx:.1f}%")
    return "\n".join(lines)


def memory_checks() -> list[tuple[MemoryStatement, float, bool]]:
    """Each published memory statement with the planner's peak bytes on the most loaded GPU and whether the
    planner agrees (its ``fits`` against the statement)."""
    out = []
    for s in memory_statements():
        e = estimate(s.model, s.cluster, s.layout, s.training)
        out.append((s, e.memory.total, e.fits == s.fits))
    return out


def format_memory_checks(rows: list[tuple[MemoryStatement, float, bool]]) -> str:
    lines = []
    for s, total, agrees in rows:
        usable = s.cluster.usable_memory
        lines.append(f"{s.label}: published {'fits' if s.fits else 'out of memory'}; planner {total / 1e9:.1f} GB "
                     f"of {usable / 1e9:.1f} usable -> {'agrees' if agrees else 'DISAGREES'} ({s.where})")
    return "\n".join(lines)


def _groups(rs: Sequence[PublishedRun]) -> dict[tuple[str, str], list[PublishedRun]]:
    """The runs by (source, GPU type): the units whose mean error a constant can move together."""
    out: dict[tuple[str, str], list[PublishedRun]] = {}
    for r in rs:
        out.setdefault((r.source, r.gpu), []).append(r)
    return out


def group_bias(rs: Sequence[PublishedRun]) -> float:
    """The mean signed error (predicted/published - 1) of ``rs`` as they stand: their mean |error|, and so their
    largest, is at least its absolute value."""
    return sum(predict(r) / r.step_s - 1 for r in rs) / len(rs)


@dataclass(frozen=True)
class Floor:
    """How far apart the sources are for this model: the least that values of the fitted constants (inside their
    bounds) leave the worst (source, GPU) group's |mean error| at.

    ``error``: that least (each GPU's ceiling exact, the shared constants by search), which no fit, in-fit or held
    out, brings the largest run error below, since a group's largest |error| is at least its mean's; ``values``:
    the constants where it is reached; ``bias``: each group's mean signed error there."""

    error: float
    values: dict[str, float]
    bias: dict[tuple[str, str], float]


def _ceiling_floor(groups: dict[tuple[str, str], list[PublishedRun]], ceiling: Constant,
                   values: dict[str, float], others: Sequence[Constant], steps: int) -> tuple[float, float]:
    """(ceiling value, floor) over the groups of one GPU type, the other constants at ``values``. A higher
    ceiling never slows a run (tests/test_plan_published.py checks it on every run), so every group's mean error
    falls as it rises: the largest |mean error| is least where the highest and the lowest group means are
    opposite (bisection on their sum)."""
    def bounds(x: float) -> tuple[float, float]:
        b = [group_bias([ceiling.apply(with_values(r, others, values), x) for r in g]) for g in groups.values()]
        return max(b), min(b)

    lo, hi = ceiling.low, ceiling.high
    for _ in range(steps):
        mid = (lo + hi) / 2
        top, bottom = bounds(mid)
        if top + bottom > 0:  # still too slow on balance: raise the ceiling
            lo = mid
        else:
            hi = mid
    x = (lo + hi) / 2
    top, bottom = bounds(x)
    return x, max(abs(top), abs(bottom))


def disagreement_floor(rs: Sequence[PublishedRun], constants: Sequence[Constant] | None = None,
                       grid: int = 6, rounds: int = 2, steps: int = 10) -> Floor:
    """The ``Floor`` of ``rs``: each GPU type's ceiling set by bisection inside its bounds (exact, the error being
    monotone in it: ``steps`` halvings), every shared constant (the element-wise traffic) searched on
    ``grid`` points of its bounds, then ``rounds - 1`` times on as many around the best of them."""
    constants = list(constants if constants is not None else default_constants())
    ceilings = [c for c in constants if c.gpu]
    shared_ = [c for c in constants if c not in ceilings]
    groups = _groups(rs)

    def at(point: dict[str, float]) -> tuple[float, dict[str, float]]:
        values = dict(point)
        worst = 0.0
        for c in ceilings:
            mine = {k: g for k, g in groups.items() if c.uses(g[0])}
            if not mine:
                continue
            values[c.name], err = _ceiling_floor(mine, c, point, shared_, steps)
            worst = max(worst, err)
        return worst, values

    best: tuple[float, dict[str, float]] = at({c.name: c.default for c in shared_})
    for c in shared_:  # one shared constant at a time: a grid over its bounds, then over the spans beside the best
        lo, hi = c.low, c.high
        for _ in range(rounds):
            points = [lo + (hi - lo) * i / (grid - 1) for i in range(grid)]
            tried = [(at({**{k.name: best[1][k.name] for k in shared_}, c.name: x}), x) for x in points]
            (err, values), x = min(tried, key=lambda t: t[0][0])
            if err <= best[0]:
                best = (err, values)
            span = (hi - lo) / (grid - 1)
            lo, hi = max(c.low, x - span), min(c.high, x + span)
    err, values = best
    bias = {k: group_bias([with_values(r, constants, values) for r in g]) for k, g in groups.items()}
    return Floor(err, values, bias)


def format_floor(floor: Floor, own: dict[tuple[str, str], float] | None = None) -> str:
    """The floor, each group's mean signed error there and, given, each group's own fitted ceiling."""
    lines = [f"disagreement floor: no values of the fitted constants bring every (source, GPU) group's mean error "
             f"within {100 * floor.error:.1f}% (at {', '.join(f'{k} {v:.3f}' for k, v in floor.values.items())}); "
             f"a group's largest run error is at least its mean's"]
    for (s, g), b in sorted(floor.bias.items(), key=lambda kv: kv[1]):
        fitted = f", fitted on it alone: ceiling {own[(s, g)]:.3f}" if own and (s, g) in own else ""
        lines.append(f"  {s[:28]:28} {g:10} mean error {100 * b:+6.1f}%{fitted}")
    return "\n".join(lines)


def own_ceilings(rs: Sequence[PublishedRun], constants: Sequence[Constant] | None = None
                 ) -> dict[tuple[str, str], float]:
    """Each (source, GPU) group's GEMM ceiling fitted on that group alone (the other constants as shipped)."""
    constants = list(constants if constants is not None else default_constants())
    out = {}
    for (s, g), grp in _groups(rs).items():
        mine = [c for c in constants if c.gpu == g]
        if mine:
            out[(s, g)] = fit(grp, mine)[mine[0].name]
    return out
